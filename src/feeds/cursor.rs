//! Feed cursors: opaque, versioned, tamper-evident positions. A cursor is an HS256 JWT signed
//! with a server key (the link keys), bound to tenant, principal, dataset and database cluster.

use jsonwebtoken::{Algorithm, Header, Validation};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::links::LinkKeys;

const AUDIENCE: &str = "exportd-cursor";
const VERSION: u32 = 1;

/// A position in a dataset's change stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub v: u32,
    pub aud: String,
    pub tenant: String,
    pub sub: String,
    pub dataset: String,
    /// `system_identifier` of the cluster: xids mean nothing on another one.
    pub cluster: String,
    /// The snapshot the next window starts at.
    pub from: String,
    /// Inside that window: the last key already delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// When `from` was taken (unix seconds): cursors older than the tombstone window expire.
    pub ts: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("the cursor is malformed, tampered with, or not for this dataset and principal")]
    Invalid,
    #[error(
        "the cursor is older than the tenant's tombstone window, or from another database; run a full export and continue from its next_cursor"
    )]
    Expired,
}

impl Cursor {
    pub fn new(tenant: &str, principal: &str, dataset: &str, cluster: &str, from: &str, ts: i64) -> Cursor {
        Cursor {
            v: VERSION,
            aud: AUDIENCE.to_owned(),
            tenant: tenant.to_owned(),
            sub: principal.to_owned(),
            dataset: dataset.to_owned(),
            cluster: cluster.to_owned(),
            from: from.to_owned(),
            after: None,
            ts,
        }
    }

    /// The opaque text. Deterministic: the same position always encodes the same way.
    pub fn encode(&self, keys: &LinkKeys) -> String {
        let (kid, encoding) = keys.signing_key();
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, self, &encoding).expect("cursors serialize")
    }

    /// Verifies and checks the binding to tenant, principal and dataset (any mismatch looks like
    /// tampering, revealing nothing), then the cluster and age.
    pub fn decode(
        keys: &LinkKeys,
        text: &str,
        tenant: &str,
        principal: &str,
        dataset: &str,
        cluster: &str,
        oldest_ts: i64,
    ) -> Result<Cursor, CursorError> {
        let header = jsonwebtoken::decode_header(text).map_err(|_| CursorError::Invalid)?;
        let decoding =
            keys.decoding_key(header.kid.as_deref().ok_or(CursorError::Invalid)?).ok_or(CursorError::Invalid)?;
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_audience(&[AUDIENCE]);
        validation.set_required_spec_claims(&["aud", "sub"]);
        validation.validate_exp = false;
        let cursor =
            jsonwebtoken::decode::<Cursor>(text, &decoding, &validation).map_err(|_| CursorError::Invalid)?.claims;
        if cursor.v != VERSION || cursor.tenant != tenant || cursor.sub != principal || cursor.dataset != dataset {
            return Err(CursorError::Invalid);
        }
        if cursor.cluster != cluster || cursor.ts < oldest_ts {
            return Err(CursorError::Expired);
        }
        Ok(cursor)
    }
}

/// The cluster's `system_identifier`, which cursors carry.
pub async fn system_identifier(pool: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("SELECT system_identifier::text FROM pg_control_system()").fetch_one(pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> LinkKeys {
        LinkKeys::parse("k=0123456789abcdef0123456789abcdef").unwrap()
    }

    #[test]
    fn cursors_round_trip_and_bind_their_owner() {
        let cursor =
            Cursor { after: Some("t-1".into()), ..Cursor::new("acme", "p", "tickets", "42", "10:12:11", 1000) };
        let text = cursor.encode(&keys());
        assert_eq!(text, cursor.encode(&keys()), "deterministic");
        assert_eq!(Cursor::decode(&keys(), &text, "acme", "p", "tickets", "42", 0), Ok(cursor));
        for (tenant, principal, dataset) in
            [("globex", "p", "tickets"), ("acme", "q", "tickets"), ("acme", "p", "contacts")]
        {
            assert_eq!(Cursor::decode(&keys(), &text, tenant, principal, dataset, "42", 0), Err(CursorError::Invalid));
        }
        assert_eq!(Cursor::decode(&keys(), &text, "acme", "p", "tickets", "43", 0), Err(CursorError::Expired));
        assert_eq!(Cursor::decode(&keys(), &text, "acme", "p", "tickets", "42", 1001), Err(CursorError::Expired));
        assert_eq!(Cursor::decode(&keys(), "garbage", "acme", "p", "tickets", "42", 0), Err(CursorError::Invalid));
        let mut tampered = text.into_bytes();
        let at = tampered.len() - 3;
        tampered[at] ^= 1;
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(Cursor::decode(&keys(), &tampered, "acme", "p", "tickets", "42", 0), Err(CursorError::Invalid));
    }
}
