//! Opaque tokens: deterministic authenticated encryption (AES-SIV, RFC 5297) under a key derived
//! from a server link key (HKDF-SHA256 with a purpose label). The holder learns nothing of the
//! contents — not even their exact length, which is padded to a bucket — and cannot alter them.
//! The same plaintext always seals to the same text, so a token can be compared and cached.

use aes_siv::KeyInit;
use aes_siv::siv::Aes256Siv;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::LinkKeys;

/// Plaintexts are padded (with trailing spaces, which JSON ignores) to a multiple of this.
const PAD_TO: usize = 128;

fn cipher(secret: &[u8], purpose: &str) -> Aes256Siv {
    let mut key = [0u8; 64];
    hkdf::Hkdf::<sha2::Sha256>::new(Some(b"exportd sealed token"), secret)
        .expand(purpose.as_bytes(), &mut key)
        .expect("64 bytes is a valid HKDF-SHA256 output length");
    Aes256Siv::new(&key.into())
}

impl LinkKeys {
    /// `<kid>.<base64url ciphertext>` of `plaintext` (JSON), sealed with the signing key for
    /// `purpose` (a token sealed for one purpose does not open for another).
    pub fn seal(&self, purpose: &str, plaintext: &[u8]) -> String {
        let key = &self.keys[0];
        let mut padded = plaintext.to_vec();
        padded.resize(plaintext.len().div_ceil(PAD_TO).max(1) * PAD_TO, b' ');
        let sealed =
            cipher(&key.secret, purpose).encrypt([key.kid.as_bytes()], &padded).expect("AES-SIV encrypts any length");
        format!("{}.{}", key.kid, URL_SAFE_NO_PAD.encode(sealed))
    }

    /// The plaintext (padding included) of a token sealed by any of the keys; `None` when it is
    /// malformed, altered, for another purpose or sealed with an unknown key.
    pub fn open(&self, purpose: &str, text: &str) -> Option<Vec<u8>> {
        let (kid, body) = text.split_once('.')?;
        let key = self.keys.iter().find(|k| k.kid == kid)?;
        let sealed = URL_SAFE_NO_PAD.decode(body).ok()?;
        cipher(&key.secret, purpose).decrypt([kid.as_bytes()], &sealed).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_tokens_hide_their_contents_and_open_only_unaltered_for_their_purpose() {
        let keys = LinkKeys::parse("b=0123456789abcdef0123456789abcdef,a=fedcba9876543210fedcba9876543210").unwrap();
        let token = keys.seal("cursor", br#"{"after":"SECRET-key"}"#);
        assert_eq!(token, keys.seal("cursor", br#"{"after":"SECRET-key"}"#), "deterministic");
        assert!(token.starts_with("b."));
        let body = URL_SAFE_NO_PAD.decode(token.split_once('.').unwrap().1).unwrap();
        assert!(!String::from_utf8_lossy(&body).contains("SECRET"));
        let short = keys.seal("cursor", b"{}");
        let long = keys.seal("cursor", &[b' '; 100]);
        assert_eq!(short.len(), long.len(), "lengths are padded to a bucket");
        let opened = keys.open("cursor", &token).unwrap();
        assert_eq!(String::from_utf8(opened).unwrap().trim_end(), r#"{"after":"SECRET-key"}"#);
        assert!(keys.open("link", &token).is_none(), "another purpose");
        let mut altered = token.clone().into_bytes();
        let last = altered.len() - 2;
        altered[last] = if altered[last] == b'A' { b'B' } else { b'A' };
        assert!(keys.open("cursor", &String::from_utf8(altered).unwrap()).is_none());
        let other = LinkKeys::parse("b=another-secret-0123456789abcdef0123").unwrap();
        assert!(other.open("cursor", &token).is_none(), "another server's key");
        // Rotation: a token sealed with an older key still opens while that key is listed.
        let rotated =
            LinkKeys::parse("c=0000000000000000000000000000000000,b=0123456789abcdef0123456789abcdef").unwrap();
        assert!(rotated.open("cursor", &token).is_some());
    }
}
