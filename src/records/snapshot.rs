//! `pg_snapshot` values: which transactions had committed at one instant.

use std::fmt;

use serde::{Deserialize, Serialize};
use sqlx::PgExecutor;

/// The text form of a PostgreSQL `pg_snapshot` (`xmin:xmax:xip,...`), e.g. `7294:7298:7294`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Snapshot(String);

impl Snapshot {
    /// `pg_current_snapshot()` of the executor's transaction. Take it on the primary: a hot
    /// standby reports an empty in-progress list.
    pub async fn current<'e>(executor: impl PgExecutor<'e>) -> sqlx::Result<Snapshot> {
        let text =
            sqlx::query_scalar!(r#"SELECT pg_current_snapshot()::text AS "snapshot!""#).fetch_one(executor).await?;
        Snapshot::parse(&text).map_err(sqlx::Error::Protocol)
    }

    pub fn parse(text: &str) -> Result<Snapshot, String> {
        let invalid = || format!("`{text}` is not a pg_snapshot");
        let mut parts = text.split(':');
        let (Some(xmin), Some(xmax), Some(xip), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(invalid());
        };
        let xmin: u64 = xmin.parse().map_err(|_| invalid())?;
        let xmax: u64 = xmax.parse().map_err(|_| invalid())?;
        if xmin > xmax {
            return Err(invalid());
        }
        if !xip.is_empty() {
            for xid in xip.split(',') {
                let xid: u64 = xid.parse().map_err(|_| invalid())?;
                if xid < xmin || xid >= xmax {
                    return Err(invalid());
                }
            }
        }
        Ok(Snapshot(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Snapshot {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Snapshot::parse(&s)
    }
}

impl From<Snapshot> for String {
    fn from(s: Snapshot) -> String {
        s.0
    }
}

#[cfg(test)]
mod tests {
    use super::Snapshot;

    #[test]
    fn parses_the_text_form() {
        assert!(Snapshot::parse("7294:7298:").is_ok());
        assert!(Snapshot::parse("7294:7298:7294,7296").is_ok());
        for bad in ["", "1:2", "1:2:3:4", "5:4:", "1:5:7", "a:b:", "1:5:2,", "1:5:;DROP"] {
            assert!(Snapshot::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
