//! The time the server believes it is. Tests move it forward instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use time::OffsetDateTime;

#[derive(Debug, Clone, Default)]
pub struct Clock {
    /// Seconds added to the system time (0 in production).
    offset: Arc<AtomicI64>,
}

impl Clock {
    pub fn system() -> Clock {
        Clock::default()
    }

    pub fn now(&self) -> OffsetDateTime {
        OffsetDateTime::now_utc() + time::Duration::seconds(self.offset.load(Ordering::Relaxed))
    }

    pub fn unix_seconds(&self) -> u64 {
        self.now().unix_timestamp().max(0) as u64
    }

    /// Moves this clock (and every clone of it) forward.
    pub fn advance(&self, by: Duration) {
        self.offset.fetch_add(by.as_secs() as i64, Ordering::Relaxed);
    }
}
