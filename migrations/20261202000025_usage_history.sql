-- Usage over time, one row per tenant and UTC hour (days are sums and maxima of their hours):
-- counters recomputed from the durable sources while the hour is recent (downloads in the audit
-- log, finished exports, refusals), gauges (stored bytes, queue) sampled about once a minute and
-- kept at their highest. Written by every API process's housekeeping (quota/history.rs), kept
-- 90 days (the cleaner collects older rows).
CREATE TABLE tenant_usage_hours (
    tenant                    text        NOT NULL,
    hour                      timestamptz NOT NULL,
    egress_bytes              bigint      NOT NULL DEFAULT 0,
    rows_exported             bigint      NOT NULL DEFAULT 0,
    exports_succeeded         integer     NOT NULL DEFAULT 0,
    exports_failed            integer     NOT NULL DEFAULT 0,
    exports_cancelled         integer     NOT NULL DEFAULT 0,
    -- Seconds from create to publish of the exports that succeeded in the hour.
    export_seconds_p50        double precision,
    export_seconds_p95        double precision,
    -- {"rate": n, "queued": n, ...}: only kinds with refusals.
    refusals                  jsonb       NOT NULL DEFAULT '{}',
    stored_bytes_max          bigint      NOT NULL DEFAULT 0,
    queued_max                integer     NOT NULL DEFAULT 0,
    running_max               integer     NOT NULL DEFAULT 0,
    oldest_queued_seconds_max bigint      NOT NULL DEFAULT 0,
    CONSTRAINT tenant_usage_hours_pkey PRIMARY KEY (tenant, hour),
    CONSTRAINT tenant_usage_hours_on_the_hour CHECK (hour = date_trunc('hour', hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')
);
CREATE INDEX tenant_usage_hours_by_hour ON tenant_usage_hours (hour);

-- Refusals per tenant, UTC hour and kind, next to the per-day counts (same flush, same statement).
CREATE TABLE tenant_refusal_hours (
    tenant text        NOT NULL,
    hour   timestamptz NOT NULL,
    kind   text        NOT NULL,
    count  bigint      NOT NULL,
    CONSTRAINT tenant_refusal_hours_pkey PRIMARY KEY (tenant, hour, kind)
);
CREATE INDEX tenant_refusal_hours_by_hour ON tenant_refusal_hours (hour);

-- The hourly recount reads an hour of downloads and of finished exports.
CREATE INDEX audit_log_downloads_by_time ON audit_log (at) WHERE action = 'downloaded';
CREATE INDEX export_jobs_by_finish ON export_jobs (finished_at) WHERE finished_at IS NOT NULL;
