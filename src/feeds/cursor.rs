//! Feed cursors: opaque, versioned, tamper-evident positions, sealed (AES-SIV) with a server key
//! (the link keys) and bound to tenant, principal, dataset and database cluster. A position only
//! ever names keys the cursor's principal was given, never one outside its row filter.

use jsonwebtoken::{Algorithm, Validation};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::links::LinkKeys;

const AUDIENCE: &str = "exportd-cursor";
/// Sealed cursors.
const VERSION: u32 = 2;
/// Signed (readable) cursors of the first release, still accepted.
const SIGNED_VERSION: u32 = 1;

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

    /// The opaque text: the position sealed (encrypted and authenticated) with the server's
    /// signing key, so it reveals nothing — no keys, snapshots, transaction ids or cluster id.
    /// Deterministic: the same position always encodes the same way.
    pub fn encode(&self, keys: &LinkKeys) -> String {
        keys.seal(AUDIENCE, &serde_json::to_vec(self).expect("cursors serialize"))
    }

    /// Opens and checks the binding to tenant, principal and dataset (any mismatch looks like
    /// tampering, revealing nothing), then the cluster and age. Cursors of the first version
    /// (signed, readable JWTs) are still accepted, so partners keep their place across upgrades.
    pub fn decode(
        keys: &LinkKeys,
        text: &str,
        tenant: &str,
        principal: &str,
        dataset: &str,
        cluster: &str,
        oldest_ts: i64,
    ) -> Result<Cursor, CursorError> {
        let cursor = match keys.open(AUDIENCE, text) {
            Some(plain) => serde_json::from_slice::<Cursor>(&plain).map_err(|_| CursorError::Invalid)?,
            None => decode_signed(keys, text)?,
        };
        if !matches!(cursor.v, SIGNED_VERSION | VERSION)
            || cursor.aud != AUDIENCE
            || cursor.tenant != tenant
            || cursor.sub != principal
            || cursor.dataset != dataset
        {
            return Err(CursorError::Invalid);
        }
        if cursor.cluster != cluster || cursor.ts < oldest_ts {
            return Err(CursorError::Expired);
        }
        Ok(Cursor { v: VERSION, ..cursor })
    }
}

/// A first-version cursor: an HS256 JWT signed with a server key.
fn decode_signed(keys: &LinkKeys, text: &str) -> Result<Cursor, CursorError> {
    let header = jsonwebtoken::decode_header(text).map_err(|_| CursorError::Invalid)?;
    let decoding = keys.decoding_key(header.kid.as_deref().ok_or(CursorError::Invalid)?).ok_or(CursorError::Invalid)?;
    let mut validation = Validation::new(Algorithm::HS256);
    validation.set_audience(&[AUDIENCE]);
    validation.set_required_spec_claims(&["aud", "sub"]);
    validation.validate_exp = false;
    let cursor = jsonwebtoken::decode::<Cursor>(text, &decoding, &validation).map_err(|_| CursorError::Invalid)?.claims;
    if cursor.v != SIGNED_VERSION {
        return Err(CursorError::Invalid);
    }
    Ok(cursor)
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
        assert!(!text.contains("t-1") && !text.contains("10:12:11") && !text.contains("acme"), "opaque");
        let mut tampered = text.into_bytes();
        let at = tampered.len() - 3;
        tampered[at] ^= 1;
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(Cursor::decode(&keys(), &tampered, "acme", "p", "tickets", "42", 0), Err(CursorError::Invalid));
    }

    #[test]
    fn first_version_signed_cursors_are_still_accepted() {
        use jsonwebtoken::Header;
        let old = Cursor {
            v: SIGNED_VERSION,
            after: Some("t-1".into()),
            ..Cursor::new("acme", "p", "tickets", "42", "10:12:11", 1000)
        };
        let keys = keys();
        let (kid, encoding) = keys.signing_key();
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.to_owned());
        let text = jsonwebtoken::encode(&header, &old, &encoding).unwrap();
        let decoded = Cursor::decode(&keys, &text, "acme", "p", "tickets", "42", 0).unwrap();
        assert_eq!(decoded, Cursor { v: VERSION, ..old });
    }
}
