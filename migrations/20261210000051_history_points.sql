-- Where in the database's history each snapshot was taken. A promoted standby continues the
-- old primary's history on a new timeline from a switch point; with asynchronous replication
-- the old primary may have committed more after that point, and the new primary hands those
-- transaction ids out again. A snapshot taken at WAL position p on timeline t saw only commits
-- whose records end at or before p, so it belongs to the new history exactly when the new
-- timeline's history says t ended at or after p (or t is the current timeline). exportd records
-- (timeline, WAL insert position) with every snapshot it hands to partners: feed ticks, export
-- watermarks, and, in the cursors built from them, `GET /cursor` snapshots (src/history.rs).

-- The timeline the server writes on (primary only: pg_walfile_name fails during recovery).
CREATE FUNCTION exportd_timeline() RETURNS int
LANGUAGE sql VOLATILE AS $$
    SELECT (pg_catalog.concat('x', pg_catalog.substr(
        pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8)))::bit(32)::int
$$;

-- The WAL insert position, in bytes: evaluated after the statement's snapshot was taken, it is
-- at or past the end of every commit record that snapshot sees.
CREATE FUNCTION exportd_wal_position() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT (pg_catalog.pg_current_wal_insert_lsn() OPERATOR(pg_catalog.-) '0/0'::pg_lsn)::bigint
$$;

-- Rows from before this migration get its own position: later than their snapshots, so a
-- failover judges them conservatively. Constant defaults add the columns without rewriting
-- the tables; new rows then take the position of the statement that inserts them (after its
-- snapshot: tick snapshots and watermarks are taken by the inserting statement).
DO $$
DECLARE
    tli int := exportd_timeline();
    pos bigint := exportd_wal_position();
BEGIN
    EXECUTE format('ALTER TABLE feed_ticks ADD COLUMN timeline int NOT NULL DEFAULT %s,
                    ADD COLUMN wal_position bigint NOT NULL DEFAULT %s', tli, pos);
    EXECUTE format('ALTER TABLE export_jobs ADD COLUMN watermark_timeline int NOT NULL DEFAULT %s,
                    ADD COLUMN watermark_wal_position bigint NOT NULL DEFAULT %s', tli, pos);
    -- Cursors sealed before this release carry no position: they stand at this one.
    EXECUTE format('ALTER TABLE deployment ADD COLUMN origin_timeline int NOT NULL DEFAULT %s,
                    ADD COLUMN origin_wal_position bigint NOT NULL DEFAULT %s', tli, pos);
END $$;
ALTER TABLE feed_ticks ALTER COLUMN timeline SET DEFAULT exportd_timeline(),
    ALTER COLUMN wal_position SET DEFAULT exportd_wal_position();
ALTER TABLE export_jobs ALTER COLUMN watermark_timeline SET DEFAULT exportd_timeline(),
    ALTER COLUMN watermark_wal_position SET DEFAULT exportd_wal_position();
ALTER TABLE deployment ALTER COLUMN origin_timeline DROP DEFAULT,
    ALTER COLUMN origin_wal_position DROP DEFAULT;

-- What a failover cost: each principal's refused positions, per timeline, for the dashboard
-- and the `feed.history_lost` webhook (sent on the first refusal of each).
CREATE TABLE failover_refusals (
    tenant        text        NOT NULL,
    principal     text        NOT NULL,
    dataset       text        NOT NULL,
    timeline      int         NOT NULL,
    refusals      bigint      NOT NULL DEFAULT 1,
    first_at      timestamptz NOT NULL,
    last_at       timestamptz NOT NULL,
    CONSTRAINT failover_refusals_pkey PRIMARY KEY (tenant, principal, dataset, timeline)
);
