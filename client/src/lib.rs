//! The partner side of exportd: `download` fetches a published export with resume and checksum
//! verification; `pull` follows a dataset's change feed into a JSONL file. It talks to the
//! server over its HTTP API only.

mod download;
mod pull;

pub use download::{DownloadOptions, download, file_sha256};
pub use pull::{PullOptions, pull};
