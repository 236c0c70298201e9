//! Dashboard sessions. The cookie never holds an API token: it holds a session sealed with the
//! server key (tenant, principal, expiry), good for the dashboard only and for one hour. Sign-in
//! by form is accepted only from the dashboard's own origin (no cross-site sign-in); a tenant
//! admin's API client may instead ask for a one-minute sign-in ticket to open in a browser —
//! once, and not from another site's page (login CSRF).

use axum::http::HeaderMap;
use axum::http::header::{COOKIE, HOST, ORIGIN, REFERER};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::state::AppState;
use crate::auth::Caller;

pub const COOKIE_NAME: &str = "exportd_session";
/// A session lasts this long.
pub const SESSION_SECONDS: i64 = 3600;
/// A sign-in ticket must be used within this long.
pub const TICKET_SECONDS: i64 = 60;

const SESSION: &str = "exportd-dashboard-session";
const TICKET: &str = "exportd-dashboard-ticket";

#[derive(Serialize, Deserialize)]
struct Sealed {
    tenant: String,
    sub: String,
    exp: i64,
    /// A ticket's id, spent at its first use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<Uuid>,
}

fn seal(state: &AppState, purpose: &str, caller: &Caller, seconds: i64, id: Option<Uuid>) -> String {
    let exp = state.clock.now().unix_timestamp() + seconds;
    let sealed = Sealed { tenant: caller.tenant.id.to_string(), sub: caller.principal.id.to_string(), exp, id };
    state.links.seal(purpose, &serde_json::to_vec(&sealed).expect("serializes"))
}

/// The admin a sealed session or ticket names, if it is unexpired and the admin still exists
/// and is enabled; with the ticket's id and expiry.
fn open(state: &AppState, purpose: &str, text: &str) -> Option<(Caller, Sealed)> {
    let sealed: Sealed = serde_json::from_slice(&state.links.open(purpose, text)?).ok()?;
    if sealed.exp < state.clock.now().unix_timestamp() {
        return None;
    }
    let tenant = state.registry.get(&sealed.tenant)?;
    let principal = tenant.principal(&sealed.sub).filter(|p| p.is_admin() && !p.disabled)?;
    Some((Caller { tenant: tenant.clone(), principal: principal.clone() }, sealed))
}

pub fn new_session(state: &AppState, caller: &Caller) -> String {
    seal(state, SESSION, caller, SESSION_SECONDS, None)
}

pub fn new_ticket(state: &AppState, caller: &Caller) -> String {
    seal(state, TICKET, caller, TICKET_SECONDS, Some(Uuid::new_v4()))
}

/// The admin a ticket signs in, spending it: a ticket works once (a ticket without an id, from
/// before tickets had one, not at all).
pub async fn spend_ticket(state: &AppState, ticket: &str) -> sqlx::Result<Option<Caller>> {
    let Some((caller, Sealed { id: Some(id), exp, .. })) = open(state, TICKET, ticket) else { return Ok(None) };
    let expires_at = OffsetDateTime::from_unix_timestamp(exp).unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let spent = sqlx::query!(
        "WITH forgotten AS (DELETE FROM dashboard_tickets_spent WHERE expires_at < $3::timestamptz - interval '1 hour')
         INSERT INTO dashboard_tickets_spent (id, expires_at) VALUES ($1, $2)
         ON CONFLICT ON CONSTRAINT dashboard_tickets_spent_pkey DO NOTHING",
        id,
        expires_at,
        state.clock.now(),
    )
    .execute(&state.pool)
    .await?;
    Ok((spent.rows_affected() == 1).then_some(caller))
}

/// Whether the browser says the request was started by another site's page (`Sec-Fetch-Site:
/// cross-site` or `same-site`): a link opened from the address bar, a terminal or this
/// server's pages says `none` or `same-origin` (or, in an old browser, nothing).
pub fn from_another_site(headers: &HeaderMap) -> bool {
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    matches!(site, Some("cross-site" | "same-site")) || (headers.contains_key(ORIGIN) && !same_origin(headers))
}

/// The admin of the request's session cookie.
pub fn session_caller(state: &AppState, headers: &HeaderMap) -> Option<Caller> {
    let value = headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE_NAME)?.strip_prefix('='))?;
    open(state, SESSION, value).map(|(caller, _)| caller)
}

/// Whether a state-changing request comes from a page of this server: its `Origin` (or, when a
/// browser sent none, its `Referer`) names the host the request was sent to.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(HOST).and_then(|h| h.to_str().ok()) else { return false };
    let origin = headers.get(ORIGIN).or_else(|| headers.get(REFERER)).and_then(|o| o.to_str().ok());
    origin.is_some_and(|origin| {
        let rest = origin.strip_prefix("https://").or_else(|| origin.strip_prefix("http://"));
        rest.is_some_and(|rest| rest.split('/').next() == Some(host))
    })
}

/// The `Set-Cookie` value for a session: HttpOnly, scoped to the dashboard, `Secure` when the
/// browser reached us over TLS (directly or through a proxy that says so).
pub fn cookie(session: &str, headers: &HeaderMap) -> String {
    let forwarded_https =
        headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).is_some_and(|p| p.eq_ignore_ascii_case("https"));
    let origin_https = headers.get(ORIGIN).and_then(|v| v.to_str().ok()).is_some_and(|o| o.starts_with("https://"));
    let secure = if forwarded_https || origin_https { "; Secure" } else { "" };
    // Lax, not Strict: the redirect after sign-in must carry it.
    format!("{COOKIE_NAME}={session}; HttpOnly; SameSite=Lax; Path=/dashboard; Max-Age={SESSION_SECONDS}{secure}")
}

/// When a session made now ends, for the sign-in ticket's answer.
pub fn ticket_expiry(state: &AppState) -> OffsetDateTime {
    state.clock.now() + time::Duration::seconds(TICKET_SECONDS)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn only_requests_from_this_host_count_as_same_origin() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.insert(*name, HeaderValue::from_static(value));
            }
            h
        };
        assert!(same_origin(&headers(&[("host", "x:8080"), ("origin", "http://x:8080")])));
        assert!(same_origin(&headers(&[("host", "x:8080"), ("referer", "https://x:8080/dashboard")])));
        assert!(!same_origin(&headers(&[("host", "x:8080"), ("origin", "http://x:8080.evil.example")])));
        assert!(!same_origin(&headers(&[("host", "x:8080"), ("origin", "null")])));
        assert!(!same_origin(&headers(&[("host", "x:8080")])));
    }
}
