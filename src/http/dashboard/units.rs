//! Numbers as people read them: binary byte units, durations, relative times (the exact time
//! goes in a `title`), percentages of a limit.

use humansize::{BINARY, format_size};
use maud::{Markup, html};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// `500008` → `500,008`: counts with thousands separators.
pub fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// What a chart's numbers are, for a scale that ends on a round value of their unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantity {
    Count,
    Bytes,
    Seconds,
}

impl Quantity {
    /// The smallest round value at or above `max` (at least 1): 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8
    /// times a power of ten of counts, of a binary byte unit (`60 MiB`), or of seconds, minutes,
    /// hours or days. A count's scale is even, so that its middle line is a whole number too.
    pub fn round_up(self, max: f64) -> f64 {
        let max = max.max(1.0);
        let unit = match self {
            Quantity::Count => 1.0,
            Quantity::Bytes => (0..=6).map(|p| 1024f64.powi(p)).take_while(|u| *u <= max).last().unwrap_or(1.0),
            Quantity::Seconds => {
                [1.0, 60.0, 3600.0, 86_400.0].into_iter().take_while(|u| *u <= max).last().unwrap_or(1.0)
            }
        };
        let scaled = max / unit;
        let power = 10f64.powi(scaled.log10().floor() as i32);
        let whole_half = |top: f64| self != Quantity::Count || (top / 2.0).fract() == 0.0;
        let step = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
            .into_iter()
            .find(|s| s * power >= scaled - 1e-9 && whole_half(s * power))
            .unwrap_or(10.0);
        step * power * unit
    }

    pub fn format(self, value: f64) -> String {
        match self {
            Quantity::Count => count(value.round() as i64),
            Quantity::Bytes => bytes(value as i64),
            Quantity::Seconds => duration(value),
        }
    }
}

/// `3974` → `3.88 KiB`; `5368709120` → `5 GiB`.
pub fn bytes(n: i64) -> String {
    let formatted = format_size(n.max(0) as u64, BINARY);
    formatted.replace(".00 ", " ")
}

/// `95` → `1 min 35 s`; `7200` → `2 h`.
pub fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 10.0 {
        return format!("{s:.1} s");
    }
    if s >= 48.0 * 3600.0 {
        return format!("{:.0} days", s / 86_400.0);
    }
    let s = s.round() as u64;
    let (h, m, sec) = (s / 3600, s % 3600 / 60, s % 60);
    match (h, m, sec) {
        (0, 0, sec) => format!("{sec} s"),
        (0, m, 0) => format!("{m} min"),
        (0, m, sec) => format!("{m} min {sec} s"),
        (h, 0, _) => format!("{h} h"),
        (h, m, _) => format!("{h} h {m} min"),
    }
}

/// `5 min ago` with the exact RFC 3339 time on hover, in a `<time>` element.
pub fn relative(at: OffsetDateTime, now: OffsetDateTime) -> Markup {
    let exact = at.format(&Rfc3339).unwrap_or_default();
    let ago = (now - at).as_seconds_f64();
    let text = if ago < 0.0 {
        format!("in {}", duration(-ago))
    } else if ago < 5.0 {
        "just now".to_owned()
    } else {
        format!("{} ago", duration(ago))
    };
    html! { time datetime=(exact) title=(exact) { (text) } }
}

/// How much of `limit` `used` is, in percent (a limit of 0 is full at once).
pub fn percent(used: f64, limit: f64) -> f64 {
    if limit <= 0.0 { 100.0 } else { used / limit * 100.0 }
}

/// How close to a limit: `ok` below 80 %, `warn` from 80 %, `full` at 100 %.
pub fn level(percent: f64) -> &'static str {
    if percent >= 100.0 {
        "full"
    } else if percent >= 80.0 {
        "warn"
    } else {
        "ok"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_durations_and_levels_read_like_a_person_would_say_them() {
        assert_eq!(bytes(3974), "3.88 KiB");
        assert_eq!(bytes(5 << 30), "5 GiB");
        assert_eq!(bytes(20), "20 B");
        assert_eq!(duration(1.25), "1.2 s");
        assert_eq!(duration(95.0), "1 min 35 s");
        assert_eq!(duration(7200.0), "2 h");
        assert_eq!(duration(3.0 * 86_400.0), "3 days");
        assert_eq!(duration(3660.0), "1 h 1 min");
        assert_eq!(duration(72.0 * 3600.0 - 60.0), "3 days");
        assert_eq!((level(79.9), level(80.0), level(100.0)), ("ok", "warn", "full"));
        assert_eq!(percent(1.0, 0.0), 100.0);
        assert_eq!(
            (count(500_008), count(-1234), count(999), count(0)),
            ("500,008".into(), "-1,234".into(), "999".into(), "0".into())
        );
    }

    #[test]
    fn scales_end_on_round_values_of_their_unit() {
        assert_eq!(Quantity::Count.round_up(400_005.0), 500_000.0);
        assert_eq!(Quantity::Count.round_up(7.0), 8.0);
        assert_eq!(Quantity::Count.round_up(0.0), 2.0, "a middle line at 1, not 0.5");
        assert_eq!(Quantity::Count.round_up(3.0), 4.0);
        assert_eq!(Quantity::Count.round_up(12.0), 20.0, "not 15: its middle would be 7.5");
        assert_eq!(Quantity::Count.round_up(120.0), 150.0);
        assert_eq!(Quantity::Bytes.format(Quantity::Bytes.round_up(51.0 * 1024.0 * 1024.0)), "60 MiB");
        assert_eq!(Quantity::Bytes.format(Quantity::Bytes.round_up(3000.0)), "3 KiB");
        assert_eq!(Quantity::Seconds.format(Quantity::Seconds.round_up(95.0)), "2 min");
        assert_eq!(Quantity::Seconds.format(Quantity::Seconds.round_up(7.3)), "8.0 s");
    }

    #[test]
    fn relative_times_carry_the_exact_time() {
        let now = OffsetDateTime::from_unix_timestamp(1_764_676_800).unwrap();
        let html = relative(now - time::Duration::seconds(300), now).into_string();
        assert_eq!(html, r#"<time datetime="2025-12-02T11:55:00Z" title="2025-12-02T11:55:00Z">5 min ago</time>"#);
    }
}
