//! `exportd download <export-id> --out DIR`: reads the manifest, downloads the whole file (or the
//! shards, several at a time; always the shards for formats without a whole file, like Parquet), resumes `.part` files with `Range` + `If-Range`, restarts a file
//! whose validator changed, and verifies every sha256 against the manifest.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, IF_RANGE, RANGE};
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

#[derive(Debug, Clone)]
pub struct DownloadOptions {
    /// Server base URL, e.g. `http://127.0.0.1:8080`.
    pub base_url: String,
    pub token: String,
    pub export_id: String,
    pub out: PathBuf,
    /// Download the shards instead of the whole file (formats without one, like Parquet,
    /// always download their shards).
    pub shards: bool,
    /// Shards downloaded at once (implies `shards` when above 1).
    pub parallel: usize,
    /// Bytes per second per transfer, for slow links or tests (0 = unlimited).
    pub limit_rate: u64,
    pub progress: bool,
}

#[derive(Deserialize)]
struct Manifest {
    /// Absent for formats whose shards do not splice into one file (Parquet).
    file: Option<Entry>,
    shards: Vec<Entry>,
}

#[derive(Deserialize, Clone)]
struct Entry {
    name: String,
    bytes: u64,
    sha256: String,
}

/// One file to fetch: its manifest entry and the server path.
#[derive(Clone)]
struct Target {
    entry: Entry,
    path: String,
}

