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
}

impl StoreError {
    /// Whether retrying later may succeed (everything but a local disk error). For exportd's own
    /// store a refusal counts too: credentials being rotated come back.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Refused(_))
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
        // The message never holds credentials: object_store redacts them, and keys hold no secrets.
        // A missing object is `Missing` only where a caller asks for one that must exist (reads):
        // elsewhere (an upload the cleaner aborted) retrying is the answer.
        match error {
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                StoreError::Refused(format!("access denied (check the credentials and what they may do): {error}"))
            }
            other => StoreError::Unavailable(other.to_string()),
        }
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
