//! Feed cursors: opaque, versioned, tamper-evident positions, sealed (AES-SIV) with a server key
//! (the link keys) and bound to tenant, principal, dataset and database cluster, and to the point
//! of the database's history their snapshot was taken at (a failover may lose that history).
//! A position only ever names keys the cursor's principal was given, never one outside its row
//! filter.

use jsonwebtoken::{Algorithm, Validation};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::history::{self, Database, Fate, HistoryPoint};
use crate::links::LinkKeys;
use crate::served::ServedView;

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
    /// Where in the database's history `from` was taken (cursors from before that was recorded
    /// carry none, and stand at the deployment's origin point).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<HistoryPoint>,
    /// Inside that window: the last key already delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// When `from` was taken (unix seconds): cursors older than the tombstone window expire.
    pub ts: i64,
    /// Fingerprint of the row filter the position was computed under: once the principal's
    /// filter changes, its old cursors expire (first-release cursors carry none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rf: Option<String>,
    /// Fingerprint of the column policy the partner's pages were masked with (absent: none):
    /// once it changes, old cursors expire, like those of a changed row filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp: Option<String>,
    /// `after` is a hashed key: the partner's keys are hashed, and its changes come in the order
    /// of the hashes (cursors from before that order carry a real key there, and expire).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hk: bool,
}

/// Whose cursor: it is valid only for this tenant, principal, dataset, cluster and row filter.
#[derive(Debug, Clone, Copy)]
pub struct CursorOwner<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub dataset: &'a str,
    /// The database now: its cluster, timeline and origin point.
    pub database: &'a Database,
    /// The principal's row filter as JSON (`{}` for none).
    pub row_filter: &'a serde_json::Value,
    /// The fingerprint of the principal's column policy for the dataset, if it has one.
    pub column_policy: Option<&'a str>,
    /// The principal's changes come in hashed-key order (its policy hashes the key).
    pub hashed_positions: bool,
}

impl<'a> CursorOwner<'a> {
    /// `principal` of `tenant` reading `view` (whose frozen row filter is `row_filter`).
    pub fn of(
        (tenant, principal): (&'a str, &'a str),
        view: &ServedView<'a>,
        database: &'a Database,
        row_filter: &'a serde_json::Value,
    ) -> CursorOwner<'a> {
        CursorOwner {
            tenant,
            principal,
            dataset: view.name().as_str(),
            database,
            row_filter,
            column_policy: view.policy_fingerprint(),
            hashed_positions: view.key_order().is_hashed(),
        }
    }

    fn row_filter_fingerprint(&self) -> String {
        let digest = crate::writers::sha256_hex(self.row_filter.to_string().as_bytes());
        digest[..16].to_owned()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("the cursor is malformed, tampered with, or not for this dataset and principal")]
    Invalid,
    #[error(
        "the cursor was sealed with a key this server does not have (key `{0}`): the server's keys changed since it was issued; the operator can add that key back to EXPORTD_LINK_KEYS, or run a full export and continue from its next_cursor"
    )]
    UnknownKey(String),
    #[error(
        "the cursor is older than the tenant's tombstone window, from another database, or from before the principal's row filter or column policy changed; run a full export and continue from its next_cursor"
    )]
    Expired,
    #[error(
        "the database lost part of the history this cursor has seen, in a failover to a standby that never received it or a restore (timeline {timeline} {ended}): changes delivered from it no longer exist, and later ones may reuse their transaction ids. Run a full export and continue from its next_cursor"
    )]
    LostInFailover { timeline: i32, ended: String },
    #[error("the database failed over and its timeline history cannot be read to check this cursor: {0}")]
    HistoryUnreadable(String),
}

