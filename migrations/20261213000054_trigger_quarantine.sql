-- Trigger capture quarantines too (src/attach/sql.rs): a row the dataset refuses no longer fails
-- the host's statement with EXD01. Its record is deleted (a tombstone: no stale version is
-- exported), the row is listed in attachment_quarantine (key, field, reason — never the value)
-- and announced to the tenant (`attachment.quarantined`); a later write of the row that fits
-- takes it out again. A record key the record store refuses (NULL, over 512 bytes) still fails
-- the statement: it names no record that could be quarantined.
CREATE FUNCTION exportd_capture_upsert(p_attachment bigint, p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, p_data);
    IF v_problem.field IS NULL THEN
        DELETE FROM attachment_quarantine WHERE attachment = p_attachment AND tenant = p_tenant AND key = p_key;
        PERFORM exportd_write_version(p_tenant, p_dataset, p_key, p_data);
        RETURN;
    END IF;
    IF v_problem.field IN ('key', 'dataset') THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field,
            MESSAGE = v_problem.field || ': ' || v_problem.message;
    END IF;
    INSERT INTO attachment_quarantine (attachment, tenant, key, field, reason)
    VALUES (p_attachment, p_tenant, p_key, v_problem.field, v_problem.message)
    ON CONFLICT (attachment, tenant, key) DO UPDATE
        SET field = excluded.field, reason = excluded.reason, at = now();
    INSERT INTO webhook_events (tenant, type, dataset, data)
    VALUES (p_tenant, 'attachment.quarantined', p_dataset, jsonb_build_object(
        'dataset', p_dataset, 'new', 1,
        'quarantined', (SELECT count(*) FROM attachment_quarantine WHERE attachment = p_attachment AND tenant = p_tenant),
        'rows', jsonb_build_array(jsonb_build_object('key', p_key, 'field', v_problem.field, 'reason', v_problem.message))));
    PERFORM exportd_write_version(p_tenant, p_dataset, p_key, NULL, true);
END $$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION exportd_capture_upsert(bigint, text, text, text, jsonb) SET search_path = pg_catalog, %I, pg_temp',
                   current_schema());
END $$;
