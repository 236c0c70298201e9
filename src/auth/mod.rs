//! Bearer-token authentication: HS256 JWTs signed with a tenant's keys, chosen by `kid`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::tenants::{Principal, Registry, Tenant};

/// Every token must carry this audience.
pub const AUDIENCE: &str = "exportd";
/// Clock skew tolerated on `exp`.
const LEEWAY_SECONDS: u64 = 30;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub tenant: String,
    pub sub: String,
    pub aud: String,
    pub iat: u64,
    pub exp: u64,
}

/// Why a bearer token was refused. The message is safe to show to the caller: it never
/// says whether another tenant or principal exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no bearer token")]
    Missing,
    #[error("the token is malformed")]
    Malformed,
    #[error("the token is not signed with a known key")]
    UnknownKey,
    #[error("the token's signature or claims are invalid")]
    Invalid,
    #[error("the token has expired")]
    Expired,
    #[error("the token's principal is unknown or disabled")]
    PrincipalRefused,
}

/// Who is calling: a tenant and one of its enabled principals.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: Arc<Tenant>,
    pub principal: Principal,
}

/// Verifies a compact JWT. The key is found by `kid` and the algorithm fixed to HS256, never
/// taken from the token, so `alg: none` and algorithm confusion cannot get through.
pub fn authenticate(registry: &Registry, token: &str) -> Result<Caller, AuthError> {
    let header = jsonwebtoken::decode_header(token).map_err(|_| AuthError::Malformed)?;
    let kid = header.kid.ok_or(AuthError::UnknownKey)?;
    let (tenant, key) = registry.key(&kid).ok_or(AuthError::UnknownKey)?;
    let decoding = DecodingKey::from_secret(key.secret.bytes()).map_err(|_| AuthError::UnknownKey)?;
    let claims = jsonwebtoken::decode::<Claims>(token, &decoding, &validation())
        .map_err(|e| match e.kind() {
            jsonwebtoken::errors::ErrorKind::ExpiredSignature => AuthError::Expired,
            _ => AuthError::Invalid,
        })?
        .claims;
    // A key signs only for its own tenant.
    if claims.tenant != tenant.id.as_str() {
        return Err(AuthError::Invalid);
    }
    check_times(&claims, tenant, now_seconds())?;
    let principal = tenant.principal(&claims.sub).filter(|p| !p.disabled);
    let principal = principal.ok_or(AuthError::PrincipalRefused)?.clone();
    Ok(Caller { tenant: tenant.clone(), principal })
}

/// The `exp` of a token [`authenticate`] accepted (read without checking again).
pub fn expiry_of_verified(token: &str) -> Option<u64> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    serde_json::from_slice::<Claims>(&bytes).ok().map(|claims| claims.exp)
}

fn validation() -> Validation {
    let mut v = Validation::new(Algorithm::HS256);
    v.set_audience(&[AUDIENCE]);
    v.set_required_spec_claims(&["exp", "aud", "sub"]);
    v.leeway = LEEWAY_SECONDS;
    v.validate_nbf = true;
    v
}

fn now_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `iat` may not lie in the future (beyond the leeway), and the token may not live longer than
/// the tenant's `[auth] max_token_lifetime_hours` — counted from `iat` and from now, so a
/// far-future `exp` is refused whatever `iat` says.
fn check_times(claims: &Claims, tenant: &Tenant, now: u64) -> Result<(), AuthError> {
    let max = u64::from(tenant.auth.max_token_lifetime_hours) * 3600;
    if claims.iat > now + LEEWAY_SECONDS {
        return Err(AuthError::Invalid);
    }
    if claims.exp.saturating_sub(claims.iat) > max || claims.exp.saturating_sub(now) > max + LEEWAY_SECONDS {
        return Err(AuthError::Invalid);
    }
    Ok(())
}

/// Signs a token for `principal` of `tenant` with the tenant's first key.
pub fn mint(tenant: &Tenant, principal: &str, ttl: Duration) -> anyhow::Result<String> {
    let max_hours = tenant.auth.max_token_lifetime_hours;
    anyhow::ensure!(
        ttl.as_secs() <= u64::from(max_hours) * 3600,
        "the tenant's tokens live at most {max_hours} hours ([auth] max_token_lifetime_hours)"
    );
    // A token the server would refuse is no use to anyone: say why instead.
    anyhow::ensure!(
        !tenant.principal(principal).is_some_and(|p| p.disabled),
        "principal `{principal}` of tenant `{}` is disabled in its tenant file: the server refuses its tokens",
        tenant.id
    );
    let now = now_seconds();
    mint_at(tenant, principal, now, now + ttl.as_secs())
}

/// Signs a token with explicit times (tests use it for expired tokens).
pub fn mint_at(tenant: &Tenant, principal: &str, iat: u64, exp: u64) -> anyhow::Result<String> {
    anyhow::ensure!(
        tenant.principal(principal).is_some(),
        "tenant `{}` has no principal `{principal}`; its principals: {}",
        tenant.id,
        tenant.principals.keys().map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
    );
    let key = &tenant.keys[0];
    let claims =
        Claims { tenant: tenant.id.to_string(), sub: principal.to_owned(), aud: AUDIENCE.to_owned(), iat, exp };
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some(key.kid.clone());
    let encoding = EncodingKey::from_secret(key.secret.bytes())?;
    Ok(jsonwebtoken::encode(&header, &claims, &encoding)?)
}
