//! Checks shared by the paged listings (webhook deliveries, bucket deliveries): page size,
//! the opaque `seq` cursor, a delivery state and a configured name, each refused with a 400
//! naming its field.

use super::error::{ApiError, ApiResult};

/// The page size: `limit` (default 100), 1 to 500.
pub fn limit(limit: Option<u32>) -> ApiResult<u32> {
    let limit = limit.unwrap_or(100);
    if (1..=500).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::invalid_field("limit", "must be between 1 and 500"))
    }
}

/// The position before which the page starts: a `next_cursor` this listing handed out (a
/// positive number as the OpenAPI pattern says: `^[1-9][0-9]{0,17}$`; `-1`, `0`, `01` are refused).
pub fn before(cursor: Option<&str>) -> ApiResult<Option<i64>> {
    let handed_out = |text: &str| {
        (1..=18).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0')
    };
    cursor
        .map(|text| match text.parse::<i64>() {
            Ok(seq) if handed_out(text) => Ok(seq),
            _ => Err(ApiError::invalid_field("cursor", "not a cursor from this listing")),
        })
        .transpose()
}

/// A delivery state filter: `pending`, `delivered` or `failed`.
pub fn state(state: Option<&str>) -> ApiResult<Option<&str>> {
    match state {
        Some(s) if !["pending", "delivered", "failed"].contains(&s) => {
            Err(ApiError::invalid_field("state", "one of pending, delivered, failed"))
        }
        other => Ok(other),
    }
}

/// A name from a tenant file (an endpoint, a subscription): 1-64 letters, digits, `-`, `_`, `.`.
pub fn name<'a>(field: &str, name: Option<&'a str>) -> ApiResult<Option<&'a str>> {
    let ok = |n: &str| (1..=64).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    match name {
        Some(n) if !ok(n) => {
            Err(ApiError::invalid_field(field, "a name from the tenant file: 1-64 letters, digits, `-`, `_` or `.`"))
        }
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::before;

    #[test]
    fn a_cursor_is_a_positive_number_as_handed_out() {
        assert_eq!(before(Some("42")).unwrap(), Some(42));
        assert_eq!(before(None).unwrap(), None);
        for refused in ["-1", "0", "01", "+4", "1.5", "x", "", "1234567890123456789"] {
            assert!(before(Some(refused)).is_err(), "{refused:?}");
        }
    }
}
