//! `GET /dashboard` and `GET /dashboard/exports/{id}`: server-rendered pages for tenant admins —
//! usage against limits with warnings, 30 days of history as SVG charts, partners and their feed
//! lag, recent exports, and one export's progress, shards and audit trail. Templates in
//! `pages.rs` (maud), charts in `charts.rs`, units in `units.rs`; no script, no external assets.
//! Sign-in turns an admin's bearer token (posted from the page) or a sign-in ticket into a
//! dashboard session (`session.rs`); the cookie never holds the API token.

mod charts;
mod pages;
mod units;

use axum::extract::{Path, State};
use axum::http::header::{CONTENT_SECURITY_POLICY, CONTENT_TYPE, LOCATION, SET_COOKIE, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::Markup;
use serde::Deserialize;

use super::session;
use super::state::AppState;
use crate::auth::{self, Caller};
use crate::exports::{self, ExportError};
use crate::usage::history::{self, Granularity};

const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'";

/// The largest sign-in form accepted (a token is well under 1 KiB).
const SIGN_IN_BODY: usize = 16 * 1024;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/dashboard", get(dashboard))
        .route("/dashboard/exports/{id}", get(export_page))
        // A sign-in form holds one token: a larger body is refused before it is read.
        .route("/dashboard/signin", post(sign_in).layer(axum::extract::DefaultBodyLimit::max(SIGN_IN_BODY)))
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
        return page(StatusCode::FORBIDDEN, pages::sign_in(Some("Sign in from the dashboard's own page.")));
    }
    match admin(&state, form.token.trim()) {
        Some(caller) => signed_in(&state, &caller, &headers),
        None => page(StatusCode::UNAUTHORIZED, pages::sign_in(Some("That token is not a valid tenant admin token."))),
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
    if session::from_another_site(&headers) {
        let refusal = "This sign-in link was opened from another site. Paste it into the address bar instead.";
        return page(StatusCode::FORBIDDEN, pages::sign_in(Some(refusal)));
    }
    match session::spend_ticket(&state, &ticket.ticket).await {
        Ok(Some(caller)) => signed_in(&state, &caller, &headers),
        Ok(None) => page(
            StatusCode::UNAUTHORIZED,
            pages::sign_in(Some("That sign-in link is not valid, has expired or was used already.")),
        ),
        Err(e) => super::ApiError::from(anyhow::Error::from(e)).into_response(),
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

/// The signed-in tenant admin (a dashboard session or an admin bearer token), or the page to
/// answer instead: the sign-in form (200 to a browser without credentials; 401 to an invalid
/// bearer token), 403 to a valid token that is not an admin's, or a refusal of the tenant's
/// request limits.
fn signed_in_admin(state: &AppState, headers: &HeaderMap) -> Result<Caller, Box<Response>> {
    let caller = match bearer(headers) {
        Some(token) => match auth::authenticate(&state.registry, token) {
            Ok(caller) if caller.principal.is_admin() => caller,
            Ok(_) => {
                let refusal = pages::message("Not for partners", "The dashboard is for the tenant's admins.");
                return Err(Box::new(page(StatusCode::FORBIDDEN, refusal)));
            }
            Err(_) => {
                let form = pages::sign_in(Some("That token is not a valid tenant admin token."));
                let mut refused = page(StatusCode::UNAUTHORIZED, form);
                refused.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return Err(Box::new(refused));
            }
        },
        None => session::session_caller(state, headers)
            .ok_or_else(|| Box::new(page(StatusCode::OK, pages::sign_in(None))))?,
    };
    super::extract::admit(state, &caller).map_err(|refused| Box::new(refused.into_response()))?;
    Ok(caller)
}

async fn dashboard(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let caller = match signed_in_admin(&state, &headers) {
        Ok(caller) => caller,
        Err(answer) => return *answer,
    };
    match overview(&state, &caller).await {
        Ok(markup) => page(StatusCode::OK, markup),
        Err(e) => {
            tracing::error!(error = %e, "the dashboard could not be loaded");
            page(
                StatusCode::INTERNAL_SERVER_ERROR,
                pages::message("Not available", "The dashboard could not be loaded; see the server log."),
            )
        }
    }
}

async fn overview(state: &AppState, caller: &Caller) -> Result<Markup, ExportError> {
    let now = state.clock.now();
    let usage = super::usage::tenant_usage(state, &caller.tenant).await?;
    let to = Granularity::Day.truncate(now) + Granularity::Day.step();
    let history =
        history::read(&state.pool, caller.tenant.id.as_str(), Granularity::Day, to - time::Duration::days(30), to)
            .await?;
    let partners = crate::usage::partners::activity(&state.pool, &caller.tenant, now).await?;
    let deliveries = crate::delivery::store::lag(&state.pool, caller.tenant.id.as_str()).await?;
    let attachments = crate::attach::of_tenant(&state.pool, caller.tenant.id.as_str()).await?;
    let recent = exports::list(&state.pool, caller, None, None, 20).await?;
    let overview = pages::Overview {
        tenant: &caller.tenant,
        usage: &usage,
        history: &history,
        partners: &partners,
        deliveries: &deliveries,
        attachments: &attachments,
        recent: &recent.jobs,
        now,
    };
    Ok(pages::layout("Usage", overview.render()))
}

/// One export: state, progress, ETA, shards, and who downloaded what from the audit log.
async fn export_page(State(state): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let caller = match signed_in_admin(&state, &headers) {
        Ok(caller) => caller,
        Err(answer) => return *answer,
    };
    let not_found =
        || page(StatusCode::NOT_FOUND, pages::message("No such export", "This tenant has no export with that id."));
    let Ok(id) = uuid::Uuid::parse_str(&id) else { return not_found() };
    let job = match exports::get(&state.pool, &caller, id).await {
        Ok(job) => job,
        Err(ExportError::NotFound) => return not_found(),
        Err(e) => {
            tracing::error!(error = %e, "an export page could not be loaded");
            return page(StatusCode::INTERNAL_SERVER_ERROR, pages::message("Not available", "See the server log."));
        }
    };
    let shards = exports::store::shards::all(&state.pool, job.id).await;
    let events = crate::audit::of_export(&state.pool, caller.tenant.id.as_str(), job.id, 200).await;
    match (shards, events) {
        (Ok(shards), Ok(events)) => {
            let view = pages::ExportPage { job: &job, shards: &shards, events: &events, now: state.clock.now() };
            page(StatusCode::OK, pages::layout(&format!("Export {}", job.id), view.render()))
        }
        _ => page(StatusCode::INTERNAL_SERVER_ERROR, pages::message("Not available", "See the server log.")),
    }
}

/// The bearer token of an Authorization header (API clients reading the page).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    super::extract::bearer_token_of(headers)
}

fn admin(state: &AppState, token: &str) -> Option<Caller> {
    auth::authenticate(&state.registry, token).ok().filter(|c| c.principal.is_admin())
}

fn page(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup.into_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header::AUTHORIZATION;

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
