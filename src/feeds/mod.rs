//! Incremental feeds: sealed windows between snapshots, pages of changes by cursor, tombstones.
//!
//! A ticker records `pg_current_snapshot()` about every second. A window runs from a start
//! snapshot (an earlier window's end, a full export's watermark, or "now") to the newest tick
//! that is older than the tenant's safety delay; it holds each key whose record changed in a
//! transaction visible at the end and not at the start, with its state at both ends. So every
//! committed change reaches a partner exactly once, whatever order transactions commit in.

mod changes;
mod cursor;
pub mod gc;
mod ticker;
mod window;

pub use changes::{ChainPosition, Change, ChangePage, Feed, Op, chain_end, chain_page, page};
pub use cursor::{Cursor, CursorError, CursorOwner};
pub use ticker::{run_ticker, tick};
pub use window::{Seal, Window, newest_sealed_tick, next_window};
