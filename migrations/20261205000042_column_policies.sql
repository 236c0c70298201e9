-- Column policies (src/masking): the fingerprint of the partner's column policy an export was
-- cut under (NULL: none). Once the principal's policy changes, its old files are refused like
-- those of a changed row filter.
ALTER TABLE export_jobs ADD COLUMN column_policy text;

-- Export events name the policy too, so a partner's endpoint can tell which view its files have.
CREATE OR REPLACE FUNCTION exportd_export_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    kind text := CASE NEW.state
        WHEN 'SUCCEEDED' THEN 'export.succeeded'
        WHEN 'FAILED'    THEN 'export.failed'
        WHEN 'CANCELLED' THEN 'export.cancelled'
        WHEN 'EXPIRED'   THEN 'export.expired'
        WHEN 'REVOKED'   THEN 'export.revoked'
    END;
BEGIN
    IF kind IS NOT NULL THEN
        INSERT INTO webhook_events (tenant, type, principal, dataset, export_id, data)
        VALUES (NEW.tenant, kind, NEW.principal, NEW.dataset, NEW.id, jsonb_strip_nulls(jsonb_build_object(
            'export_id', NEW.id,
            'dataset', NEW.dataset,
            'principal', NEW.principal,
            'mode', NEW.mode,
            'format', NEW.format,
            'state', NEW.state,
            'created_at', exportd_utc(NEW.created_at),
            'finished_at', exportd_utc(coalesce(NEW.finished_at, now())),
            'total_rows', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.rows_done END,
            'total_bytes', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.bytes_done END,
            'shards', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.shards_done END,
            'file_sha256', NEW.file_sha256,
            'manifest_sha256', NEW.manifest_sha256,
            'column_policy', NEW.column_policy,
            'error_code', CASE WHEN NEW.state = 'FAILED' THEN NEW.error_code END)));
    END IF;
    RETURN NULL;
END
$$;