/// Downloads every target, then returns the files written (already complete ones included).
pub async fn download(options: &DownloadOptions) -> anyhow::Result<Vec<PathBuf>> {
    let client = reqwest::Client::builder().connect_timeout(Duration::from_secs(10)).build()?;
    let base = options.base_url.trim_end_matches('/');
    let manifest_url = format!("{base}/v1/exports/{}/manifest", options.export_id);
    let response = client.get(&manifest_url).header(AUTHORIZATION, format!("Bearer {}", options.token)).send().await?;
    let manifest: Manifest =
        serde_json::from_slice(&ok(response).await.context("fetching the manifest")?.bytes().await?)
            .context("reading the manifest")?;
    let targets: Vec<Target> = match manifest.file {
        Some(file) if !options.shards && options.parallel <= 1 => {
            vec![Target { entry: file, path: format!("/v1/exports/{}/file", options.export_id) }]
        }
        _ => (manifest.shards.iter().enumerate())
            .map(|(n, entry)| Target {
                entry: entry.clone(),
                path: format!("/v1/exports/{}/shards/{n}", options.export_id),
            })
            .collect(),
    };
    tokio::fs::create_dir_all(&options.out).await.with_context(|| format!("creating {}", options.out.display()))?;
    let bars = MultiProgress::new();
    if !options.progress {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let results = futures_util::stream::iter(targets.into_iter().map(|target| {
        let (client, bars) = (client.clone(), bars.clone());
        async move { fetch(&client, base, options, &target, &bars).await }
    }))
    // In manifest order, however they finish: the paths print in the order of the shards.
    .buffered(options.parallel.max(1))
    .collect::<Vec<_>>()
    .await;
    results.into_iter().collect()
}

async fn fetch(
    client: &reqwest::Client,
    base: &str,
    options: &DownloadOptions,
    target: &Target,
    bars: &MultiProgress,
) -> anyhow::Result<PathBuf> {
    let entry = &target.entry;
    let final_path = options.out.join(safe_name(&entry.name)?);
    if file_sha256(&final_path).await?.as_deref() == Some(entry.sha256.as_str()) {
        return Ok(final_path); // done on an earlier run
    }
    let part =
        final_path.with_extension(format!("{}.part", final_path.extension().and_then(|e| e.to_str()).unwrap_or("")));
    let mut have = tokio::fs::metadata(&part).await.map(|m| m.len()).unwrap_or(0);
    if have > entry.bytes {
        have = 0;
    }
    let bar = bars.add(ProgressBar::new(entry.bytes));
    bar.set_style(
        // 79 columns at most: one line per file in an 80-column terminal.
        ProgressStyle::with_template("{msg:20!} [{bar:20}] {bytes:>9}/{total_bytes:<9} {bytes_per_sec:>11} {eta:>3}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(entry.name.clone());
    // Resumed bytes were already on disk: the speed counts only what arrives from now on.
    bar.set_position(have);
    bar.tick();
    bar.reset_eta();
    if have < entry.bytes {
        let etag = format!("\"{}\"", entry.sha256);
        let mut request =
            client.get(format!("{base}{}", target.path)).header(AUTHORIZATION, format!("Bearer {}", options.token));
        if have > 0 {
            request = request.header(RANGE, format!("bytes={have}-")).header(IF_RANGE, &etag);
        }
        let response = ok(request.send().await?).await.with_context(|| format!("downloading {}", entry.name))?;
        let append = response.status() == StatusCode::PARTIAL_CONTENT;
        if append {
            say(bars, &format!("{}: resuming after the {have} bytes already downloaded", entry.name))?;
        } else if have > 0 {
            say(bars, &format!("{}: the file changed on the server; downloading it again", entry.name))?;
        }
        if !append {
            bar.set_position(0); // the server sent the whole file: the validator changed, or no ranges
        }
        let mut file =
            tokio::fs::OpenOptions::new().create(true).append(append).write(true).truncate(!append).open(&part).await?;
        let mut body = response.bytes_stream();
        let started = Instant::now();
        let mut received = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.with_context(|| format!("downloading {} (run again to resume)", entry.name))?;
            file.write_all(&chunk).await?;
            received += chunk.len() as u64;
            bar.inc(chunk.len() as u64);
            throttle(options.limit_rate, received, started).await;
        }
        file.sync_all().await?;
    }
    let actual = file_sha256(&part).await?.unwrap_or_default();
    if actual != entry.sha256 {
        tokio::fs::remove_file(&part).await.ok();
        bar.abandon_with_message(format!("{}: checksum mismatch", entry.name));
        bail!(
            "checksum mismatch for {}: the manifest says sha256 {}, the download has {actual}; removed it, run again to retry",
            entry.name,
            entry.sha256
        );
    }
    tokio::fs::rename(&part, &final_path).await?;
    bar.finish_with_message(format!("{} ✓", entry.name));
    Ok(final_path)
}

/// Sleeps so that `received` bytes since `started` stay under `rate` bytes per second.
async fn throttle(rate: u64, received: u64, started: Instant) {
    if rate == 0 {
        return;
    }
    let due = Duration::from_secs_f64(received as f64 / rate as f64);
    if let Some(wait) = due.checked_sub(started.elapsed()) {
        tokio::time::sleep(wait).await;
    }
}

/// The response if it succeeded, else an error carrying the problem's detail.
pub(super) async fn ok(response: reqwest::Response) -> anyhow::Result<reqwest::Response> {
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    let detail = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|p| Some(format!("{}: {}", p["code"].as_str()?, p["detail"].as_str()?)))
        .unwrap_or(body);
    bail!("the server answered {status}: {detail}")
}

/// Manifest names are plain file names; anything else could write outside `--out`.
fn safe_name(name: &str) -> anyhow::Result<&str> {
    let plain = !name.is_empty()
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if plain { Ok(name) } else { bail!("refusing the file name {name:?} from the manifest") }
}

/// The lowercase hex sha256 of the file at `path`, `None` when there is none.
pub async fn file_sha256(path: &Path) -> anyhow::Result<Option<String>> {
    use sha2::Digest;
    use tokio::io::AsyncReadExt;
    let mut file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let (mut hasher, mut buf) = (sha2::Sha256::new(), vec![0u8; 1 << 20]);
    loop {
        let n = file.read(&mut buf).await?;
        if n == 0 {
            return Ok(Some(hex::encode(hasher.finalize())));
        }
        hasher.update(&buf[..n]);
    }
}

/// A line above the progress bars, or on stderr when they are not drawn (not a terminal).
fn say(bars: &MultiProgress, line: &str) -> std::io::Result<()> {
    if bars.is_hidden() {
        eprintln!("{line}");
        Ok(())
    } else {
        bars.println(line)
    }
}

#[cfg(test)]
mod tests {
    use super::safe_name;

    #[test]
    fn manifest_names_cannot_escape_the_output_directory() {
        assert!(safe_name("tickets.csv.gz").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "x\\y"] {
            assert!(safe_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
