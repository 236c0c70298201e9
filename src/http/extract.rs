//! Request extractors: the authenticated caller, and a path whose rejections become problems.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;

use super::error::ApiError;
use super::state::AppState;
use crate::auth::{self, AuthError, Caller};

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = parts.headers.get(AUTHORIZATION).ok_or(AuthError::Missing);
        let token = header
            .and_then(|h| h.to_str().map_err(|_| AuthError::Malformed))
            .and_then(|h| bearer_token(h).ok_or(AuthError::Malformed))
            .map_err(|e| ApiError::unauthorized(&e))?;
        let caller =
            auth::authenticate(&state.registry, token).map_err(|e| ApiError::unauthorized(&e))?;
        let span = tracing::Span::current();
        span.record("tenant", caller.tenant.id.as_str());
        span.record("principal", caller.principal.id.as_str());
        Ok(caller)
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme is case-insensitive).
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// `axum::extract::Path` whose rejection is a problem+json.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

#[cfg(test)]
mod tests {
    use super::bearer_token;

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }
}
