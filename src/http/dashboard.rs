//! `GET /dashboard`: a server-rendered page for tenant admins — usage against limits, queue depth
//! and ages, recent exports — refreshing itself. No script, no external assets. Sign-in turns an
//! admin's bearer token (posted from this page) or a sign-in ticket into a dashboard session
//! (`session.rs`); the cookie never holds the API token.

use std::fmt::Write;

use axum::extract::State;
use axum::http::header::{CONTENT_SECURITY_POLICY, CONTENT_TYPE, LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use super::session;
use super::state::AppState;
use crate::auth::{self, Caller};
use crate::exports::{self, ExportJob};
use crate::quota::Usage;

const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'";

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/dashboard", get(dashboard))
        .route("/dashboard/signin", post(sign_in))
        .route("/dashboard/session", get(open_ticket))
        .route("/v1/dashboard/tickets", post(new_ticket))
}

#[derive(Deserialize)]
struct SignIn {
    token: String,
}

/// The sign-in form: an admin's bearer token, posted from the dashboard's own page, becomes a
/// dashboard session (the token itself is not kept).
async fn sign_in(State(state): State<AppState>, headers: HeaderMap, Form(form): Form<SignIn>) -> Response {
    if !session::same_origin(&headers) {
        return page(StatusCode::FORBIDDEN, &sign_in_form(Some("Sign in from the dashboard's own page.")));
    }
    match admin(&state, form.token.trim()) {
        Some(caller) => signed_in(&state, &caller, &headers),
        None => page(StatusCode::UNAUTHORIZED, &sign_in_form(Some("That token is not a valid tenant admin token."))),
    }
}

/// `POST /v1/dashboard/tickets` (tenant admin, bearer): a one-minute link that signs a browser in.
async fn new_ticket(State(state): State<AppState>, caller: Caller) -> Response {
    if !caller.principal.is_admin() {
        return super::ApiError::forbidden("only tenant admins can open the dashboard").into_response();
    }
    let url = format!("/dashboard/session?ticket={}", session::new_ticket(&state, &caller));
    let expires_at = session::ticket_expiry(&state).format(&time::format_description::well_known::Rfc3339);
    axum::Json(serde_json::json!({"url": url, "expires_at": expires_at.unwrap_or_default()})).into_response()
}

#[derive(Deserialize)]
struct Ticket {
    ticket: String,
}

async fn open_ticket(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Query(ticket): axum::extract::Query<Ticket>,
) -> Response {
    match session::ticket_caller(&state, &ticket.ticket) {
        Some(caller) => signed_in(&state, &caller, &headers),
        None => page(StatusCode::UNAUTHORIZED, &sign_in_form(Some("That sign-in link is not valid or has expired."))),
    }
}

fn signed_in(state: &AppState, caller: &Caller, headers: &HeaderMap) -> Response {
    let cookie = session::cookie(&session::new_session(state, caller), headers);
    let mut response = (StatusCode::SEE_OTHER, [(LOCATION, "/dashboard")]).into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(SET_COOKIE, value);
    }
    response
}

async fn dashboard(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let bearer = bearer(&headers).and_then(|t| admin(&state, t));
    let Some(caller) = bearer.or_else(|| session::session_caller(&state, &headers)) else {
        return page(StatusCode::OK, &sign_in_form(None));
    };
    if let Err(refused) = super::extract::admit(&state, &caller) {
        return refused.into_response();
    }
    let usage = super::usage::tenant_usage(&state, &caller.tenant).await;
    let recent = exports::list(&state.pool, &caller, None, None, 20).await;
    match (usage, recent) {
        (Ok(usage), Ok(recent)) => page(StatusCode::OK, &render(&caller, &usage, &recent.jobs, state.clock.now())),
        _ => page(StatusCode::INTERNAL_SERVER_ERROR, "<p>The dashboard could not be loaded; see the server log.</p>"),
    }
}

/// The bearer token of an Authorization header (API clients reading the page).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    super::extract::bearer_token_of(headers)
}

fn admin(state: &AppState, token: &str) -> Option<Caller> {
    auth::authenticate(&state.registry, token).ok().filter(|c| c.principal.is_admin())
}

