//! RFC 9110 range requests: which part of a representation to send.

/// What to answer a GET of a representation of `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAnswer {
    /// 200 with the whole body.
    Full,
    /// 206 with bytes `start ..= end`.
    Partial { start: u64, end: u64 },
    /// 416 with `Content-Range: bytes */len`.
    Unsatisfiable,
}

/// Decides from the `Range` and `If-Range` headers. A malformed `Range` is ignored (200); a
/// request for several ranges gets the whole body (200, no multipart); an `If-Range` that is not
/// exactly our strong ETag — a weak tag, another tag, an HTTP date — gets the whole body, so a
/// stale validator can never splice two versions.
pub fn decide(range: Option<&str>, if_range: Option<&str>, etag: &str, len: u64) -> RangeAnswer {
    let Some(range) = range else { return RangeAnswer::Full };
    if if_range.is_some_and(|validator| validator.trim() != etag) {
        return RangeAnswer::Full;
    }
    let Ok(parsed) = http_range_header::parse_range_header(range) else { return RangeAnswer::Full };
    if parsed.len() != 1 {
        return RangeAnswer::Full;
    }
    match parsed.validate(len) {
        Ok(ranges) => match ranges.first() {
            Some(r) => RangeAnswer::Partial { start: *r.start(), end: *r.end() },
            None => RangeAnswer::Full,
        },
        Err(http_range_header::RangeUnsatisfiableError::Unsatisfiable) => RangeAnswer::Unsatisfiable,
        Err(_) => RangeAnswer::Full,
    }
}

#[cfg(test)]
mod tests {
    use super::RangeAnswer::*;
    use super::*;

    const TAG: &str = "\"abc\"";

    #[test]
    fn ranges_follow_rfc_9110() {
        let cases = [
            (None, None, Full),
            (Some("bytes=0-9"), None, Partial { start: 0, end: 9 }),
            (Some("bytes=90-"), None, Partial { start: 90, end: 99 }),
            (Some("bytes=90-500"), None, Partial { start: 90, end: 99 }),
            (Some("bytes=-10"), None, Partial { start: 90, end: 99 }),
            (Some("bytes=-500"), None, Partial { start: 0, end: 99 }),
            (Some("Bytes=0-0"), None, Partial { start: 0, end: 0 }),
            (Some("bytes=100-"), None, Unsatisfiable),
            (Some("bytes=5-2"), None, Full),
            (Some("garbage"), None, Full),
            (Some("items=0-5"), None, Full),
            (Some("bytes=0-1,5-6"), None, Full),
            (Some("bytes=10-"), Some(TAG), Partial { start: 10, end: 99 }),
            (Some("bytes=10-"), Some("\"stale\""), Full),
            (Some("bytes=10-"), Some("W/\"abc\""), Full),
            (Some("bytes=10-"), Some("Mon, 30 Nov 2026 10:00:00 GMT"), Full),
        ];
        for (range, if_range, expected) in cases {
            assert_eq!(decide(range, if_range, TAG, 100), expected, "{range:?} {if_range:?}");
        }
    }
}
