-- An ingest batch locks its keys in one order (byte order of the key, then position in the
-- batch), so two batches writing the same keys in different orders never deadlock each other.
-- A key written twice in one batch keeps its order: the later write wins, as before.
-- Validation still runs first, in batch order, and reports the batch position.
CREATE OR REPLACE FUNCTION exportd_write_batch(p_tenant text, p_dataset text, p_keys text[], p_data jsonb[])
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
    FOR i IN SELECT k.position FROM unnest(p_keys) WITH ORDINALITY AS k(key, position)
             ORDER BY k.key COLLATE "C", k.position LOOP
        PERFORM exportd_write_version(p_tenant, p_dataset, p_keys[i], p_data[i]);
    END LOOP;
END $$;
