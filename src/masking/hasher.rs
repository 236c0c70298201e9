//! The keyed hash of `hash` rules: HMAC-SHA256 with a key of the partner's own, derived from the
//! tenant's masking secret, so one partner's hashes are stable across exports and feeds (it can
//! join on them) and every other partner's differ (two partners cannot link their records).

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The bytes of the HMAC a hash keeps.
const HASH_BYTES: usize = 16;

/// Separates the derivation from any other use of the secret.
const DERIVATION: &[u8] = b"exportd column hash v1";

#[derive(Clone)]
pub struct ColumnHasher {
    /// Keyed once; cloned per value (a clone copies the two prepared SHA-256 states).
    keyed: Hmac<Sha256>,
}

impl ColumnHasher {
    /// The key of `principal` of `tenant`: HMAC-SHA256(secret, label ‖ 0 ‖ tenant ‖ 0 ‖ principal).
    pub fn derive(secret: &[u8], tenant: &str, principal: &str) -> ColumnHasher {
        let mut mac = <Hmac<Sha256>>::new_from_slice(secret).expect("HMAC accepts keys of any length");
        for part in [DERIVATION, b"\0", tenant.as_bytes(), b"\0", principal.as_bytes()] {
            mac.update(part);
        }
        let key = mac.finalize().into_bytes();
        ColumnHasher { keyed: <Hmac<Sha256>>::new_from_slice(&key).expect("HMAC accepts keys of any length") }
    }

    /// The first 128 bits of the HMAC as 32 lowercase hex digits: RFC 2104 allows truncating to
    /// half the output, 128 bits keep accidental collisions out of reach (2^64 values for even
    /// odds), and random digits are what a compressed file cannot shrink — half of them halve
    /// what a hashed column adds to the partner's files.
    pub fn hash(&self, text: &[u8]) -> String {
        let mut mac = self.keyed.clone();
        mac.update(text);
        hex::encode(&mac.finalize().into_bytes()[..HASH_BYTES])
    }

    /// Names the key without revealing it (a hash of a fixed label), for policy fingerprints.
    pub fn key_id(&self) -> String {
        self.hash(b"\0exportd key id")[..16].to_owned()
    }
}

impl fmt::Debug for ColumnHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ColumnHasher(..)")
    }
}
