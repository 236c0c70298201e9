//! Numbers as people read them: binary byte units, durations, relative times (the exact time
//! goes in a `title`), percentages of a limit.

use humansize::{BINARY, format_size};
use maud::{Markup, html};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

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
    }

    #[test]
    fn relative_times_carry_the_exact_time() {
        let now = OffsetDateTime::from_unix_timestamp(1_764_676_800).unwrap();
        let html = relative(now - time::Duration::seconds(300), now).into_string();
        assert_eq!(html, r#"<time datetime="2025-12-02T11:55:00Z" title="2025-12-02T11:55:00Z">5 min ago</time>"#);
    }
}
