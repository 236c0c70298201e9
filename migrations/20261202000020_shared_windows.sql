-- Shared windows: storage grows with changes, not with readers. A window now starts at a tick
-- (from_tick) as well as ending at one, the windows of a dataset never overlap, and a reader
-- whose start lies inside a window reads that window from its own start (only the keys changed
-- after it). Sixty cursors taken a moment apart used to cut sixty windows holding the same keys.
--
-- Windows cut before this migration have no from_tick: they are read only from their exact
-- start, so cursors in flight keep their place. So are windows whose start is older than every
-- tick (a cursor taken before the ticker's first tick).
ALTER TABLE feed_windows ADD COLUMN from_tick bigint;

ALTER TABLE feed_windows DROP CONSTRAINT feed_windows_start;
CREATE UNIQUE INDEX feed_windows_exact_start ON feed_windows (tenant, dataset, from_snapshot)
    WHERE from_tick IS NULL;
CREATE UNIQUE INDEX feed_windows_chain_start ON feed_windows (tenant, dataset, from_tick)
    WHERE from_tick IS NOT NULL;
-- The window a start lies in: the first shared window ending after its tick.
CREATE INDEX feed_windows_chain_end ON feed_windows (tenant, dataset, to_tick)
    WHERE from_tick IS NOT NULL;

-- The newest tick a snapshot sees. Tick xmax values rise strictly with the id (each tick's own
-- insert takes a new xid), so this index finds it in one descent however old the snapshot.
CREATE INDEX feed_ticks_xmax ON feed_ticks ((pg_snapshot_xmax(snapshot)));
