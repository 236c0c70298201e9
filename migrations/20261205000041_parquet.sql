-- Parquet exports (issue 38).
-- Frozen at creation, written into every Parquet footer: a shard rewritten later, by any
-- binary, reproduces its checkpoint. Older jobs keep empty text (their formats write neither).
ALTER TABLE export_jobs
    ADD COLUMN schema_sha256 text NOT NULL DEFAULT '',
    ADD COLUMN exportd_version text NOT NULL DEFAULT '';
-- A self-contained shard file's column statistics (min, max, null count), as its footer holds
-- them, for the manifest. NULL for gzip shards.
ALTER TABLE export_shards ADD COLUMN stats jsonb;
