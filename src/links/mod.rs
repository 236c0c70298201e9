//! Signed download links: short-lived tokens bound to tenant, principal, export and object,
//! signed with a server key chosen by `kid` (several accepted, the first signs).

mod sealed;

use std::fmt;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Audience of link tokens; API tokens (`aud = "exportd"`) are not links and links are not API tokens.
const AUDIENCE: &str = "exportd-link";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkClaims {
    pub tenant: String,
    pub sub: String,
    pub export: Uuid,
    /// `file` or `shard-<n>`.
    pub object: String,
    pub aud: String,
    pub exp: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("the link is malformed or its signature is invalid")]
    Invalid,
    #[error("the link has expired")]
    Expired,
    /// Signed with a key this server does not have: its keys changed since (rotation without
    /// keeping the old key, another deployment), not necessarily tampering.
    #[error("the link was signed with a key this server does not have")]
    UnknownKey,
}

#[derive(Clone)]
struct LinkKey {
    kid: String,
    secret: Vec<u8>,
}

/// The server's link keys. Debug output never shows secrets.
#[derive(Clone)]
pub struct LinkKeys {
    keys: Vec<LinkKey>,
}

impl fmt::Debug for LinkKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kids: Vec<&str> = self.keys.iter().map(|k| k.kid.as_str()).collect();
        f.debug_struct("LinkKeys").field("kids", &kids).finish()
    }
}

impl LinkKeys {
    /// Parses `kid=secret[,kid=secret…]` (`EXPORTD_LINK_KEYS`); the first key signs.
    pub fn parse(spec: &str) -> Result<LinkKeys, String> {
        let mut keys = Vec::new();
        for (i, entry) in spec.split(',').map(str::trim).filter(|e| !e.is_empty()).enumerate() {
            let (kid, secret) = entry.split_once('=').ok_or(format!("link key {i}: expected kid=secret"))?;
            if kid.is_empty() || !kid.chars().all(|c| c.is_ascii_graphic()) {
                return Err(format!("link key {i}: the kid must be visible ASCII"));
            }
            if secret.len() < 32 {
                return Err(format!("link key {i} (`{kid}`): the secret needs at least 32 bytes"));
            }
            if keys.iter().any(|k: &LinkKey| k.kid == kid) {
                return Err(format!("link key {i}: duplicate kid `{kid}`"));
            }
            keys.push(LinkKey { kid: kid.to_owned(), secret: secret.as_bytes().to_vec() });
        }
        if keys.is_empty() {
            return Err("no link keys given".into());
        }
        Ok(LinkKeys { keys })
    }

    /// The deployment's own key, kept in its database: made once by the first process that asks
    /// (concurrent first askers agree on one), the same for every process and every restart.
    pub async fn of_deployment(pool: &sqlx::PgPool) -> sqlx::Result<LinkKeys> {
        // The kid is public, so it is drawn apart from the secret; the secret is two v4 UUIDs
        // (244 random bits from the operating system's generator).
        let kid = format!("db-{}", &Uuid::new_v4().simple().to_string()[..8]);
        let secret = format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
        let key = sqlx::query!(
            r#"UPDATE deployment SET link_kid = coalesce(link_kid, $1), link_secret = coalesce(link_secret, $2)
               RETURNING link_kid AS "kid!", link_secret AS "secret!""#,
            kid,
            secret,
        )
        .fetch_one(pool)
        .await?;
        Ok(LinkKeys { keys: vec![LinkKey { kid: key.kid, secret: key.secret.into_bytes() }] })
    }

    /// The kid and key that sign (the first).
    pub fn signing_key(&self) -> (&str, EncodingKey) {
        let key = &self.keys[0];
        (&key.kid, EncodingKey::from_secret(&key.secret).expect("link secrets are not empty"))
    }

