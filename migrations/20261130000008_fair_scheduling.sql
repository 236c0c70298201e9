-- Fair scheduling: workers serve the tenant served least recently, and a long export yields its
-- lease between shards so other tenants' work interleaves.
ALTER TABLE tenant_usage ADD COLUMN last_claimed_at timestamptz;
-- Set when a worker gave the job back cleanly between shards: its checkpointed files need no
-- re-verification and the next claim is not another attempt.
ALTER TABLE export_jobs ADD COLUMN yielded boolean NOT NULL DEFAULT false;
