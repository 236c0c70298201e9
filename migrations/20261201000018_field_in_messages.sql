-- The host application's write functions name the offending field in the message itself, so
-- a client that shows only the message (psql's default verbosity, most drivers' error text)
-- still says which field; COLUMN keeps carrying it for programs.
CREATE OR REPLACE FUNCTION exportd_upsert(p_tenant text, p_dataset text, p_key text, p_data jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    IF p_data IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = 'data',
            MESSAGE = 'data: must be a JSON object (use exportd_delete to delete)';
    END IF;
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, p_data);
    IF v_problem.field IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field,
            MESSAGE = v_problem.field || ': ' || v_problem.message;
    END IF;
    PERFORM exportd_write_version(p_tenant, p_dataset, p_key, p_data);
END $$;

CREATE OR REPLACE FUNCTION exportd_delete(p_tenant text, p_dataset text, p_key text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_problem record;
BEGIN
    v_problem := exportd_record_problem(p_tenant, p_dataset, p_key, NULL);
    IF v_problem.field IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD01', COLUMN = v_problem.field,
            MESSAGE = v_problem.field || ': ' || v_problem.message;
    END IF;
    RETURN exportd_write_version(p_tenant, p_dataset, p_key, NULL);
END $$;
