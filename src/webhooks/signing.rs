//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`
//! keyed with the endpoint secret's bytes (the base64 after `whsec_`).

use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The `webhook-signature` header value for one attempt.
pub fn signature(key: &[u8], id: &str, timestamp: i64, body: &str) -> String {
    let mut mac = <Hmac<Sha256>>::new_from_slice(key).expect("HMAC accepts keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body.as_bytes());
    let tag = mac.finalize().into_bytes();
    format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(tag))
}

#[cfg(test)]
mod tests {
    /// The example of the Standard Webhooks specification (and its reference libraries).
    #[test]
    fn matches_the_specification_example() {
        use base64::Engine;
        let key = base64::engine::general_purpose::STANDARD.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = r#"{"test": 2432232314}"#;
        let signed = super::signature(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(signed, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }
}
