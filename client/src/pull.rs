//! `exportd pull --dataset D --cursor-file F --out changes.jsonl [--follow]`: appends feed pages
//! to a JSONL file and stores the cursor only after the page is durably written.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::header::AUTHORIZATION;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use super::download::ok;

#[derive(Debug, Clone)]
pub struct PullOptions {
    pub base_url: String,
    pub token: String,
    pub dataset: String,
    /// Holds the cursor between runs; when missing, created from `since_export` or else "now".
    pub cursor_file: PathBuf,
    /// A full export whose manifest's `next_cursor` starts the feed (the hand-off: the export
    /// holds everything before it, the feed every change after it).
    pub since_export: Option<String>,
    pub out: PathBuf,
    pub limit: usize,
    /// Keep polling at the end of the stream, with the server's suggested delay.
    pub follow: bool,
    pub progress: bool,
}

#[derive(Deserialize)]
struct Page {
    changes: Vec<Box<serde_json::value::RawValue>>,
    next_cursor: String,
    end_of_stream: bool,
    retry_after_seconds: Option<u64>,
}

/// Pulls until the end of the stream (or forever with `follow`); returns the changes written.
pub async fn pull(options: &PullOptions) -> anyhow::Result<u64> {
    let client = reqwest::Client::builder().connect_timeout(Duration::from_secs(10)).build()?;
    let base = options.base_url.trim_end_matches('/');
    let auth = format!("Bearer {}", options.token);
    let cursor = match tokio::fs::read_to_string(&options.cursor_file).await {
        Ok(text) => {
            if let Some(id) = &options.since_export {
                eprintln!(
                    "--since-export {id} ignored: the cursor file {} already holds the feed's position \
                     (delete it to start again where that export ends)",
                    options.cursor_file.display()
                );
            }
            text.trim().to_owned()
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (url, field) = match &options.since_export {
                Some(id) => (format!("{base}/v1/exports/{id}/manifest"), "next_cursor"),
                None => {
                    eprintln!(
                        "no cursor file yet: the feed starts now, so changes made from here on arrive on the next pull \
                         (--since-export ID starts where a full export ends)"
                    );
                    (format!("{base}/v1/datasets/{}/cursor", options.dataset), "cursor")
                }
            };
            let body: serde_json::Value = ok(client.get(url).header(AUTHORIZATION, &auth).send().await?)
                .await
                .context("finding where the feed starts")?
                .json()
                .await?;
            let cursor = body[field].as_str().with_context(|| format!("the server sent no `{field}`"))?.to_owned();
            save_cursor(&options.cursor_file, &cursor).await?;
            cursor
        }
        Err(e) => return Err(e).context("reading the cursor file"),
    };
    let bar = if options.progress { ProgressBar::new_spinner() } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{spinner} changes: {pos} {msg}").expect("a valid template"));
    let mut out = tokio::fs::OpenOptions::new().create(true).append(true).open(&options.out).await?;
    let changes_url = format!("{base}/v1/datasets/{}/changes", options.dataset);
    let feed = FeedClient { client: &client, url: &changes_url, auth: &auth, limit: options.limit };
    let mut written = 0u64;
    let mut page = feed.page(&cursor).await?;
    loop {
        let count = page.changes.len() as u64;
        let store = store_page(&mut out, &options.cursor_file, &page);
        if page.end_of_stream {
            store.await?;
            written += count;
            bar.set_position(written);
            if !options.follow {
                bar.finish_with_message("caught up");
                return Ok(written);
            }
            bar.set_message("caught up; waiting");
            tokio::time::sleep(Duration::from_secs(page.retry_after_seconds.unwrap_or(5).max(1))).await;
            page = feed.page(&page.next_cursor).await?;
            continue;
        }
        // The next page is asked for while this one is written and synced: the request needs
        // only this page's cursor, and the cursor file still moves only after the page is on disk.
        let (stored, next) = tokio::join!(store, feed.page(&page.next_cursor));
        stored?;
        written += count;
        bar.set_position(written);
        page = next?;
    }
}

/// Where and how pages are asked for.
struct FeedClient<'a> {
    client: &'a reqwest::Client,
    url: &'a str,
    auth: &'a str,
    limit: usize,
}

impl FeedClient<'_> {
    async fn page(&self, cursor: &str) -> anyhow::Result<Page> {
        let query = [("cursor", cursor), ("limit", &self.limit.to_string())];
        let response = self.client.get(self.url).query(&query).header(AUTHORIZATION, self.auth).send().await?;
        Ok(ok(response).await.context("pulling changes")?.json().await?)
    }
}

/// Appends a page's changes as JSONL lines and syncs them; only then moves the cursor file: a
/// crash in between repeats a page (changes are idempotent: apply upserts and deletes by key)
/// and never skips one.
async fn store_page(out: &mut tokio::fs::File, cursor_file: &std::path::Path, page: &Page) -> anyhow::Result<()> {
    let mut lines = Vec::new();
    for change in &page.changes {
        lines.extend_from_slice(change.get().as_bytes());
        lines.push(b'\n');
    }
    if !lines.is_empty() {
        out.write_all(&lines).await?;
        out.sync_data().await?;
    }
    save_cursor(cursor_file, &page.next_cursor).await
}

/// Replaces the cursor file atomically: temp file, fsync, rename.
async fn save_cursor(path: &std::path::Path, cursor: &str) -> anyhow::Result<()> {
    let temp = path.with_extension("tmp");
    let mut file = tokio::fs::File::create(&temp).await?;
    file.write_all(cursor.as_bytes()).await?;
    file.sync_all().await?;
    tokio::fs::rename(&temp, path).await.context("saving the cursor file")?;
    Ok(())
}