    /// Whether `kid` names one of these keys.
    pub fn knows(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid == kid)
    }

    /// The verifying key for `kid`, if it is one of ours.
    pub fn decoding_key(&self, kid: &str) -> Option<DecodingKey> {
        let key = self.keys.iter().find(|k| k.kid == kid)?;
        DecodingKey::from_secret(&key.secret).ok()
    }

    /// A token for `object` of `export`, valid until `now + ttl`.
    pub fn sign(&self, tenant: &str, principal: &str, export: Uuid, object: &str, now: u64, ttl: Duration) -> String {
        let (kid, encoding) = self.signing_key();
        let claims = LinkClaims {
            tenant: tenant.to_owned(),
            sub: principal.to_owned(),
            export,
            object: object.to_owned(),
            aud: AUDIENCE.to_owned(),
            exp: now + ttl.as_secs(),
        };
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, &claims, &encoding).expect("link claims serialize")
    }

    /// Checks signature, audience and expiry against `now` (the server's clock, so tests can
    /// move time instead of sleeping). The HMAC comparison is constant-time.
    pub fn verify(&self, token: &str, now: u64) -> Result<LinkClaims, LinkError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| LinkError::Invalid)?;
        let decoding = self.decoding_key(&header.kid.ok_or(LinkError::Invalid)?).ok_or(LinkError::UnknownKey)?;
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_audience(&[AUDIENCE]);
        validation.set_required_spec_claims(&["exp", "aud", "sub"]);
        validation.validate_exp = false; // checked below against the injected clock
        let claims =
            jsonwebtoken::decode::<LinkClaims>(token, &decoding, &validation).map_err(|_| LinkError::Invalid)?.claims;
        if claims.exp <= now {
            return Err(LinkError::Expired);
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> LinkKeys {
        LinkKeys::parse("new=0123456789abcdef0123456789abcdef, old=fedcba9876543210fedcba9876543210").unwrap()
    }

    #[test]
    fn links_verify_until_they_expire() {
        let id = Uuid::new_v4();
        let token = keys().sign("acme", "alice", id, "file", 1000, Duration::from_secs(300));
        let claims = keys().verify(&token, 1299).unwrap();
        assert_eq!((claims.export, claims.object.as_str(), claims.sub.as_str()), (id, "file", "alice"));
        assert_eq!(keys().verify(&token, 1300), Err(LinkError::Expired));
    }

    #[test]
    fn older_keys_still_verify_and_unknown_ones_do_not() {
        let old_only = LinkKeys::parse("old=fedcba9876543210fedcba9876543210").unwrap();
        let token = old_only.sign("acme", "alice", Uuid::new_v4(), "file", 0, Duration::from_secs(60));
        assert!(keys().verify(&token, 1).is_ok());
        let other = LinkKeys::parse("x=0000000000000000000000000000000000").unwrap();
        assert_eq!(other.verify(&token, 1), Err(LinkError::UnknownKey), "told apart from tampering");
        // The same kid with another secret is a bad signature, not an unknown key.
        let impostor = LinkKeys::parse("old=0000000000000000000000000000000000").unwrap();
        assert_eq!(impostor.verify(&token, 1), Err(LinkError::Invalid));
    }

    #[test]
    fn a_flipped_bit_breaks_the_signature() {
        let token = keys().sign("acme", "alice", Uuid::new_v4(), "file", 0, Duration::from_secs(60));
        let mut bytes = token.into_bytes();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x01;
        let tampered = String::from_utf8(bytes).unwrap();
        assert_eq!(keys().verify(&tampered, 1), Err(LinkError::Invalid));
    }

    #[test]
    fn key_specs_are_validated() {
        assert!(LinkKeys::parse("").is_err());
        assert!(LinkKeys::parse("k=short").is_err());
        assert!(LinkKeys::parse("nokid").is_err());
        assert!(LinkKeys::parse("a=0123456789abcdef0123456789abcdef,a=0123456789abcdef0123456789abcdef").is_err());
        assert!(!format!("{:?}", keys()).contains("0123"), "Debug never shows secrets");
    }
}
