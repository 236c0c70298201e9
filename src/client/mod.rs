//! The partner side: `exportd download` fetches a published export with resume and checksum
//! verification; `exportd pull` follows a dataset's change feed into a JSONL file.

mod download;
mod pull;

pub use download::{DownloadOptions, download};
pub use pull::{PullOptions, pull};
