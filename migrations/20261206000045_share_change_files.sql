-- Delta Sharing change files (src/sharing/changes.rs): what a version changed since the version
-- before it, row by row (`_change_type` insert / update_preimage / update_postimage / delete),
-- written from the record history between the two exports' snapshots when the version's export
-- publishes. A version without one (the first, one whose predecessor was cut under another row
-- filter, column policy or schema, or is older than the history kept) answers its changes as
-- whole files removed and added instead. The file lives in the export's directory and goes with
-- its files.
ALTER TABLE share_versions
    ADD COLUMN changes_from   bigint,
    ADD COLUMN changes_object text,
    ADD COLUMN changes_rows   bigint,
    ADD COLUMN changes_bytes  bigint,
    ADD COLUMN changes_sha256 text,
    ADD CONSTRAINT share_versions_changes CHECK (
        (changes_from IS NULL) = (changes_object IS NULL)
        AND (changes_from IS NULL) = (changes_rows IS NULL)
        AND (changes_from IS NULL) = (changes_bytes IS NULL)
        AND (changes_from IS NULL) = (changes_sha256 IS NULL)
        AND (changes_from IS NULL OR changes_from = version - 1));

-- Which exports are table versions: full Parquet exports of every column and row the principal
-- may see (no `columns`, no `filter` in the request). One definition for the publication that
-- numbers versions and the worker that writes their change files.
CREATE FUNCTION exportd_is_table_version(mode text, format text, request jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT mode = 'full' AND format = 'parquet'
       AND request->'columns' IS NULL AND coalesce(request->'filter', '{}') = '{}'
$$;
