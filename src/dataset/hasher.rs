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
    /// The key as PostgreSQL's `exportd_keyed_hash` takes it.
    pads: HashPads,
}

impl ColumnHasher {
    /// The key of `principal` of `tenant`: HMAC-SHA256(secret, label ‖ 0 ‖ tenant ‖ 0 ‖ principal).
    pub fn derive(secret: &[u8], tenant: &str, principal: &str) -> ColumnHasher {
        let mut mac = <Hmac<Sha256>>::new_from_slice(secret).expect("HMAC accepts keys of any length");
        for part in [DERIVATION, b"\0", tenant.as_bytes(), b"\0", principal.as_bytes()] {
            mac.update(part);
        }
        let key: [u8; 32] = mac.finalize().into_bytes().into();
        let keyed = <Hmac<Sha256>>::new_from_slice(&key).expect("HMAC accepts keys of any length");
        ColumnHasher { keyed, pads: HashPads::of(&key) }
    }

    /// The key as PostgreSQL's `exportd_keyed_hash` takes it, which orders rows by the bytes of
    /// [`hash`](Self::hash). Secret like the key.
    pub fn pads(&self) -> &HashPads {
        &self.pads
    }

    /// The first 128 bits of the HMAC as 32 lowercase hex digits: RFC 2104 allows truncating to
    /// half the output, 128 bits keep accidental collisions out of reach (2^64 values for even
    /// odds), and random digits are what a compressed file cannot shrink — half of them halve
    /// what a hashed column adds to the partner's files.
    pub fn hash(&self, text: &[u8]) -> String {
        // Through a table into a buffer: `hex::encode` pushes char by char (2 % of a masked
        // export's CPU time).
        let mut digits = [0u8; 2 * HASH_BYTES];
        hex::encode_to_slice(self.hash_bytes(text), &mut digits).expect("twice as many digits as bytes");
        String::from_utf8(digits.to_vec()).expect("hex digits are ASCII")
    }

    /// The bytes [`hash`](Self::hash) writes in hex (their order is the hex digits' order).
    pub fn hash_bytes(&self, text: &[u8]) -> [u8; HASH_BYTES] {
        let mut mac = self.keyed.clone();
        mac.update(text);
        mac.finalize().into_bytes()[..HASH_BYTES].try_into().expect("HMAC-SHA256 has 32 bytes")
    }

    /// Names the key without revealing it (a hash of a fixed label), for policy fingerprints.
    pub fn key_id(&self) -> String {
        self.hash(b"\0exportd key id")[..16].to_owned()
    }
}

/// A partner's hash key XORed with HMAC's inner and outer pads (RFC 2104), as PostgreSQL's
/// `exportd_keyed_hash` takes it: bound as parameters, never logged (as secret as the key).
#[derive(Clone)]
pub struct HashPads {
    pub inner: Vec<u8>,
    pub outer: Vec<u8>,
}

impl HashPads {
    /// SHA-256's block is 64 bytes; a 32-byte key is padded with zeros.
    fn of(key: &[u8; 32]) -> HashPads {
        let (mut inner, mut outer) = (vec![0x36u8; 64], vec![0x5cu8; 64]);
        for (i, byte) in key.iter().enumerate() {
            inner[i] ^= byte;
            outer[i] ^= byte;
        }
        HashPads { inner, outer }
    }
}

impl fmt::Debug for HashPads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HashPads(..)")
    }
}

impl fmt::Debug for ColumnHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ColumnHasher(..)")
    }
}

#[cfg(test)]
mod tests {
    use sha2::Digest;

    use super::*;

    /// What `exportd_keyed_hash` computes from the pads equals the hash a partner receives.
    #[test]
    fn the_pads_reproduce_the_hash() {
        let hasher = ColumnHasher::derive(b"secret", "acme", "warehouse");
        let pads = hasher.pads();
        for key in ["t-1", "", "ключ-∞", &"k".repeat(512)] {
            let inner = Sha256::digest([pads.inner.as_slice(), key.as_bytes()].concat());
            let outer = Sha256::digest([pads.outer.as_slice(), inner.as_slice()].concat());
            assert_eq!(hex::encode(&outer[..HASH_BYTES]), hasher.hash(key.as_bytes()), "{key}");
        }
    }
}
