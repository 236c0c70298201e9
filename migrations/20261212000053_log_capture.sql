-- Log capture of attached host tables (src/attach/log): a host table in any PostgreSQL is
-- followed through a publication and a logical replication slot (pgoutput) on the host — no
-- trigger, function or table of exportd's in the host's schema, and no host write can fail or
-- wait because of exportd.
ALTER TABLE attachments
    -- `trigger` (a row trigger in exportd's own database) or `log` (logical decoding).
    ADD COLUMN capture      text    NOT NULL DEFAULT 'trigger',
    -- The host database's connection URL (log capture); NULL: exportd's own database.
    ADD COLUMN source       text,
    -- The publication and the logical replication slot on the host (one name for both).
    ADD COLUMN slot         text,
    -- The end of the last host transaction applied: the follower skips what is at or before
    -- it, so a crash between the apply's commit and the slot's advance applies nothing twice.
    ADD COLUMN applied_lsn  pg_lsn,
    -- Each copy of the host table (the first, and each resync) is a round.
    ADD COLUMN copy_round   integer NOT NULL DEFAULT 1,
    -- WAL the host keeps for the slot, and how far the applied position trails the host's
    -- WAL, when the follower last looked (bytes).
    ADD COLUMN retained_bytes bigint,
    ADD COLUMN lag_bytes    bigint,
    ADD COLUMN followed_at  timestamptz,
    -- Why the attachment is `lost` (the host invalidated or dropped its slot).
    ADD COLUMN lost_reason  text,
    -- The follower's last failure (the host unreachable, a change it cannot apply), until it
    -- applies again.
    ADD COLUMN last_error   text,
    ADD CONSTRAINT attachments_capture CHECK (capture IN ('trigger', 'log')),
    ADD CONSTRAINT attachments_log_slot CHECK (capture = 'trigger' OR slot IS NOT NULL),
    DROP CONSTRAINT attachments_state,
    ADD CONSTRAINT attachments_state CHECK (state IN ('backfilling', 'live', 'lost')),
    -- A table name is unique per host database (tables of two hosts may share a name).
    DROP CONSTRAINT attachments_host_table,
    ADD CONSTRAINT attachments_host_table UNIQUE NULLS NOT DISTINCT (source, host_table);

-- The host row behind each record of a log-captured attachment, every column as the host has
-- it: pgoutput sends an unchanged TOASTed value as "unchanged", and a delete or TRUNCATE only
-- the key (or nothing), so the follower needs the row's last image to write the record whole
-- and to know which records a TRUNCATE removes.
CREATE TABLE attachment_rows (
    attachment bigint  NOT NULL REFERENCES attachments ON DELETE CASCADE,
    -- The record key (the binding's key expression over the row).
    key        text    NOT NULL,
    -- The record's tenant (NULL: the row maps to no tenant and is no record).
    tenant     text,
    image      jsonb   NOT NULL,
    -- The copy batch that read the row (round, batch); NULL once the log has written it.
    copy_round integer,
    copy_batch integer,
    PRIMARY KEY (attachment, key)
);

-- The snapshot each copy batch read the host table in, and the key range it read (after
-- `after`, up to `last`; NULL: from the start, to the end): a logged transaction that snapshot
-- sees is already in that range as copied, and is not applied to it again — whether the row is
-- there or not.
CREATE TABLE attachment_copy_batches (
    attachment bigint      NOT NULL REFERENCES attachments ON DELETE CASCADE,
    round      integer     NOT NULL,
    batch      integer     NOT NULL,
    snapshot   pg_snapshot NOT NULL,
    after      text[],
    last       text[],
    PRIMARY KEY (attachment, round, batch)
);

-- Host rows the dataset refuses (a value that does not fit its column): the record is kept out
-- of exports and feeds, and said so, instead of failing the host's write. Never the value.
CREATE TABLE attachment_quarantine (
    attachment bigint      NOT NULL REFERENCES attachments ON DELETE CASCADE,
    tenant     text        NOT NULL,
    key        text        NOT NULL,
    field      text        NOT NULL,
    reason     text        NOT NULL,
    host_lsn   pg_lsn,
    at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (attachment, tenant, key)
);

-- A captured row's record: written (or deleted, `p_data` NULL) unless the record store already
-- holds exactly that, so a copy that meets rows the log already wrote, or a resync, adds no
-- version and no change to any feed. Returns whether a version was written.
CREATE FUNCTION exportd_capture_record(p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_held  boolean;
    v_data  jsonb;
BEGIN
    SELECT true, v.data INTO v_held, v_data FROM record_heads h JOIN record_versions v ON v.id = h.version_id
     WHERE h.tenant = p_tenant AND h.dataset = p_dataset AND h.key = p_key;
    IF v_data IS NOT DISTINCT FROM p_data AND (v_held OR p_data IS NULL) THEN
        RETURN false;
    END IF;
    RETURN exportd_write_version(p_tenant, p_dataset, p_key, p_data);
END $$;

-- Applies captured rows in order, in the caller's transaction. `p_ops` is a JSON array of
--   {"op":"put", "tenant", "key", "data", "image", "old_tenant", "old_key", "copy_round", "copy_batch", "lsn"}
--     the row as it now is (its record, its image), replacing the record it was (old_*) when
--     that was another key or tenant; a record the dataset refuses is quarantined and kept out;
--   {"op":"remove", "tenant", "key"}: the row is gone;
--   {"op":"keep_only", "round", "batches"}: every row but those copied in these batches of this
--     round is gone (a TRUNCATE those batches did not see; the end of a resync's copy).
-- Returns the number of record versions written.
CREATE FUNCTION exportd_capture_apply(p_attachment bigint, p_dataset text, p_ops jsonb)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_op      jsonb;
    v_tenant  text;
    v_key     text;
    v_problem record;
    v_gone    record;
    v_written integer := 0;
BEGIN
    FOR v_op IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        v_tenant := v_op->>'tenant';
        v_key := v_op->>'key';
        IF v_op->>'op' = 'put' THEN
            IF v_op->>'old_tenant' IS NOT NULL
               AND (v_op->>'old_tenant', v_op->>'old_key') IS DISTINCT FROM (v_tenant, v_key) THEN
                DELETE FROM attachment_quarantine
                 WHERE attachment = p_attachment AND tenant = v_op->>'old_tenant' AND key = v_op->>'old_key';
                v_written := v_written
                    + exportd_capture_record(v_op->>'old_tenant', p_dataset, v_op->>'old_key', NULL)::integer;
            END IF;
            IF v_tenant IS NOT NULL THEN
                v_problem := exportd_record_problem(v_tenant, p_dataset, v_key, v_op->'data');
                IF v_problem.field IS NULL THEN
                    DELETE FROM attachment_quarantine
                     WHERE attachment = p_attachment AND tenant = v_tenant AND key = v_key;
                    v_written := v_written
                        + exportd_capture_record(v_tenant, p_dataset, v_key, v_op->'data')::integer;
                ELSE
                    INSERT INTO attachment_quarantine (attachment, tenant, key, field, reason, host_lsn)
                    VALUES (p_attachment, v_tenant, v_key, v_problem.field, v_problem.message,
                            (v_op->>'lsn')::pg_lsn)
                    ON CONFLICT (attachment, tenant, key) DO UPDATE
                        SET field = excluded.field, reason = excluded.reason, host_lsn = excluded.host_lsn,
                            at = now();
                    v_written := v_written + exportd_capture_record(v_tenant, p_dataset, v_key, NULL)::integer;
                END IF;
            END IF;
            INSERT INTO attachment_rows (attachment, key, tenant, image, copy_round, copy_batch)
            VALUES (p_attachment, v_key, v_tenant, v_op->'image', (v_op->>'copy_round')::integer,
                    (v_op->>'copy_batch')::integer)
            ON CONFLICT (attachment, key) DO UPDATE
                SET tenant = excluded.tenant, image = excluded.image, copy_round = excluded.copy_round,
                    copy_batch = excluded.copy_batch;
        ELSIF v_op->>'op' = 'remove' THEN
            DELETE FROM attachment_rows WHERE attachment = p_attachment AND key = v_key;
            IF v_tenant IS NOT NULL THEN
                DELETE FROM attachment_quarantine WHERE attachment = p_attachment AND tenant = v_tenant AND key = v_key;
                v_written := v_written + exportd_capture_record(v_tenant, p_dataset, v_key, NULL)::integer;
            END IF;
        ELSIF v_op->>'op' = 'keep_only' THEN
            FOR v_gone IN
                DELETE FROM attachment_rows
                 WHERE attachment = p_attachment
                   AND NOT (copy_round IS NOT DISTINCT FROM (v_op->>'round')::integer
                            AND copy_batch IN (SELECT jsonb_array_elements_text(v_op->'batches')::integer))
                RETURNING tenant, key
            LOOP
                IF v_gone.tenant IS NOT NULL THEN
                    DELETE FROM attachment_quarantine
                     WHERE attachment = p_attachment AND tenant = v_gone.tenant AND key = v_gone.key;
                    v_written := v_written
                        + exportd_capture_record(v_gone.tenant, p_dataset, v_gone.key, NULL)::integer;
                END IF;
            END LOOP;
        ELSE
            RAISE EXCEPTION 'exportd_capture_apply: unknown op %', v_op->>'op';
        END IF;
    END LOOP;
    RETURN v_written;
END $$;

-- Pinned like every PL/pgSQL function of exportd's (see the pinned_search_path migration).
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION exportd_capture_record(text, text, text, jsonb) SET search_path = pg_catalog, %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION exportd_capture_apply(bigint, text, jsonb) SET search_path = pg_catalog, %I, pg_temp',
                   current_schema());
END $$;