fn page(status: StatusCode, body: &str) -> Response {
    let html = format!(
        "<!doctype html><html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content=10>\
         <title>exportd dashboard</title><style>{STYLE}</style></head><body>{body}</body></html>"
    );
    let mut response = (status, html).into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    response
}

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:2em;color:#222}h1{font-size:20px}\
    .bar{background:#eee;width:320px;height:14px;display:inline-block;vertical-align:middle;margin-right:8px}\
    .bar>div{background:#3b82f6;height:100%}.bar.full>div{background:#dc2626}\
    table{border-collapse:collapse}td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}\
    .usage td:first-child{width:190px}";

fn sign_in_form(error: Option<&str>) -> String {
    let error = error.map(|e| format!("<p style=color:#dc2626>{}</p>", escape(e))).unwrap_or_default();
    format!(
        "<h1>exportd dashboard</h1>{error}<form method=post action=/dashboard/signin>\
         <label>Tenant admin bearer token <input name=token type=password size=60 autocomplete=off></label> \
         <button>Sign in</button></form>"
    )
}

fn render(caller: &Caller, usage: &Usage, recent: &[ExportJob], now: time::OffsetDateTime) -> String {
    let (u, l) = (&usage.usage, &usage.limits);
    let mut html = format!(
        "<h1>{} <small>({})</small></h1><h2>Usage against limits</h2><table class=usage>",
        escape(&caller.tenant.name),
        escape(caller.tenant.id.as_str())
    );
    let rows: [(&str, &str, i64, u64); 4] = [
        ("Running exports", "running_exports", u.running_exports, u64::from(l.max_running_exports)),
        ("Queued exports", "queued_exports", u.queued_exports, u64::from(l.max_queued_exports)),
        ("Stored bytes", "stored_bytes", u.stored_bytes, l.storage_bytes),
        ("Egress today (bytes)", "egress_bytes_today", u.egress_bytes_today, l.egress_bytes_per_day),
    ];
    for (label, key, used, limit) in rows {
        let percent = if limit == 0 { 100.0 } else { (used as f64 / limit as f64 * 100.0).min(100.0) };
        let full = if percent >= 100.0 { " full" } else { "" };
        let _ = write!(
            html,
            "<tr><td>{label}</td><td><span class='bar{full}'><div style='width:{percent:.1}%'></div></span>\
             <span data-metric={key}>{used}</span> / <span data-limit={key}>{limit}</span></td></tr>"
        );
    }
    let _ = write!(
        html,
        "<tr><td>Rows exported today</td><td data-metric=rows_exported_today>{}</td></tr>\
         <tr><td>Rate-limited requests</td><td data-metric=rate_limited_requests>{}</td></tr>\
         <tr><td>Quota rejections</td><td data-metric=quota_rejections>{}</td></tr></table>",
        u.rows_exported_today, u.rate_limited_requests, u.quota_rejections
    );
    html.push_str("<h2>Refusals today</h2><table><tr>");
    for kind in u.refusals_today.keys() {
        let _ = write!(html, "<th>{}</th>", escape(kind));
    }
    html.push_str("</tr><tr>");
    for (kind, n) in &u.refusals_today {
        let _ = write!(html, "<td data-refusals={}>{n}</td>", escape(kind));
    }
    html.push_str("</tr></table>");
    let age = |a: Option<i64>| a.map_or("–".to_owned(), |s| format!("{s} s"));
    let _ = write!(
        html,
        "<h2>Queue</h2><p>Oldest queued: <span data-metric=oldest_queued_age_seconds>{}</span> · oldest running: \
         <span data-metric=oldest_running_age_seconds>{}</span></p><table><tr>",
        age(usage.queue.oldest_queued_age_seconds),
        age(usage.queue.oldest_running_age_seconds)
    );
    for (state, count) in &usage.queue.states {
        let _ = write!(html, "<th>{}</th><td data-state={}>{count}</td>", escape(state), escape(state));
    }
    html.push_str("</tr></table><h2>Recent exports</h2><table><tr><th>Export</th><th>Dataset</th><th>State</th><th>Shards</th><th>Rows</th><th>Expected rows</th><th>ETA</th><th>Created</th></tr>");
    for job in recent {
        let outlook = job.outlook(now);
        let _ = write!(
            html,
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td data-expected-rows={id}>{}</td><td data-eta={id}>{}</td><td>{}</td></tr>",
            job.id,
            escape(&job.dataset),
            job.state.as_str(),
            job.shards_done,
            job.rows_done,
            outlook.rows_total_estimate.map_or("–".to_owned(), |rows| rows.to_string()),
            outlook.eta_seconds.map_or("–".to_owned(), |s| format!("{s} s")),
            job.created_at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default(),
            id = job.id,
        );
    }
    html.push_str("</table><p><small>Refreshes every 10 seconds.</small></p>");
    html
}

/// HTML-escapes text for element content and quoted attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header::AUTHORIZATION;

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("<script>\"x\" & 'y'"), "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;");
    }

    #[test]
    fn the_bearer_token_is_read_from_the_authorization_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(AUTHORIZATION, HeaderValue::from_static("Bearer other"));
        assert_eq!(bearer(&headers), Some("other"));
        headers.insert(AUTHORIZATION, HeaderValue::from_static("bearer other"));
        assert_eq!(bearer(&headers), Some("other"), "the scheme is case-insensitive, as for the API");
    }
}
