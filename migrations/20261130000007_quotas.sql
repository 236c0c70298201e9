-- Per-tenant quota bookkeeping. The row is locked by every export create of its tenant, so
-- concurrent creates count queued jobs one after another (no racy pre-check).
CREATE TABLE tenant_usage (
    tenant               text        NOT NULL,
    -- Rate-limited API requests refused (for the usage API).
    rate_limited         bigint      NOT NULL DEFAULT 0,
    quota_rejections     bigint      NOT NULL DEFAULT 0,
    CONSTRAINT tenant_usage_pkey PRIMARY KEY (tenant)
);
