-- Bytes sent by each download (the body length of a 200 or 206), for egress accounting.
ALTER TABLE audit_log ADD COLUMN bytes bigint;
CREATE INDEX audit_log_downloads_by_day ON audit_log (tenant, at) WHERE action = 'downloaded';
