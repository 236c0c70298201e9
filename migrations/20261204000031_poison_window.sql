-- An export fails with `attempts-exhausted` only when its attempts keep ending without a
-- checkpoint for a long time, not merely many times: a storm of killed workers ends many
-- attempts quickly, an export that crashes every worker keeps doing it. `stalled_since` is when
-- the current run of attempts without a new checkpoint began; `first_takeover_at` is when a
-- planned shard's writer first vanished without giving it back.
ALTER TABLE export_jobs ADD COLUMN stalled_since timestamptz;
ALTER TABLE export_shard_plan ADD COLUMN first_takeover_at timestamptz;
