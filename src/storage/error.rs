//! What can go wrong with the artifact store, in the terms callers act on.

use std::io;

/// A store operation that failed. `Unavailable` is worth retrying later: the bytes are still
/// there (or were never written), and the store may come back (network, 5xx, credentials
/// being rotated); workers retry with backoff and give the job back, the API answers 503.
/// `Missing` is an object that should exist and does not: something outside exportd deleted it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the object store is unavailable: {0}")]
    Unavailable(String),
    /// The store refused: credentials it does not accept or that may not do this, or a bucket
    /// that does not exist. Retrying does not help until someone changes something.
    #[error("the object store refused: {0}")]
    Refused(String),
    #[error("the stored object `{0}` does not exist")]
    Missing(String),
    #[error("local artifact storage: {0}")]
    Io(#[from] io::Error),
    /// A request to a bucket failed. `reason` may be shown to whoever owns the bucket; `detail`
    /// (the store's own words: statuses, response bodies) is for the server's log only.
    #[error("{reason} ({detail})")]
    Remote { reason: RemoteReason, detail: String },
}

/// Why a request to a bucket failed, as a stable code and what to do about it: never a remote
/// status or body, never the address a name resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteReason {
    /// The outbound guard refused the address (the text names its kind and the setting).
    AddressRefused(String),
    AccessDenied,
    NotFound,
    Timeout,
    Unreachable,
    Failed,
}

impl RemoteReason {
    pub fn code(&self) -> &'static str {
        match self {
            RemoteReason::AddressRefused(_) => "address-refused",
            RemoteReason::AccessDenied => "access-denied",
            RemoteReason::NotFound => "not-found",
            RemoteReason::Timeout => "timeout",
            RemoteReason::Unreachable => "unreachable",
            RemoteReason::Failed => "remote-error",
        }
    }

    /// Whether trying again later cannot help until someone changes something.
    pub fn is_refusal(&self) -> bool {
        matches!(self, RemoteReason::AddressRefused(_) | RemoteReason::AccessDenied)
    }

    fn classify(error: &object_store::Error) -> RemoteReason {
        if let Some(refused) = crate::outbound::AddressRefused::find(error) {
            return RemoteReason::AddressRefused(refused.0.clone());
        }
        match error {
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                return RemoteReason::AccessDenied;
            }
            object_store::Error::NotFound { .. } => return RemoteReason::NotFound,
            _ => {}
        }
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = cause {
            if let Some(http) = e.downcast_ref::<object_store::client::HttpError>() {
                return match http.kind() {
                    object_store::client::HttpErrorKind::Timeout => RemoteReason::Timeout,
                    object_store::client::HttpErrorKind::Connect => RemoteReason::Unreachable,
                    _ => RemoteReason::Failed,
                };
            }
            cause = e.source();
        }
        RemoteReason::Failed
    }
}

impl std::fmt::Display for RemoteReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let code = self.code();
        match self {
            RemoteReason::AddressRefused(kind) => write!(f, "{code}: the endpoint leads to {kind}"),
            RemoteReason::AccessDenied => {
                write!(f, "{code}: access denied, the bucket refused the credentials (check them and what they may do)")
            }
            RemoteReason::NotFound => write!(f, "{code}: the bucket does not exist"),
            RemoteReason::Timeout => write!(f, "{code}: the bucket did not answer in time"),
            RemoteReason::Unreachable => write!(f, "{code}: could not connect to the endpoint"),
            RemoteReason::Failed => {
                write!(
                    f,
                    "{code}: the bucket answered a request with an error or a redirect (redirects are not followed)"
                )
            }
        }
    }
}

impl StoreError {
    /// Whether retrying later may succeed (everything but a local disk error). For exportd's own
    /// store a refusal counts too: credentials being rotated come back.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Refused(_) | StoreError::Remote { .. })
    }

    /// What may be shown to a bucket's owner: a remote failure's reason only.
    pub fn public(&self) -> String {
        match self {
            StoreError::Remote { reason, .. } => reason.to_string(),
            other => other.to_string(),
        }
    }

    /// Turns the error into an `io::Error` for `std::io::Write` callers, keeping it findable by
    /// [`find`].
    pub fn into_io(self) -> io::Error {
        match self {
            StoreError::Io(e) => e,
            other => io::Error::other(other),
        }
    }
}

impl From<object_store::Error> for StoreError {
    fn from(error: object_store::Error) -> Self {
        // The detail never holds credentials: object_store redacts them, and keys hold no secrets.
        // A missing object is `Missing` only where a caller asks for one that must exist (reads):
        // elsewhere (an upload the cleaner aborted) retrying is the answer.
        StoreError::Remote { reason: RemoteReason::classify(&error), detail: error.to_string() }
    }
}

/// The store error in an error chain, looking inside `io::Error`s too (their `source()` skips
/// the wrapped error itself).
pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a StoreError> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(found) = e.downcast_ref::<StoreError>() {
            return Some(found);
        }
        if let Some(found) = e.downcast_ref::<io::Error>().and_then(|io| io.get_ref()?.downcast_ref::<StoreError>()) {
            return Some(found);
        }
        cause = e.source();
    }
    None
}

pub type StoreResult<T> = Result<T, StoreError>;
