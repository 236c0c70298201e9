-- Each export records the deflate codec its shards are compressed with (src/writers/codec.rs),
-- fixed when the job is created: a shard rewritten later, by any binary, reproduces the bytes
-- of its checkpoint. Jobs from before this column were all written with miniz_oxide at level 3;
-- the default also covers an older binary still inserting jobs during a rolling upgrade.
ALTER TABLE export_jobs ADD COLUMN codec text NOT NULL DEFAULT 'miniz_oxide/3';
