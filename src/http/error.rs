//! The one error type of the HTTP edge, rendered as RFC 9457 `application/problem+json`.

use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::auth::AuthError;

pub type ApiResult<T> = Result<T, ApiError>;

/// A problem to report. `code` is stable and machine-readable; `detail` is for people and never
/// contains record data, tokens or anything about another tenant.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    /// Extra members of the problem object (`field`, `index`, …).
    pub members: Map<String, Value>,
    pub retry_after_seconds: Option<u64>,
    www_authenticate: Option<String>,
    /// Kept for the log of a 500; never sent.
    source: Option<anyhow::Error>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            detail: detail.into(),
            members: Map::new(),
            retry_after_seconds: None,
            www_authenticate: None,
            source: None,
        }
    }

    /// A 400 about one field of the request.
    pub fn invalid_field(field: impl Into<String>, detail: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid-request", detail).with("field", field.into())
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not-found", detail)
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    pub fn unauthorized(reason: &AuthError) -> Self {
        let challenge = match reason {
            // RFC 6750 §3.1: no error code when the request carried no credentials.
            AuthError::Missing => r#"Bearer realm="exportd""#.to_owned(),
            other => format!(r#"Bearer realm="exportd", error="invalid_token", error_description="{other}""#),
        };
        let mut e = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", reason.to_string());
        e.www_authenticate = Some(challenge);
        e
    }

    pub fn internal(source: impl Into<anyhow::Error>) -> Self {
        let mut e = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an internal error occurred; it has been logged",
        );
        e.source = Some(source.into());
        e
    }

    /// 503 with `Retry-After`: the database or the object store is briefly unreachable, or the
    /// request lost a race (deadlock, serialization) it could not win by retrying inside.
    /// Nothing was changed.
    pub fn unavailable(source: impl Into<anyhow::Error>) -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "temporarily-unavailable",
            "the service could not complete the request just now and changed nothing; retry after the Retry-After delay",
        );
        e.retry_after_seconds = Some(1);
        e.source = Some(source.into());
        e
    }

    pub fn with(mut self, member: &str, value: impl Into<Value>) -> Self {
        self.members.insert(member.to_owned(), value.into());
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self.source {
            Some(source) if self.status == StatusCode::SERVICE_UNAVAILABLE => {
                tracing::warn!(error = format!("{source:#}"), "request refused: transient database or storage error");
            }
            Some(source) => tracing::error!(error = format!("{source:#}"), "request failed"),
            None => {}
        }
        let mut body = json!({
            "type": format!("urn:exportd:problem:{}", self.code),
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "code": self.code,
            "detail": self.detail,
        });
        body.as_object_mut().expect("object").extend(self.members);
        let mut response = (self.status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after_seconds {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        if let Some(challenge) = self.www_authenticate.and_then(|c| HeaderValue::from_str(&c).ok()) {
            headers.insert(header::WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

/// Every quota refusal of the request path is a 429 with its code and `Retry-After`.
impl From<crate::quota::Rejection> for ApiError {
    fn from(rejection: crate::quota::Rejection) -> Self {
        let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, rejection.code(), rejection.to_string());
        if let crate::quota::Rejection::Queued { limit_name, limit, .. } = &rejection {
            e = e.with("limit", *limit_name).with("max", *limit);
        }
        e.retry_after_seconds = Some(rejection.retry_after().as_secs_f64().ceil().max(1.0) as u64);
        e
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if crate::db::is_transient(&e) { ApiError::unavailable(e) } else { ApiError::internal(e) }
    }
}

impl From<crate::storage::StoreError> for ApiError {
    fn from(e: crate::storage::StoreError) -> Self {
        match e {
            crate::storage::StoreError::Missing(_) => {
                tracing::error!(error = %e, "a published export's file is missing from the store");
                ApiError::new(
                    StatusCode::GONE,
                    "files-missing",
                    "the export's files are missing from the store (deleted outside exportd); create a new export",
                )
            }
            e if e.is_transient() => ApiError::unavailable(e),
            e => ApiError::internal(e),
        }
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        if crate::db::is_transient_chain(&e) { ApiError::unavailable(e) } else { ApiError::internal(e) }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        let code = match status {
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported-media-type",
            StatusCode::PAYLOAD_TOO_LARGE => "payload-too-large",
            _ => "invalid-body",
        };
        ApiError::new(status, code, rejection.body_text())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        let status = rejection.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE { "payload-too-large" } else { "invalid-body" };
        ApiError::new(status, code, rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid-path", without_input(&rejection.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid-query", without_input(&rejection.body_text()))
    }
}

/// An extractor's message without the value the client sent ("Cannot parse `limit` with value
/// `-1` to a `u32`" says which parameter and what it must be, not what it was): a problem never
/// repeats input.
fn without_input(message: &str) -> String {
    const MARK: &str = " with value `";
    let Some(at) = message.find(MARK) else { return message.to_owned() };
    let rest = &message[at + MARK.len()..];
    match rest.find('`') {
        Some(end) => format!("{}{}", &message[..at], &rest[end + 1..]),
        None => message[..at].to_owned(),
    }
}

/// Unmatched routes answer in the same problem format.
pub async fn fallback() -> ApiError {
    ApiError::not_found("no such resource")
}

/// The router's own 405 (a known path, another method) has an empty body: answer it as a
/// problem too. The router adds `Allow` after this layer, so the header still lists the methods.
pub async fn method_not_allowed_as_problem(response: axum::response::Response) -> axum::response::Response {
    use axum::http::header::CONTENT_TYPE;
    use axum::response::IntoResponse;
    if response.status() != StatusCode::METHOD_NOT_ALLOWED || response.headers().contains_key(CONTENT_TYPE) {
        return response;
    }
    let detail = "this resource does not answer this method; the Allow header lists those it does";
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", detail).into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn extractor_messages_lose_the_value_sent() {
        let text = "Cannot parse `limit` with value `<script>` to a `u32`";
        assert_eq!(super::without_input(text), "Cannot parse `limit` to a `u32`");
        assert_eq!(super::without_input("no value here"), "no value here");
    }
}