impl Cursor {
    /// A cursor of `owner` at snapshot `from`, taken at history point `at` and time `ts`.
    pub fn new(owner: &CursorOwner<'_>, from: &str, at: HistoryPoint, ts: i64) -> Cursor {
        Cursor {
            v: VERSION,
            aud: AUDIENCE.to_owned(),
            tenant: owner.tenant.to_owned(),
            sub: owner.principal.to_owned(),
            dataset: owner.dataset.to_owned(),
            cluster: owner.database.system_identifier.clone(),
            from: from.to_owned(),
            at: Some(at),
            after: None,
            ts,
            rf: Some(owner.row_filter_fingerprint()),
            cp: owner.column_policy.map(str::to_owned),
            hk: owner.hashed_positions,
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
    pub fn decode(keys: &LinkKeys, text: &str, owner: &CursorOwner<'_>, oldest_ts: i64) -> Result<Cursor, CursorError> {
        let cursor = match keys.open(AUDIENCE, text) {
            Some(plain) => serde_json::from_slice::<Cursor>(&plain).map_err(|_| CursorError::Invalid)?,
            // `<kid>.<sealed>`: one dot (a first-version JWT has two).
            None => match text.split_once('.') {
                Some((kid, rest)) if !rest.contains('.') && !keys.knows(kid) && is_kid(kid) => {
                    return Err(CursorError::UnknownKey(kid.to_owned()));
                }
                _ => decode_signed(keys, text)?,
            },
        };
        if !matches!(cursor.v, SIGNED_VERSION | VERSION)
            || cursor.aud != AUDIENCE
            || cursor.tenant != owner.tenant
            || cursor.sub != owner.principal
            || cursor.dataset != owner.dataset
        {
            return Err(CursorError::Invalid);
        }
        let fingerprint = owner.row_filter_fingerprint();
        // A first-release cursor carries no fingerprint: it cannot say under which filter it was
        // cut, so only a principal without a row filter (nothing hidden from it) may go on with it.
        let filter_changed = match &cursor.rf {
            Some(rf) => *rf != fingerprint,
            None => !owner.row_filter.as_object().is_none_or(|filter| filter.is_empty()),
        };
        let policy_changed = cursor.cp.as_deref() != owner.column_policy
            || (cursor.after.is_some() && cursor.hk != owner.hashed_positions);
        if cursor.cluster != owner.database.system_identifier
            || cursor.ts < oldest_ts
            || filter_changed
            || policy_changed
        {
            return Err(CursorError::Expired);
        }
        let at = Some(cursor.at.unwrap_or(owner.database.origin));
        Ok(Cursor { v: VERSION, rf: Some(fingerprint), hk: owner.hashed_positions, at, ..cursor })
    }

    /// [`Cursor::decode`], then whether its position is still part of the database's history;
    /// a principal's first refusal after a failover raises `feed.history_lost`.
    pub async fn open(
        pool: &PgPool,
        keys: &LinkKeys,
        text: &str,
        owner: &CursorOwner<'_>,
        oldest_ts: i64,
        now: time::OffsetDateTime,
    ) -> sqlx::Result<Result<Cursor, CursorError>> {
        let cursor = match Cursor::decode(keys, text, owner, oldest_ts) {
            Ok(cursor) => cursor,
            Err(e) => return Ok(Err(e)),
        };
        let point = cursor.at.unwrap_or(owner.database.origin);
        Ok(match history::fate(pool, owner.database, point).await? {
            Fate::Kept => Ok(cursor),
            Fate::Lost { timeline, ended_at } => {
                history::count_refusal(
                    pool,
                    (owner.tenant, owner.principal, owner.dataset),
                    owner.database.timeline,
                    now,
                )
                .await?;
                let ended = match ended_at {
                    Some(end) => format!("ended at {} before the cursor's position", history::format_lsn(end)),
                    None if timeline == owner.database.timeline => {
                        "was restored to before the cursor's position".into()
                    }
                    None => format!("is not an ancestor of the current timeline {}", owner.database.timeline),
                };
                Err(CursorError::LostInFailover { timeline, ended })
            }
            Fate::Unknown(reason) => Err(CursorError::HistoryUnreadable(reason)),
        })
    }
}

/// What a kid may look like in a message: short visible ASCII (anything else is garbage, not a key).
fn is_kid(text: &str) -> bool {
    !text.is_empty() && text.len() <= 64 && text.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
}

/// A first-version cursor: an HS256 JWT signed with a server key.
fn decode_signed(keys: &LinkKeys, text: &str) -> Result<Cursor, CursorError> {
    let header = jsonwebtoken::decode_header(text).map_err(|_| CursorError::Invalid)?;
    let kid = header.kid.ok_or(CursorError::Invalid)?;
    let decoding = keys.decoding_key(&kid).ok_or(CursorError::UnknownKey(kid))?;
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

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn keys() -> LinkKeys {
        LinkKeys::parse("k=0123456789abcdef0123456789abcdef").unwrap()
    }

    const AT: HistoryPoint = HistoryPoint { timeline: 1, wal_position: 4096 };

    /// Cluster `cluster` on timeline 1, upgraded at position 16.
    fn database(cluster: &str) -> &'static Database {
        Box::leak(Box::new(Database {
            system_identifier: cluster.to_owned(),
            timeline: 1,
            wal_position: 1 << 20,
            origin: HistoryPoint { timeline: 1, wal_position: 16 },
        }))
    }

    fn owner<'a>(
        tenant: &'a str,
        principal: &'a str,
        dataset: &'a str,
        cluster: &'a str,
        rf: &'a Value,
    ) -> CursorOwner<'a> {
        CursorOwner {
            tenant,
            principal,
            dataset,
            database: database(cluster),
            row_filter: rf,
            column_policy: None,
            hashed_positions: false,
        }
    }

    #[test]
    fn a_position_in_the_other_key_order_expires() {
        let none = json!({});
        let (real, hashed) = (
            owner("acme", "p", "tickets", "42", &none),
            CursorOwner { hashed_positions: true, ..owner("acme", "p", "tickets", "42", &none) },
        );
        let mid_window = Cursor { after: Some("t-1".into()), ..Cursor::new(&real, "10:12:11", AT, 1000) };
        let text = mid_window.encode(&keys());
        assert_eq!(Cursor::decode(&keys(), &text, &hashed, 0), Err(CursorError::Expired));
        assert!(Cursor::decode(&keys(), &text, &real, 0).is_ok());
        let between_windows = Cursor::new(&real, "10:12:11", AT, 1000).encode(&keys());
        assert!(Cursor::decode(&keys(), &between_windows, &hashed, 0).unwrap().hk, "now in hashed order");
    }

    #[test]
    fn cursors_round_trip_and_bind_their_owner() {
        let (none, emea, apac) = (json!({}), json!({"region": "emea"}), json!({"region": "apac"}));
        let me = owner("acme", "p", "tickets", "42", &emea);
        let cursor = Cursor { after: Some("t-1".into()), ..Cursor::new(&me, "10:12:11", AT, 1000) };
        let text = cursor.encode(&keys());
        assert_eq!(text, cursor.encode(&keys()), "deterministic");
        assert_eq!(Cursor::decode(&keys(), &text, &me, 0), Ok(cursor));
        for (tenant, principal, dataset) in
            [("globex", "p", "tickets"), ("acme", "q", "tickets"), ("acme", "p", "contacts")]
        {
            let other = owner(tenant, principal, dataset, "42", &emea);
            assert_eq!(Cursor::decode(&keys(), &text, &other, 0), Err(CursorError::Invalid));
        }
        let expired = |o: CursorOwner<'_>, oldest| Cursor::decode(&keys(), &text, &o, oldest);
        assert_eq!(expired(owner("acme", "p", "tickets", "43", &emea), 0), Err(CursorError::Expired), "cluster");
        assert_eq!(expired(me, 1001), Err(CursorError::Expired), "age");
        assert_eq!(expired(owner("acme", "p", "tickets", "42", &apac), 0), Err(CursorError::Expired), "row filter");
        assert_eq!(expired(owner("acme", "p", "tickets", "42", &none), 0), Err(CursorError::Expired), "row filter");
        assert_eq!(Cursor::decode(&keys(), "garbage", &me, 0), Err(CursorError::Invalid));
        assert!(!text.contains("t-1") && !text.contains("10:12:11") && !text.contains("acme"), "opaque");
        let mut tampered = text.into_bytes();
        let at = tampered.len() - 3;
        tampered[at] ^= 1;
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(Cursor::decode(&keys(), &tampered, &me, 0), Err(CursorError::Invalid));
    }

    #[test]
    fn first_version_signed_cursors_are_accepted_only_from_principals_without_a_row_filter() {
        use jsonwebtoken::Header;
        let none = json!({});
        let me = owner("acme", "p", "tickets", "42", &none);
        let old = Cursor {
            v: SIGNED_VERSION,
            after: Some("t-1".into()),
            rf: None,
            at: None,
            ..Cursor::new(&me, "10:12:11", AT, 1000)
        };
        let keys = keys();
        let (kid, encoding) = keys.signing_key();
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.to_owned());
        let text = jsonwebtoken::encode(&header, &old, &encoding).unwrap();
        let decoded = Cursor::decode(&keys, &text, &me, 0).unwrap();
        // It carries no history point: it stands at the deployment's origin.
        let origin = me.database.origin;
        assert_eq!(decoded, Cursor { after: Some("t-1".into()), ..Cursor::new(&me, "10:12:11", origin, 1000) });
        // It does not say which filter it was cut under: a filtered partner re-bases.
        let emea = json!({"region": "emea"});
        let filtered = owner("acme", "p", "tickets", "42", &emea);
        assert_eq!(Cursor::decode(&keys, &text, &filtered, 0), Err(CursorError::Expired));
    }
}
