-- Limits every record write meets, through the SQL functions and the HTTP ingest alike: at most
-- 1 MiB of JSON text, nested at most 64 levels deep (the record object counting as one). The
-- export encoder reads 128 levels, so no stored record can make an export fail.
ALTER FUNCTION exportd_record_problem(text, text, text, jsonb) RENAME TO exportd_record_fit_problem;

CREATE FUNCTION exportd_record_problem(p_tenant text, p_dataset text, p_key text, p_data jsonb,
                                       OUT field text, OUT message text)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_data IS NOT NULL THEN
        IF octet_length(p_data::text) > 1048576 THEN
            field := 'data'; message := 'the record is larger than 1 MiB of JSON';
            RETURN;
        END IF;
        IF jsonb_path_exists(p_data, 'strict $.**{64 to last}') THEN
            field := 'data'; message := 'the record is nested more than 64 levels deep';
            RETURN;
        END IF;
    END IF;
    SELECT f.field, f.message INTO field, message FROM exportd_record_fit_problem(p_tenant, p_dataset, p_key, p_data) f;
END $$;
