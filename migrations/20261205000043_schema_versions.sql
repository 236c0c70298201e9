-- Versioned dataset schemas (src/schemas): every distinct schema a process started with, as
-- `major.minor`. A compatible change is the next minor; a breaking one the next major, which the
-- dataset file must declare. Written at start-up under an advisory lock, never updated.
CREATE TABLE dataset_schemas (
    dataset     text        NOT NULL,
    major       integer     NOT NULL,
    minor       integer     NOT NULL,
    sha256      text        NOT NULL,
    -- The schema as declared (name, version, key column, columns).
    schema      jsonb       NOT NULL,
    -- 'initial' (the first one recorded), 'compatible' or 'breaking', against the version before.
    change      text        NOT NULL,
    -- [{"change": "added|removed|renamed|retyped|widened|required|optional|key_renamed", "column": …}]
    changes     jsonb       NOT NULL DEFAULT '[]',
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dataset_schemas_pkey PRIMARY KEY (dataset, major, minor),
    CONSTRAINT dataset_schemas_version CHECK (major >= 1 AND minor >= 0),
    CONSTRAINT dataset_schemas_change CHECK (change IN ('initial', 'compatible', 'breaking'))
);

-- The schema version an export was written with (its columns were frozen from it). Older jobs
-- keep empty text.
ALTER TABLE export_jobs ADD COLUMN schema_version text NOT NULL DEFAULT '';
