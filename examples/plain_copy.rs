//! The baseline of `scripts/bench-delivery`: a plain `object_store` copy of files into an S3
//! bucket, one after another, each streamed through `object_store`'s own `BufWriter` (one PUT
//! when small, a multipart upload otherwise) — what a program using the crate would do, without
//! exportd's leases, checksums or bookkeeping.
//!
//! `plain_copy <endpoint> <bucket> <prefix> <file>...` with AWS_ACCESS_KEY_ID and
//! AWS_SECRET_ACCESS_KEY set; prints the bytes copied and the seconds it took.

use std::sync::Arc;
use std::time::Instant;

use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::buffered::BufWriter;
use object_store::path::Path;
use tokio::io::AsyncWriteExt;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [endpoint, bucket, prefix, files @ ..] = args.as_slice() else {
        anyhow::bail!("usage: plain_copy <endpoint> <bucket> <prefix> <file>...");
    };
    let store: Arc<dyn ObjectStore> = Arc::new(
        AmazonS3Builder::from_env()
            .with_endpoint(endpoint)
            .with_bucket_name(bucket)
            .with_region("us-east-1")
            .with_allow_http(true)
            .build()?,
    );
    let started = Instant::now();
    let mut copied = 0u64;
    for file in files {
        let name = std::path::Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let mut writer = BufWriter::with_capacity(store.clone(), Path::from(format!("{prefix}/{name}")), 8 << 20);
        let mut source = tokio::fs::File::open(file).await?;
        copied += tokio::io::copy(&mut source, &mut writer).await?;
        writer.shutdown().await?;
    }
    println!("{copied} {:.6}", started.elapsed().as_secs_f64());
    Ok(())
}
