-- Workers that survive faults.

-- The scheduler's round-robin position per tenant, in a table only the claim touches: a claim
-- then never waits on (or deadlocks with) quota decisions, which lock the tenant's usage row.
CREATE TABLE scheduler_turns (
    tenant          text        NOT NULL,
    last_claimed_at timestamptz NOT NULL,
    CONSTRAINT scheduler_turns_pkey PRIMARY KEY (tenant)
);
INSERT INTO scheduler_turns (tenant, last_claimed_at)
    SELECT tenant, last_claimed_at FROM tenant_usage WHERE last_claimed_at IS NOT NULL;
ALTER TABLE tenant_usage DROP COLUMN last_claimed_at;

-- `attempts` counts every claim that was not a clean hand-back; `stalled_attempts` only the
-- consecutive ones that found no new checkpoint since the claim before (`shards_at_claim`), so a
-- job that keeps making progress between crashes never fails `attempts-exhausted`.
ALTER TABLE export_jobs
    ADD COLUMN stalled_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN shards_at_claim  integer NOT NULL DEFAULT 0;
