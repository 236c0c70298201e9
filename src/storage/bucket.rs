//! Buckets in object storage, whichever cloud holds them: `s3://` (AWS or any S3-compatible
//! store), `gs://` (Google Cloud Storage) and `az://` (Azure Blob Storage). Each is one
//! `object_store` builder; everything after building — writing, reading, multipart uploads and
//! their cleanup — is one generic code path ([`super::remote`]). exportd's own artifact store
//! and partners' destinations are both buckets.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::multipart::MultipartStore;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use secrecy::{ExposeSecret, SecretString};

use super::ObjectKey;
use crate::outbound::GuardedConnector;

/// What the generic code path needs of a store: objects, and multipart uploads it can name (so
/// the ones a dead writer left are found again and aborted).
pub trait RemoteObjects: ObjectStore + MultipartStore {}
impl<T: ObjectStore + MultipartStore> RemoteObjects for T {}

/// Which cloud's protocol a bucket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    S3,
    Gcs,
    Azure,
}

impl Provider {
    pub fn scheme(self) -> &'static str {
        match self {
            Provider::S3 => "s3",
            Provider::Gcs => "gs",
            Provider::Azure => "az",
        }
    }
}

/// `s3://bucket/prefix`, `gs://bucket/prefix` or `az://container/prefix`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketUrl {
    pub provider: Provider,
    pub bucket: String,
    /// Key prefix inside the bucket (no leading or trailing `/`; may be empty).
    pub prefix: String,
}

impl BucketUrl {
    pub fn parse(url: &str) -> Result<BucketUrl, String> {
        let (scheme, rest) =
            url.split_once("://").ok_or_else(|| format!("`{url}` is not <scheme>://<bucket>[/<prefix>]"))?;
        let provider = [Provider::S3, Provider::Gcs, Provider::Azure]
            .into_iter()
            .find(|p| p.scheme() == scheme)
            .ok_or_else(|| format!("`{scheme}://` is none of s3://, gs:// or az://"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if !valid_bucket {
            return Err(format!("`{bucket}` is not a bucket name (3-63 of a-z 0-9 . -)"));
        }
        if !prefix.is_empty() {
            ObjectKey::parse(prefix)
                .map_err(|_| format!("the prefix `{prefix}` may only hold [A-Za-z0-9._-] and /"))?;
        }
        Ok(BucketUrl { provider, bucket: bucket.to_owned(), prefix: prefix.to_owned() })
    }
}

impl BucketUrl {
    /// `scheme://bucket/[prefix/]path`: where `path` is, as the bucket's owner names it.
    pub fn join(&self, path: &str) -> String {
        let prefix = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        format!("{}://{}/{prefix}{path}", self.provider.scheme(), self.bucket)
    }
}

impl std::fmt::Display for BucketUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}/{}", self.provider.scheme(), self.bucket, self.prefix)
    }
}

/// How to reach a bucket and who to be there. Secrets never appear in `Debug`.
#[derive(Clone)]
pub struct BucketConfig {
    pub url: BucketUrl,
    /// e.g. `http://127.0.0.1:8333` for SeaweedFS or MinIO, an emulator's address for GCS or
    /// Azure; `None` = the cloud's own endpoint.
    pub endpoint: Option<String>,
    /// S3 only (default `us-east-1`).
    pub region: Option<String>,
    pub credentials: Credentials,
}

/// Whose bucket it is: that decides who exportd may be there and how it connects.
#[derive(Debug, Clone)]
pub enum Reach {
    /// exportd's own artifact store, as the operator configured it: the environment's identity
    /// (instance roles, workload identity) may be used.
    Own,
    /// A partner's bucket: only with the credentials its destination names, and only through
    /// the guarded outbound client (no redirects, no proxies, every address checked).
    Partner(GuardedConnector),
}

/// Who to be at the bucket.
#[derive(Clone)]
pub enum Credentials {
    /// The environment's own: instance roles, workload identity (never for an explicit endpoint,
    /// never at a partner's bucket).
    Ambient,
    S3 {
        access_key_id: String,
        secret_access_key: SecretString,
    },
    /// A service account key (JSON).
    Gcs {
        service_account_key: SecretString,
    },
    Azure {
        account: String,
        access_key: SecretString,
    },
}

impl std::fmt::Debug for BucketConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketConfig")
            .field("url", &self.url.to_string())
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// How long one request to a bucket may take to connect, and in all: short — a worker's lease is
/// 30 s by default, and callers retry whole steps themselves.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

fn client_options() -> ClientOptions {
    ClientOptions::new().with_connect_timeout(CONNECT_TIMEOUT).with_timeout(REQUEST_TIMEOUT)
}

fn retry() -> RetryConfig {
    RetryConfig { backoff: BackoffConfig::default(), max_retries: 2, retry_timeout: Duration::from_secs(15) }
}

