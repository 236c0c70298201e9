-- The versioned record store.
--
-- Every write creates a version stamped with the writing transaction's id (xid8); an update or a
-- delete closes the previous version with the writer's xid. "The record as of snapshot W" is the
-- version whose created_xid is visible in W and whose closed_xid is absent or not visible in W.
-- That read is exact and repeatable from any later transaction, without holding a snapshot open.

-- The datasets each tenant exposes, copied from tenants/*.toml at start-up so that the SQL
-- functions below can validate records written by host applications.
CREATE TABLE datasets (
    tenant     text  NOT NULL,
    dataset    text  NOT NULL,
    key_column text  NOT NULL,
    -- [{"name": "...", "type": "string|integer|number|boolean|timestamp|json", "required": bool}]
    columns    jsonb NOT NULL,
    CONSTRAINT datasets_pkey PRIMARY KEY (tenant, dataset)
);

-- One row per key ever written. Its row lock serializes writers of one key, so the per-key
-- version order is commit order (see the READ COMMITTED trap in docs/contract.md).
CREATE TABLE record_heads (
    tenant     text NOT NULL,
    dataset    text NOT NULL,
    key        text COLLATE "C" NOT NULL,
    -- The newest version (a tombstone after a delete); NULL only while the first write is running.
    version_id bigint,
    CONSTRAINT record_heads_pkey PRIMARY KEY (tenant, dataset, key)
);

CREATE TABLE record_versions (
    -- Drawn after the head row lock, so ids of one key increase in commit order.
    id          bigint GENERATED ALWAYS AS IDENTITY,
    tenant      text  NOT NULL,
    dataset     text  NOT NULL,
    key         text  COLLATE "C" NOT NULL,
    created_xid xid8  NOT NULL DEFAULT pg_current_xact_id(),
    closed_xid  xid8,
    -- NULL marks a tombstone: the key was deleted by created_xid.
    data        jsonb,
    CONSTRAINT record_versions_pkey PRIMARY KEY (id),
    CONSTRAINT record_versions_data_is_object CHECK (data IS NULL OR jsonb_typeof(data) = 'object'),
    CONSTRAINT record_versions_key_length CHECK (octet_length(key) BETWEEN 1 AND 512)
);

-- Keyset pages in key order (byte order, COLLATE "C") for full exports.
CREATE INDEX record_versions_by_key ON record_versions (tenant, dataset, key, id);
-- Change windows between two snapshots for feeds.
CREATE INDEX record_versions_by_xid ON record_versions (tenant, dataset, created_xid);

-- Why a record does not fit its dataset: NULL when it fits, else the field and a message.
CREATE FUNCTION exportd_record_problem(p_tenant text, p_dataset text, p_key text, p_data jsonb,
                                       OUT field text, OUT message text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_columns jsonb;
    v_column  jsonb;
    v_name    text;
    v_type    text;
    v_value   jsonb;
    v_fits    boolean;
BEGIN
    SELECT d.columns INTO v_columns FROM datasets d WHERE d.tenant = p_tenant AND d.dataset = p_dataset;
    IF v_columns IS NULL THEN
        field := 'dataset'; message := format('unknown dataset %L for tenant %L', p_dataset, p_tenant);
        RETURN;
    END IF;
    IF p_key IS NULL OR octet_length(p_key) NOT BETWEEN 1 AND 512 THEN
        field := 'key'; message := 'key must be 1 to 512 bytes';
        RETURN;
    END IF;
    IF p_data IS NULL THEN
        RETURN; -- a delete
    END IF;
    IF jsonb_typeof(p_data) <> 'object' THEN
        field := 'data'; message := 'data must be a JSON object';
        RETURN;
    END IF;
    SELECT k INTO v_name FROM jsonb_object_keys(p_data) AS k
    WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(v_columns) c WHERE c->>'name' = k)
    ORDER BY k LIMIT 1;
    IF v_name IS NOT NULL THEN
        field := 'data.' || v_name; message := format('unknown column %L', v_name);
        RETURN;
    END IF;
    FOR v_column IN SELECT * FROM jsonb_array_elements(v_columns) LOOP
        v_name := v_column->>'name';
        v_type := v_column->>'type';
        v_value := p_data->v_name;
        IF v_value IS NULL OR jsonb_typeof(v_value) = 'null' THEN
            IF (v_column->>'required')::boolean THEN
                field := 'data.' || v_name; message := 'required column is missing or null';
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        -- (Assigned first: inside IF, plpgsql would end the condition at the CASE's first THEN.)
        v_fits := CASE v_type
            WHEN 'string' THEN jsonb_typeof(v_value) = 'string'
            WHEN 'number' THEN jsonb_typeof(v_value) = 'number'
            WHEN 'boolean' THEN jsonb_typeof(v_value) = 'boolean'
            WHEN 'integer' THEN jsonb_typeof(v_value) = 'number'
                AND v_value::numeric = trunc(v_value::numeric)
                AND v_value::numeric BETWEEN -9223372036854775808 AND 9223372036854775807
            WHEN 'timestamp' THEN jsonb_typeof(v_value) = 'string'
                AND exportd_is_rfc3339(v_value #>> '{}')
            ELSE true -- json: any value
        END;
        IF NOT v_fits THEN
            field := 'data.' || v_name;
            message := format('expected %s, got %s', CASE v_type WHEN 'timestamp'
                THEN 'an RFC 3339 timestamp string' WHEN 'integer' THEN 'a 64-bit integer'
                ELSE 'a ' || v_type END, jsonb_typeof(v_value));
            RETURN;
        END IF;
    END LOOP;
END $$;

CREATE FUNCTION exportd_is_rfc3339(p_text text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_text !~ '^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$' THEN
        RETURN false;
    END IF;
    PERFORM p_text::timestamptz; -- rejects 2026-13-45 and friends
    RETURN true;
EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
    RETURN false;
END $$;

-- Writes one version of a key (p_data NULL = delete) in the caller's transaction, without
-- validation. Returns false for a delete of a key that does not exist.
CREATE FUNCTION exportd_write_version(p_tenant text, p_dataset text, p_key text, p_data jsonb)
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
    IF p_data IS NULL AND v_head_data IS NULL THEN
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

-- Public API for host applications: validate, then write, inside the caller's transaction.
-- A record that does not fit raises SQLSTATE EXD01 with COLUMN set to the offending field.
CREATE FUNCTION exportd_upsert(p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    IF p_data IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = 'data',
            MESSAGE = 'data must be a JSON object (use exportd_delete to delete)';
    END IF;
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, p_data);
    IF v_problem.field IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field, MESSAGE = v_problem.message;
    END IF;
    PERFORM exportd_write_version(p_tenant, p_dataset, p_key, p_data);
END $$;

-- Returns whether the key existed.
CREATE FUNCTION exportd_delete(p_tenant text, p_dataset text, p_key text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, NULL);
    IF v_problem.field IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field, MESSAGE = v_problem.message;
    END IF;
    RETURN exportd_write_version(p_tenant, p_dataset, p_key, NULL);
END $$;

-- A batch for the HTTP ingest: validates every record first (raising EXD01 with COLUMN = the
-- field and DETAIL = the record's 0-based index), then writes them in order.
CREATE FUNCTION exportd_write_batch(p_tenant text, p_dataset text, p_keys text[], p_data jsonb[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
    i int;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        v_problem := exportd_record_problem(p_tenant, p_dataset, p_keys[i], p_data[i]);
        IF v_problem.field IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field,
                MESSAGE = v_problem.message, DETAIL = (i - 1)::text;
        END IF;
    END LOOP;
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        PERFORM exportd_write_version(p_tenant, p_dataset, p_keys[i], p_data[i]);
    END LOOP;
END $$;
