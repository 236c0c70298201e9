//! The partner side: `exportd download` fetches a published export with resume and checksum
//! verification.

mod download;

pub use download::{DownloadOptions, download};
