-- Parallel shards of one export. A full export's shards are planned before they are written:
-- each plan row says where the shard starts (after_key), where it ends and how many rows it
-- has, counted under the export's snapshot — so any worker, in any process, can write any
-- planned shard, and the bytes are those of a one-worker run. Incremental exports plan one shard
-- at a time (where the last one ended).
--
-- Each row carries its own writer lease: `writer_attempt` is the fencing token a shard's
-- checkpoint is recorded under (the job's lease generation still fences planning, publishing
-- and terminal states). `takeovers` counts takes of a row whose writer vanished without giving
-- it back; too many fail the export with attempts-exhausted.
CREATE TABLE export_shard_plan (
    export_id         uuid        NOT NULL,
    shard_index       integer     NOT NULL,
    after_key         text        COLLATE "C",
    last_key          text        COLLATE "C",
    -- NULL while unknown (incremental exports): write up to the job's shard_rows.
    rows              bigint,
    done              boolean     NOT NULL DEFAULT false,
    writer            text,
    writer_expires_at timestamptz,
    writer_attempt    integer     NOT NULL DEFAULT 0,
    takeovers         integer     NOT NULL DEFAULT 0,
    CONSTRAINT export_shard_plan_pkey PRIMARY KEY (export_id, shard_index),
    CONSTRAINT export_shard_plan_export FOREIGN KEY (export_id) REFERENCES export_jobs (id) ON DELETE CASCADE
);
-- Claims look for shards nobody has finished.
CREATE INDEX export_shard_plan_open ON export_shard_plan (export_id, shard_index) WHERE NOT done;

-- `planned_shards` rows exist; `plan_complete` once the last shard is planned.
ALTER TABLE export_jobs
    ADD COLUMN planned_shards integer NOT NULL DEFAULT 0,
    ADD COLUMN plan_complete  boolean NOT NULL DEFAULT false;

-- Which worker wrote each checkpointed shard (operators follow an export across processes).
ALTER TABLE export_shards ADD COLUMN written_by text;
