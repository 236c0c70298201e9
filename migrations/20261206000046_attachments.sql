-- Attached host tables (src/attach): a host application's own table feeds a dataset through a
-- generated row trigger that writes records in the host's transaction, after an online
-- backfill of the rows that were there. One attachment per host table.
CREATE TABLE attachments (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The host table, schema-qualified as `regclass` prints it.
    host_table    text        NOT NULL,
    dataset       text        NOT NULL,
    -- Key columns, tenant rule and column expressions, as given (see attach::Spec).
    spec          jsonb       NOT NULL,
    -- The tenants whose records it writes: exports and feeds of (tenant, dataset) wait for the
    -- backfill.
    tenants       text[]      NOT NULL,
    state         text        NOT NULL DEFAULT 'backfilling',
    -- The key (the host's primary key values, as text) of the last row backfilled.
    backfill_after text[],
    rows_done     bigint      NOT NULL DEFAULT 0,
    rows_written  bigint      NOT NULL DEFAULT 0,
    rows_estimate bigint      NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    CONSTRAINT attachments_host_table UNIQUE (host_table),
    CONSTRAINT attachments_state CHECK (state IN ('backfilling', 'live'))
);

-- exportd_write_version, able to leave a tombstone where there is nothing to delete
-- (`p_always_tombstone`). The capture trigger's deletes need one even for a key the record
-- store does not hold yet (a row the backfill has not reached), so a backfill that read the row
-- before the delete sees a newer state and leaves it out; a tombstone over no record is no
-- change to any reader (feeds and exports skip it). Otherwise as in the record store's
-- migration; the four-argument form is this one without it.
CREATE FUNCTION exportd_write_version(p_tenant text, p_dataset text, p_key text, p_data jsonb,
                                      p_always_tombstone boolean)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_xid       xid8 := pg_current_xact_id();
    v_head      bigint;
    v_head_xid  xid8;
    v_head_data jsonb;
    v_new       bigint;
BEGIN
    -- Lock the key's head row, creating it for a new key. ON CONFLICT DO UPDATE waits for a
    -- concurrent writer of the same key and then returns its committed head: no unique-index
    -- collision, no lost update, and versions of one key follow commit order.
    INSERT INTO record_heads AS h (tenant, dataset, key) VALUES (p_tenant, p_dataset, p_key)
    ON CONFLICT ON CONSTRAINT record_heads_pkey DO UPDATE SET version_id = h.version_id
    RETURNING h.version_id INTO v_head;

    IF v_head IS NOT NULL THEN
        SELECT v.created_xid, v.data INTO v_head_xid, v_head_data FROM record_versions v WHERE v.id = v_head;
    END IF;
    IF p_data IS NULL AND v_head_data IS NULL AND NOT p_always_tombstone THEN
        RETURN false;
    END IF;
    IF v_head_xid = v_xid THEN
        -- Written earlier in this same transaction, so no snapshot can see it: replace in place.
        UPDATE record_versions SET data = p_data WHERE id = v_head;
        RETURN true;
    END IF;
    IF v_head IS NOT NULL THEN
        UPDATE record_versions SET closed_xid = v_xid WHERE id = v_head;
    END IF;
    INSERT INTO record_versions (tenant, dataset, key, data)
    VALUES (p_tenant, p_dataset, p_key, p_data) RETURNING id INTO v_new;
    UPDATE record_heads SET version_id = v_new
    WHERE tenant = p_tenant AND dataset = p_dataset AND key = p_key;
    RETURN true;
END $$;

CREATE OR REPLACE FUNCTION exportd_write_version(p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS boolean LANGUAGE sql AS $$
    SELECT exportd_write_version(p_tenant, p_dataset, p_key, p_data, false)
$$;

-- Raises EXD01 (COLUMN = the field) for a record that does not fit its dataset, as
-- exportd_upsert and exportd_delete do.
CREATE FUNCTION exportd_refuse_misfit(p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, p_data);
    IF v_problem.field IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field,
            MESSAGE = v_problem.field || ': ' || v_problem.message;
    END IF;
END $$;

-- The backfill's write of one row read at `p_snapshot`: skipped when the key was written by a
-- transaction that snapshot does not see (the capture trigger wrote a newer state, or a
-- deletion) or already holds the same data. The head row lock serializes it with the trigger's
-- writes of the same key (a writer still running is waited for, within the caller's
-- lock_timeout), so a newer version is never overwritten.
CREATE FUNCTION exportd_backfill_write(p_tenant text, p_dataset text, p_key text, p_data jsonb, p_snapshot pg_snapshot)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_head bigint;
    v_xid  xid8;
    v_data jsonb;
BEGIN
    PERFORM exportd_refuse_misfit(p_tenant, p_dataset, p_key, p_data);
    INSERT INTO record_heads AS h (tenant, dataset, key) VALUES (p_tenant, p_dataset, p_key)
    ON CONFLICT ON CONSTRAINT record_heads_pkey DO UPDATE SET version_id = h.version_id
    RETURNING h.version_id INTO v_head;
    IF v_head IS NOT NULL THEN
        SELECT v.created_xid, v.data INTO v_xid, v_data FROM record_versions v WHERE v.id = v_head;
        IF NOT pg_visible_in_snapshot(v_xid, p_snapshot) OR v_data IS NOT DISTINCT FROM p_data THEN
            RETURN false;
        END IF;
    END IF;
    RETURN exportd_write_version(p_tenant, p_dataset, p_key, p_data);
END $$;

-- The capture trigger's delete: like exportd_delete, but it always leaves a tombstone (see
-- the five-argument exportd_write_version).
CREATE FUNCTION exportd_capture_delete(p_tenant text, p_dataset text, p_key text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM exportd_refuse_misfit(p_tenant, p_dataset, p_key, NULL);
    PERFORM exportd_write_version(p_tenant, p_dataset, p_key, NULL, true);
END $$;
