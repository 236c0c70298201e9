-- Today's egress as a counter on the tenant's usage row, so admitting a download is O(1)
-- instead of summing the day's audit rows (which grew with every download).
ALTER TABLE tenant_usage
    ADD COLUMN egress_day   date,
    ADD COLUMN egress_bytes bigint NOT NULL DEFAULT 0;
UPDATE tenant_usage u SET egress_day = d.day, egress_bytes = d.bytes
FROM (SELECT tenant, (now() AT TIME ZONE 'UTC')::date AS day, sum(bytes)::bigint AS bytes
      FROM audit_log
      WHERE action = 'downloaded' AND at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
      GROUP BY tenant) d
WHERE d.tenant = u.tenant;
