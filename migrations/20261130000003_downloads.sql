-- Downloads: where each shard's parts lie (so shards can be spliced into one whole-file
-- download), the whole file's size and checksum, lifecycle times, the audit log and a record of
-- reclaimed storage.

-- The gzip parts of a shard (see src/writers/gzip.rs): the head (BOM + CSV header) and the body
-- (rows), each with its compressed length, CRC-32 and uncompressed length.
ALTER TABLE export_shards
    ADD COLUMN head_bytes     bigint NOT NULL DEFAULT 0,
    ADD COLUMN head_crc32     bigint NOT NULL DEFAULT 0,
    ADD COLUMN head_raw_bytes bigint NOT NULL DEFAULT 0,
    ADD COLUMN body_bytes     bigint NOT NULL DEFAULT 0,
    ADD COLUMN body_crc32     bigint NOT NULL DEFAULT 0,
    ADD COLUMN body_raw_bytes bigint NOT NULL DEFAULT 0;
ALTER TABLE export_shards
    ALTER COLUMN head_bytes DROP DEFAULT, ALTER COLUMN head_crc32 DROP DEFAULT,
    ALTER COLUMN head_raw_bytes DROP DEFAULT, ALTER COLUMN body_bytes DROP DEFAULT,
    ALTER COLUMN body_crc32 DROP DEFAULT, ALTER COLUMN body_raw_bytes DROP DEFAULT;

ALTER TABLE export_jobs
    -- The whole export as one gzip file, computed at publish.
    ADD COLUMN file_bytes       bigint,
    ADD COLUMN file_sha256      text,
    ADD COLUMN published_at     timestamptz,
    -- published_at + the tenant's artifact_hours; the cleaner expires the export after it.
    ADD COLUMN expires_at       timestamptz,
    -- Set once the job's files are gone (revoked, expired, cancelled, failed).
    ADD COLUMN files_deleted_at timestamptz;

CREATE INDEX export_jobs_expiring ON export_jobs (expires_at) WHERE state = 'SUCCEEDED';

-- Who did what to which export, and every download. Never a token or a link.
CREATE TABLE audit_log (
    id        bigint GENERATED ALWAYS AS IDENTITY,
    at        timestamptz NOT NULL DEFAULT now(),
    tenant    text NOT NULL,
    principal text NOT NULL,
    action    text NOT NULL,
    export_id uuid,
    object    text,
    byte_range text,
    status    integer,
    address   text,
    CONSTRAINT audit_log_pkey PRIMARY KEY (id),
    CONSTRAINT audit_log_action CHECK (action IN ('created', 'cancelled', 'revoked', 'downloaded'))
);
CREATE INDEX audit_log_by_tenant ON audit_log (tenant, id DESC);

-- What the cleaner removed, and why.
CREATE TABLE storage_reclaims (
    id        bigint GENERATED ALWAYS AS IDENTITY,
    at        timestamptz NOT NULL DEFAULT now(),
    tenant    text,
    export_id uuid,
    reason    text NOT NULL,
    files     integer NOT NULL,
    bytes     bigint NOT NULL,
    CONSTRAINT storage_reclaims_pkey PRIMARY KEY (id)
);