impl BucketConfig {
    /// `s3://bucket/prefix at endpoint`, for logs and `/healthz` (never a secret).
    pub fn describe(&self) -> String {
        let endpoint = self.endpoint.as_deref().map(|e| format!(" at {e}")).unwrap_or_default();
        format!("{}{endpoint}", self.url)
    }

    /// The store, reached as `reach` says.
    pub fn build(&self, reach: &Reach) -> anyhow::Result<Arc<dyn RemoteObjects>> {
        let options = client_options();
        let connector = match reach {
            Reach::Own => None,
            // Without credentials object_store would use the deployment's own identity (instance
            // metadata, application default credentials) and send it to the partner's endpoint.
            Reach::Partner(_) if matches!(self.credentials, Credentials::Ambient) => anyhow::bail!(
                "a partner's bucket is reached only with credentials its destination names, never exportd's own"
            ),
            Reach::Partner(connector) => Some(connector.clone()),
        };
        if let Some(endpoint) = &self.endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            anyhow::bail!("the endpoint `{endpoint}` must start with http:// or https://");
        }
        let allow_http = self.endpoint.as_deref().is_some_and(|e| e.starts_with("http://"));
        let mismatch = || anyhow::anyhow!("these credentials are not for {}://", self.url.provider.scheme());
        Ok(match self.url.provider {
            Provider::S3 => {
                let mut builder = AmazonS3Builder::new()
                    .with_bucket_name(&self.url.bucket)
                    .with_region(self.region.as_deref().unwrap_or("us-east-1"))
                    .with_virtual_hosted_style_request(false)
                    .with_retry(retry())
                    .with_client_options(options);
                if let Some(endpoint) = &self.endpoint {
                    builder = builder.with_endpoint(endpoint).with_allow_http(allow_http);
                }
                if let Some(connector) = connector {
                    builder = builder.with_http_connector(connector);
                }
                match &self.credentials {
                    Credentials::S3 { access_key_id, secret_access_key } => {
                        builder = builder
                            .with_access_key_id(access_key_id)
                            .with_secret_access_key(secret_access_key.expose_secret());
                    }
                    // Without keys object_store asks the cloud's instance metadata
                    // (169.254.169.254), which an S3-compatible server elsewhere does not have.
                    Credentials::Ambient if self.endpoint.is_some() => anyhow::bail!(
                        "no credentials for the object store at {}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                        self.endpoint.as_deref().unwrap_or_default()
                    ),
                    Credentials::Ambient => {}
                    _ => return Err(mismatch()),
                }
                Arc::new(builder.build()?)
            }
            Provider::Gcs => {
                let mut builder = GoogleCloudStorageBuilder::new()
                    .with_bucket_name(&self.url.bucket)
                    .with_retry(retry())
                    .with_client_options(options.with_allow_http(allow_http));
                if let Some(endpoint) = &self.endpoint {
                    builder = builder.with_base_url(endpoint);
                }
                if let Some(connector) = connector {
                    builder = builder.with_http_connector(connector);
                }
                match &self.credentials {
                    Credentials::Gcs { service_account_key } => {
                        builder = builder.with_service_account_key(service_account_key.expose_secret());
                    }
                    Credentials::Ambient => {}
                    _ => return Err(mismatch()),
                }
                Arc::new(builder.build()?)
            }
            Provider::Azure => {
                let mut builder = MicrosoftAzureBuilder::new()
                    .with_container_name(&self.url.bucket)
                    .with_retry(retry())
                    // (client options carry allow_http: set after them it would be overwritten)
                    .with_client_options(options.with_allow_http(allow_http));
                if let Some(endpoint) = &self.endpoint {
                    builder = builder.with_endpoint(endpoint.clone());
                }
                if let Some(connector) = connector {
                    builder = builder.with_http_connector(connector);
                }
                match &self.credentials {
                    Credentials::Azure { account, access_key } => {
                        builder = builder.with_account(account).with_access_key(access_key.expose_secret());
                    }
                    Credentials::Ambient => {}
                    _ => return Err(mismatch()),
                }
                Arc::new(builder.build()?)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_urls_name_a_provider_a_bucket_and_a_prefix() {
        let url = BucketUrl::parse("gs://partner-bucket/feeds/acme/").unwrap();
        assert_eq!(
            (url.provider, url.bucket.as_str(), url.prefix.as_str()),
            (Provider::Gcs, "partner-bucket", "feeds/acme")
        );
        assert_eq!(BucketUrl::parse("az://container").unwrap().prefix, "");
        assert!(BucketUrl::parse("ftp://bucket").unwrap_err().contains("s3://, gs:// or az://"));
        assert!(BucketUrl::parse("s3://B").unwrap_err().contains("bucket name"));
        assert!(BucketUrl::parse("s3://bucket/../x").unwrap_err().contains("prefix"));
    }
}
