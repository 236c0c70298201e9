-- Refusals of every kind (rate, concurrency, downloads, egress, queued, storage) per tenant and
-- UTC day: `GET /v1/usage` shows today's by kind, and the tenant_usage totals now count every
-- kind (quota_rejections missed storage and egress refusals). Flushed from each process's memory
-- about every second; rows older than 400 days are collected by the cleaner.
CREATE TABLE tenant_refusals (
    tenant text   NOT NULL,
    day    date   NOT NULL,
    kind   text   NOT NULL,
    count  bigint NOT NULL,
    CONSTRAINT tenant_refusals_pkey PRIMARY KEY (tenant, day, kind)
);
