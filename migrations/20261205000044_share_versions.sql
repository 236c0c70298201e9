-- Delta Sharing (src/sharing): the versions of a shared table. A table is one dataset as one
-- principal's share holds it; each version is a published full Parquet export of the whole
-- dataset (no `columns`, no `filter`) by that principal, numbered from 0 in snapshot order when
-- it publishes, in the publication's transaction. Never updated: a version whose export expired
-- or was revoked keeps its number and answers "no longer retained".
CREATE TABLE share_versions (
    tenant       text        NOT NULL,
    principal    text        NOT NULL,
    dataset      text        NOT NULL,
    version      bigint      NOT NULL,
    export_id    uuid        NOT NULL REFERENCES export_jobs (id),
    -- The export's creation, when its snapshot was taken: the version's Delta timestamp.
    snapshot_at  timestamptz NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT share_versions_pkey PRIMARY KEY (tenant, principal, dataset, version),
    CONSTRAINT share_versions_export UNIQUE (export_id),
    CONSTRAINT share_versions_version CHECK (version >= 0)
);
