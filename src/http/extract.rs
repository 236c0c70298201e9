//! Request extractors: the authenticated caller, and a path whose rejections become problems.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::state::AppState;
use crate::auth::{self, AuthError, Caller};

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let caller = caller_from_headers(state, &parts.headers)?;
        admit(state, &caller)?;
        Ok(caller)
    }
}

/// Takes one request from the caller's API rate: every authenticated request pays, whatever
/// the route or credential (bearer token, download link, dashboard session). A refusal is a 429
/// that costs no database work (it is counted in memory).
pub fn admit(state: &AppState, caller: &Caller) -> Result<(), ApiError> {
    Ok(state.limits.check_api(caller)?)
}

/// The caller named by the `Authorization: Bearer` header, or a 401.
pub fn caller_from_headers(state: &AppState, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let header = headers.get(AUTHORIZATION).ok_or(AuthError::Missing);
    let token = header
        .and_then(|h| h.to_str().map_err(|_| AuthError::Malformed))
        .and_then(|h| bearer_token(h).ok_or(AuthError::Malformed))
        .map_err(|e| ApiError::unauthorized(&e))?;
    let caller = auth::authenticate(&state.registry, token).map_err(|e| ApiError::unauthorized(&e))?;
    in_request_span(&caller);
    Ok(caller)
}

/// Names the caller in the request's span, so every log line of the request carries them.
pub fn in_request_span(caller: &Caller) {
    let span = tracing::Span::current();
    span.record("tenant", caller.tenant.id.as_str());
    span.record("principal", caller.principal.id.as_str());
}

/// The bearer token of the request's `Authorization` header, if it has one — the one reading of
/// that header for the API, the dashboard and `/metrics`.
pub fn bearer_token_of(headers: &HeaderMap) -> Option<&str> {
    headers.get(AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(bearer_token)
}

/// The token of an `Authorization: Bearer <token>` header (scheme is case-insensitive).
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A JSON body whose errors name the offending field by its JSON path (`[3].key`,
/// `filter.region`), as problem+json. Requires `Content-Type: application/json`.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        require_json(request.headers())?;
        let body = Bytes::from_request(request, state).await?;
        let mut deserializer = serde_json::Deserializer::from_slice(&body);
        let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { "body".to_owned() } else { path };
            ApiError::new(StatusCode::BAD_REQUEST, "invalid-body", describe(e.inner())).with("field", field)
        })?;
        Ok(JsonBody(value))
    }
}

/// What is wrong with a body, without repeating any of its values (serde's own messages quote
/// the offending string or number): the kind of problem and what was expected.
fn describe(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax => format!("the body is not valid JSON (line {}, column {})", e.line(), e.column()),
        Category::Eof => "the body ends before its JSON does".to_owned(),
        Category::Io => "the body could not be read".to_owned(),
        Category::Data => {
            let message = e.to_string();
            let message = message.split(" at line ").next().unwrap_or_default();
            // "invalid type: string \"…\", expected X" → "expected X"; "missing field `f`" stays.
            match message.find(", expected ") {
                Some(at) => format!("wrong type or value: {}", &message[at + 2..]),
                None if message.starts_with("missing field") || message.starts_with("duplicate field") => {
                    message.to_owned()
                }
                None => "wrong type or value".to_owned(),
            }
        }
    }
}

fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let content_type = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "send application/json"))
    }
}

/// `axum::extract::Path` whose rejection is a problem+json.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

/// `axum::extract::Query` whose rejection is a problem+json.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

#[cfg(test)]
mod tests {
    use super::{bearer_token, describe};

    #[test]
    fn body_errors_never_repeat_the_submitted_values() {
        let error = |json: &str| {
            #[derive(Debug, serde::Deserialize)]
            #[allow(dead_code)]
            struct Body {
                n: u32,
                s: std::collections::BTreeMap<String, String>,
            }
            describe(&serde_json::from_str::<Body>(json).unwrap_err())
        };
        let secret = error(r#"{"n": "CONFIDENTIAL: patient has HIV", "s": {}}"#);
        assert!(!secret.contains("CONFIDENTIAL"), "{secret}");
        assert!(secret.contains("expected u32"), "{secret}");
        assert!(!error(r#"{"n": 99999999999, "s": {}}"#).contains("99999999999"));
        assert_eq!(error(r#"{"s": {}}"#), "missing field `n`");
        assert!(error(r#"{"n": 1,"#).starts_with("the body ends") || error(r#"{"n": 1,"#).contains("not valid JSON"));
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }
}
