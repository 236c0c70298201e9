//! The SQL an attachment puts on the host table: a row trigger that writes each change as a
//! record in the writer's transaction, and a TRUNCATE trigger that deletes every record of the
//! rows being truncated.

use super::resolve::{Resolved, literal};

/// The trigger names on the host table (one attachment per table).
pub const ROW_TRIGGER: &str = "exportd_capture";
pub const TRUNCATE_TRIGGER: &str = "exportd_capture_truncate";

/// The functions' names: one pair per attachment.
pub fn function_names(attachment: i64) -> (String, String) {
    (format!("exportd_capture_{attachment}"), format!("exportd_capture_{attachment}_truncate"))
}

/// `CREATE OR REPLACE FUNCTION` statements of both trigger functions.
///
/// The row trigger reads the row's tenant, key and data with the attachment's expressions over
/// `(SELECT OLD.*)` / `(SELECT NEW.*)`, so expressions name the host's columns as they are. An
/// update that changes the key or the tenant deletes the old record before writing the new one;
/// a row whose tenant is NULL (unmapped) is no record. A record that does not fit the dataset is
/// quarantined (`exportd_capture_upsert`): the host's statement succeeds, the record is kept out
/// and said so; only a key the record store cannot hold fails the statement (EXD01).
///
/// Both run with `search_path` fixed to `pg_catalog`, exportd's schema, `pg_temp` (whatever the
/// writer's path) and call exportd's functions by their schema, so nothing earlier on a writer's
/// path can take a write meant for the record store. They live in exportd's schema.
pub fn functions(attachment: i64, r: &Resolved) -> [String; 2] {
    let (row, truncate) = function_names(attachment);
    let exportd = &r.exportd_schema;
    let dataset = literal(&r.dataset);
    let (tenant, key, data) = (&r.tenant_sql, &r.key_sql, &r.data_sql);
    let row_function = format!(
        "CREATE OR REPLACE FUNCTION {exportd}.{row}() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, {exportd}, pg_temp AS $exportd$
#variable_conflict use_column
DECLARE
    exportd_old_tenant text; exportd_old_key text;
    exportd_new_tenant text; exportd_new_key text; exportd_new_data jsonb;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        SELECT {tenant}, {key} INTO exportd_old_tenant, exportd_old_key FROM (SELECT OLD.*) AS src;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        SELECT {tenant}, {key}, {data} INTO exportd_new_tenant, exportd_new_key, exportd_new_data
        FROM (SELECT NEW.*) AS src;
    END IF;
    IF exportd_old_tenant IS NOT NULL AND (exportd_old_tenant IS DISTINCT FROM exportd_new_tenant
                                           OR exportd_old_key IS DISTINCT FROM exportd_new_key) THEN
        PERFORM {exportd}.exportd_capture_delete(exportd_old_tenant, {dataset}, exportd_old_key);
    END IF;
    IF exportd_new_tenant IS NOT NULL THEN
        PERFORM {exportd}.exportd_capture_upsert({attachment}, exportd_new_tenant, {dataset}, exportd_new_key,
                                                  exportd_new_data);
    END IF;
    RETURN NULL;
END $exportd$"
    );
    let table = &r.qualified_table;
    let truncate_function = format!(
        "CREATE OR REPLACE FUNCTION {exportd}.{truncate}() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, {exportd}, pg_temp AS $exportd$
#variable_conflict use_column
DECLARE
    exportd_row record;
BEGIN
    FOR exportd_row IN SELECT {tenant} AS tenant, {key} AS key FROM {table} AS src LOOP
        IF exportd_row.tenant IS NOT NULL THEN
            PERFORM {exportd}.exportd_capture_delete(exportd_row.tenant, {dataset}, exportd_row.key);
        END IF;
    END LOOP;
    RETURN NULL;
END $exportd$"
    );
    [row_function, truncate_function]
}

/// `CREATE TRIGGER` statements (after the functions).
pub fn triggers(attachment: i64, r: &Resolved) -> [String; 2] {
    let (row, truncate) = function_names(attachment);
    let (table, exportd) = (&r.table, &r.exportd_schema);
    [
        format!(
            "CREATE TRIGGER {ROW_TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION {exportd}.{row}()"
        ),
        format!(
            "CREATE TRIGGER {TRUNCATE_TRIGGER} BEFORE TRUNCATE ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {exportd}.{truncate}()"
        ),
    ]
}

/// One backfill batch: up to `$2` rows after key position `$1` (the key columns as text; NULL:
/// from the start), in key order, each with the statement's snapshot, its key position, tenant,
/// record key and data.
pub fn backfill_batch(r: &Resolved) -> String {
    let key_list: Vec<&str> = r.key.iter().map(|(name, _)| name.as_str()).collect();
    let position: Vec<String> = r.key.iter().map(|(name, _)| format!("({name})::text")).collect();
    let after: Vec<String> =
        r.key.iter().enumerate().map(|(i, (_, ty))| format!("($1::text[])[{}]::{ty}", i + 1)).collect();
    format!(
        "SELECT pg_current_snapshot()::text AS snapshot, ARRAY[{position}] AS position,
                {tenant} AS tenant, {key} AS key, {data} AS data
         FROM {table} AS src
         WHERE $1::text[] IS NULL OR ({keys}) > ({after})
         ORDER BY {keys} LIMIT $2",
        position = position.join(", "),
        tenant = r.tenant_sql,
        key = r.key_sql,
        data = r.data_sql,
        table = r.table,
        keys = key_list.join(", "),
        after = after.join(", "),
    )
}
