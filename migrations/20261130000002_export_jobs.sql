-- Export jobs, their shard checkpoints and their published manifests.

CREATE TABLE export_jobs (
    id               uuid        NOT NULL,
    tenant           text        NOT NULL,
    principal        text        NOT NULL,
    dataset          text        NOT NULL,
    mode             text        NOT NULL,
    format           text        NOT NULL,
    -- The request as accepted (canonical JSON, defaults filled in) and its sha256: an
    -- Idempotency-Key replay must carry the same request.
    request          jsonb       NOT NULL,
    request_sha256   text        NOT NULL,
    idempotency_key  text        NOT NULL,
    -- Frozen at creation: later config changes never widen what this job exports.
    columns          jsonb       NOT NULL,
    filter           jsonb       NOT NULL,
    row_filter       jsonb       NOT NULL,
    shard_rows       integer     NOT NULL,
    -- pg_current_snapshot() of the creating transaction: the export holds exactly what was
    -- committed before it.
    watermark        pg_snapshot NOT NULL,
    state            text        NOT NULL DEFAULT 'QUEUED',
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    -- Lease: the generation is the fencing token every worker write is conditioned on.
    lease_generation bigint      NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    attempts         integer     NOT NULL DEFAULT 0,
    shards_done      integer     NOT NULL DEFAULT 0,
    rows_done        bigint      NOT NULL DEFAULT 0,
    bytes_done       bigint      NOT NULL DEFAULT 0,
    error_code       text,
    error_detail     text,
    -- The manifest exactly as published (bytes) and its sha256 (the strong ETag).
    manifest         bytea,
    manifest_sha256  text,
    CONSTRAINT export_jobs_pkey PRIMARY KEY (id),
    CONSTRAINT export_jobs_idempotency_key UNIQUE (tenant, principal, idempotency_key),
    CONSTRAINT export_jobs_state CHECK (state IN
        ('QUEUED', 'RUNNING', 'CANCEL_REQUESTED', 'CANCELLED', 'SUCCEEDED', 'FAILED', 'EXPIRED', 'REVOKED')),
    CONSTRAINT export_jobs_mode CHECK (mode IN ('full', 'incremental')),
    CONSTRAINT export_jobs_format CHECK (format IN ('csv', 'jsonl')),
    CONSTRAINT export_jobs_shard_rows CHECK (shard_rows > 0),
    CONSTRAINT export_jobs_published CHECK ((state = 'SUCCEEDED') <= (manifest IS NOT NULL))
);

-- Workers look for claimable jobs; listings page newest first per tenant.
CREATE INDEX export_jobs_claimable ON export_jobs (created_at, id)
    WHERE state IN ('QUEUED', 'RUNNING', 'CANCEL_REQUESTED');
CREATE INDEX export_jobs_by_tenant ON export_jobs (tenant, created_at DESC, id DESC);

-- One row per finished shard file, written in the same fenced transaction that advances progress.
CREATE TABLE export_shards (
    export_id   uuid    NOT NULL,
    shard_index integer NOT NULL,
    first_key   text    COLLATE "C",
    last_key    text    COLLATE "C",
    rows        bigint  NOT NULL,
    bytes       bigint  NOT NULL,
    sha256      text    NOT NULL,
    -- Where the file lives in the artifact store (includes the writing lease generation, so a
    -- stale worker can never overwrite a newer attempt's file).
    object_key  text    NOT NULL,
    CONSTRAINT export_shards_pkey PRIMARY KEY (export_id, shard_index),
    CONSTRAINT export_shards_export FOREIGN KEY (export_id) REFERENCES export_jobs (id) ON DELETE CASCADE
);
