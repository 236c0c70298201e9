//! Checking an attachment against the host's catalog and the dataset: which table, which key,
//! which tenant, which expression feeds each dataset column — every mistake named with the
//! table or column and what is wrong.

use sqlx::{Executor, PgPool};

use super::{Spec, TenantRule};
use crate::tenants::{ColumnType, DatasetSchema, Registry};

/// An attachment ready to be written as SQL: every name checked, every expression typed.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// `regclass` text of the host table (schema-qualified where the search path needs it).
    pub table: String,
    /// The host table as `schema.table`, quoted: the capture functions run with a fixed
    /// `search_path` and name everything fully.
    pub qualified_table: String,
    /// The schema of exportd's own functions (quoted), which the capture functions call.
    pub exportd_schema: String,
    pub dataset: String,
    /// The key columns (quoted identifiers) and their types, in key order.
    pub key: Vec<(String, String)>,
    /// SQL giving a row's tenant id (NULL: the row belongs to no tenant and is not exported).
    pub tenant_sql: String,
    /// SQL giving a row's record key as text.
    pub key_sql: String,
    /// SQL giving a row's record data (a JSON object).
    pub data_sql: String,
    pub tenants: Vec<String>,
    /// The host's columns (quoted) with the type a row image gives each: its host type where
    /// exportd's database knows it, else `text`. Log capture evaluates the binding's
    /// expressions in exportd's database over `jsonb_to_record(image) AS src(…)`.
    pub image_columns: Vec<(String, String)>,
}

impl Resolved {
    /// The column definition list of a row image: `"id" bigint, "title" text, …`.
    pub fn image_relation(&self) -> String {
        self.image_columns.iter().map(|(name, ty)| format!("{name} {ty}")).collect::<Vec<_>>().join(", ")
    }

    /// The image type of each key column, in key order.
    pub fn key_image_types(&self) -> Vec<&str> {
        self.key
            .iter()
            .map(|(name, _)| self.image_columns.iter().find(|(n, _)| n == name).map_or("text", |(_, ty)| ty.as_str()))
            .collect()
    }
}

/// Where the binding's expressions are evaluated: over the host table itself (trigger capture,
/// in the writer's transaction), or over a row image in exportd's database (log capture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evaluated {
    OnTheTable,
    OverImages,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// A table name `to_regclass` cannot even parse (`invalid_name`), said plainly; other errors as
/// they are.
pub(super) fn unparsable(e: sqlx::Error, table: &str) -> anyhow::Error {
    match e.as_database_error().and_then(|d| d.code()) {
        Some(code) if code == "42602" => {
            refuse(format!("table `{table}`: not a table name (write it as schema.table, quoting as SQL does)"))
        }
        _ => e.into(),
    }
}

fn refuse(text: impl Into<String>) -> anyhow::Error {
    Refusal(text.into()).into()
}

/// `"name"`, quoted as PostgreSQL quotes an identifier.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `'text'`, quoted as a string literal.
pub fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

struct HostColumn {
    name: String,
    ty: String,
    not_null: bool,
}

/// Checks `spec` against the host's catalog (`host`: the host database, which is exportd's own
/// for trigger capture) and the registry's dataset, with the expressions typed where they will
/// be `evaluated`.
pub async fn resolve(
    exportd: &PgPool,
    host: &PgPool,
    registry: &Registry,
    spec: &Spec,
    evaluated: Evaluated,
) -> anyhow::Result<Resolved> {
    let pool = host;
    let found = sqlx::query!("SELECT to_regclass($1)::text AS name, to_regclass($1)::oid::bigint AS oid", spec.table)
        .fetch_one(pool)
        .await
        .map(|r| r.name.zip(r.oid))
        .map_err(|e| unparsable(e, &spec.table))?;
    let (table, oid) = found.ok_or_else(|| refuse(format!("table `{}`: no such table", spec.table)))?;
    let columns = sqlx::query_as!(
        HostColumn,
        r#"SELECT attname::text AS "name!", format_type(atttypid, atttypmod) AS "ty!", attnotnull AS not_null
           FROM pg_attribute WHERE attrelid = $1::bigint::oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum"#,
        oid
    )
    .fetch_all(pool)
    .await?;
    let column = |name: &str| columns.iter().find(|c| c.name == name);

    let key = key_columns(pool, oid, &table, spec, &columns).await?;
    let (tenant_sql, tenants) = tenant_rule(&table, spec, &column)?;
    let schemas = tenants
        .iter()
        .map(|tenant| {
            let t = registry.get(tenant).ok_or_else(|| refuse(format!("tenant `{tenant}`: no such tenant")))?;
            t.dataset(&spec.dataset)
                .cloned()
                .ok_or_else(|| refuse(format!("tenant `{tenant}` has no dataset `{}`", spec.dataset)))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let schema = &schemas[0];
    if let Some((tenant, _)) = tenants.iter().zip(&schemas).find(|(_, s)| s.columns != schema.columns) {
        return Err(refuse(format!(
            "dataset `{}` of tenant `{tenant}` has other columns than `{}`'s: attach one table per dataset shape",
            spec.dataset, tenants[0]
        )));
    }
    for name in spec.columns.keys() {
        if !schema.columns.iter().any(|c| c.name.as_str() == name) {
            return Err(refuse(format!("--column {name}: dataset `{}` has no column `{name}`", spec.dataset)));
        }
    }
    let sources = column_sources(&table, spec, schema, &column)?;
    let image_columns = image_columns(exportd, &columns).await?;
    let types = match evaluated {
        Evaluated::OnTheTable => probe(pool, &table, &format!("{table} AS src"), &sources).await?,
        Evaluated::OverImages => {
            let relation = image_columns.iter().map(|(n, t)| format!("{n} {t}")).collect::<Vec<_>>().join(", ");
            probe(exportd, &table, &format!("{IMAGE_RELATION_NULL} AS src({relation})"), &sources).await?
        }
    };
    let mut pairs = Vec::new();
    for ((name, ty, expression), found) in sources.iter().zip(types) {
        let json = to_json(*ty, expression, &found).ok_or_else(|| {
            refuse(format!(
                "dataset column `{name}` ({}) from `{expression}` of type {found} in `{table}`: cannot map; \
                 give --column {name}=<SQL expression>",
                type_name(*ty)
            ))
        })?;
        pairs.push(format!("{}, {json}", literal(name)));
    }
    let key_sql = match key.as_slice() {
        [(name, _)] => format!("({name})::text"),
        many => {
            format!("jsonb_build_array({})::text", many.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", "))
        }
    };
    let qualified_table: String = sqlx::query_scalar(
        "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = $1::bigint::oid",
    )
    .bind(oid)
    .fetch_one(pool)
    .await?;
    let exportd_schema: String = sqlx::query_scalar(
        "SELECT format('%I', n.nspname) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE p.proname = 'exportd_upsert' ORDER BY n.nspname = current_schema() DESC LIMIT 1",
    )
    .fetch_one(exportd)
    .await?;
    Ok(Resolved {
        table,
        qualified_table,
        exportd_schema,
        dataset: spec.dataset.clone(),
        key,
        tenant_sql,
        key_sql,
        data_sql: format!("jsonb_build_object({})", pairs.join(", ")),
        tenants,
        image_columns,
    })
}

/// A row image relation with no row, for typing expressions (see [`Resolved::image_columns`]).
const IMAGE_RELATION_NULL: &str = "jsonb_to_record(NULL::jsonb)";

/// The column definition list of the host's row images: each host type that exportd's
/// database also knows (built-in types; a host's own enum or domain is read as its text).
async fn image_columns(exportd: &PgPool, columns: &[HostColumn]) -> sqlx::Result<Vec<(String, String)>> {
    let types: Vec<String> = columns.iter().map(|c| c.ty.clone()).collect();
    let known: Vec<bool> = sqlx::query_scalar!(
        r#"SELECT to_regtype(t) IS NOT NULL AS "known!" FROM unnest($1::text[]) WITH ORDINALITY AS u(t, n) ORDER BY n"#,
        &types
    )
    .fetch_all(exportd)
    .await?;
    Ok(columns
        .iter()
        .zip(known)
        .map(|(c, known)| (ident(&c.name), if known { c.ty.clone() } else { "text".to_owned() }))
        .collect())
}

/// The key: the columns given, or the primary key's; NOT NULL and covered by a unique index
/// (the backfill pages by it, and a record key must name one row).
async fn key_columns(
    pool: &PgPool,
    oid: i64,
    table: &str,
    spec: &Spec,
    columns: &[HostColumn],
) -> anyhow::Result<Vec<(String, String)>> {
    let unique: Vec<(Vec<String>, bool)> = sqlx::query!(
        r#"SELECT array_agg(a.attname::text ORDER BY k.n) AS "columns!", i.indisprimary AS primary FROM pg_index i
           CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
           WHERE i.indrelid = $1::bigint::oid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
           GROUP BY i.indexrelid, i.indisprimary ORDER BY i.indisprimary DESC"#,
        oid
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| (r.columns, r.primary))
    .collect();
    let names = if spec.key.is_empty() {
        unique.iter().find(|(_, primary)| *primary).map(|(names, _)| names.clone()).ok_or_else(|| {
            refuse(format!("table `{table}` has no primary key: give --key <column> (a unique, NOT NULL column)"))
        })?
    } else {
        spec.key.clone()
    };
    let mut key = Vec::new();
    for name in &names {
        let column = columns
            .iter()
            .find(|c| &c.name == name)
            .ok_or_else(|| refuse(format!("--key {name}: table `{table}` has no column `{name}`")))?;
        if !column.not_null {
            return Err(refuse(format!("--key {name}: column `{name}` of `{table}` may be NULL; a key may not")));
        }
        key.push((ident(name), column.ty.clone()));
    }
    let mut sorted = names.clone();
    sorted.sort();
    if !unique.iter().any(|(index, _)| {
        let mut index = index.clone();
        index.sort();
        index == sorted
    }) {
        return Err(refuse(format!(
            "--key {}: no unique index of `{table}` has exactly these columns, so a key might name two rows",
            names.join(",")
        )));
    }
    Ok(key)
}

/// How a row finds its tenant: one fixed tenant, or a column whose values map to tenants.
fn tenant_rule<'a>(
    table: &str,
    spec: &Spec,
    column: &impl Fn(&str) -> Option<&'a HostColumn>,
) -> anyhow::Result<(String, Vec<String>)> {
    match &spec.tenant {
        TenantRule::Fixed(tenant) => Ok((literal(tenant), vec![tenant.clone()])),
        TenantRule::Column { column: name, map } => {
            column(name)
                .ok_or_else(|| refuse(format!("--tenant-column {name}: table `{table}` has no column `{name}`")))?;
            if map.is_empty() {
                return Err(refuse(
                    "--tenant-map: map at least one value of the tenant column to a tenant (VALUE=TENANT)",
                ));
            }
            let arms: Vec<String> =
                map.iter().map(|(value, tenant)| format!("WHEN {} THEN {}", literal(value), literal(tenant))).collect();
            let mut tenants: Vec<String> = map.values().cloned().collect();
            tenants.sort();
            tenants.dedup();
            Ok((format!("CASE ({})::text {} END", ident(name), arms.join(" ")), tenants))
        }
    }
}

/// Each dataset column with the SQL that feeds it: the expression given, else the host column
/// of the same name. A required column needs one; an optional one without is left out (null).
fn column_sources<'a>(
    table: &str,
    spec: &Spec,
    schema: &DatasetSchema,
    column: &impl Fn(&str) -> Option<&'a HostColumn>,
) -> anyhow::Result<Vec<(String, ColumnType, String)>> {
    let mut sources = Vec::new();
    for c in &schema.columns {
        let name = c.name.as_str();
        let expression = match (spec.columns.get(name), column(name)) {
            (Some(expression), _) => expression.clone(),
            (None, Some(_)) => ident(name),
            (None, None) if c.required => {
                return Err(refuse(format!(
                    "dataset column `{name}` is required and `{table}` has no column `{name}`: give --column {name}=<SQL expression>"
                )));
            }
            (None, None) => continue,
        };
        sources.push((name.to_owned(), c.ty, expression));
    }
    Ok(sources)
}

/// The PostgreSQL type of each source expression, as the server describes a query of them (an
/// expression that does not compile is refused with the server's message).
async fn probe(
    pool: &PgPool,
    table: &str,
    from: &str,
    sources: &[(String, ColumnType, String)],
) -> anyhow::Result<Vec<String>> {
    if sources.is_empty() {
        return Ok(Vec::new());
    }
    let select: Vec<String> = sources.iter().map(|(_, _, e)| format!("({e})")).collect();
    let sql = format!("SELECT {} FROM {from}", select.join(", "));
    let described = pool.describe(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(sql))).await.map_err(|e| {
        let message = e.as_database_error().map_or_else(|| e.to_string(), |d| d.message().to_owned());
        refuse(format!("--column expressions over `{table}`: {message}"))
    })?;
    Ok(described.columns().iter().map(|c| sqlx::TypeInfo::name(sqlx::Column::type_info(c)).to_lowercase()).collect())
}

/// The JSON the record holds for a value of PostgreSQL type `found` in a column of type `ty`;
/// `None` when the type cannot feed it.
fn to_json(ty: ColumnType, expression: &str, found: &str) -> Option<String> {
    let e = format!("({expression})");
    let is = |names: &[&str]| names.contains(&found);
    let integers = ["int2", "int4", "int8"];
    match ty {
        ColumnType::String if !is(&["json", "jsonb", "bytea"]) => Some(format!("to_jsonb({e}::text)")),
        ColumnType::Integer if is(&integers) => Some(format!("to_jsonb({e})")),
        ColumnType::Number if is(&integers) || is(&["numeric", "float4", "float8"]) => Some(format!("to_jsonb({e})")),
        ColumnType::Boolean if is(&["bool"]) => Some(format!("to_jsonb({e})")),
        ColumnType::Timestamp if is(&["timestamptz", "timestamp", "date"]) => {
            Some(format!("to_jsonb(to_char({e}::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))"))
        }
        ColumnType::Json => Some(format!("to_jsonb({e})")),
        _ => None,
    }
}

fn type_name(ty: ColumnType) -> &'static str {
    match ty {
        ColumnType::String => "string",
        ColumnType::Integer => "integer",
        ColumnType::Number => "number",
        ColumnType::Boolean => "boolean",
        ColumnType::Timestamp => "timestamp",
        ColumnType::Json => "json",
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn host(name: &str, ty: &str) -> HostColumn {
        HostColumn { name: name.to_owned(), ty: ty.to_owned(), not_null: false }
    }

    fn spec(tenant: TenantRule) -> Spec {
        Spec {
            table: "app.tickets".into(),
            dataset: "tickets".into(),
            key: vec![],
            tenant,
            columns: BTreeMap::new(),
            source: None,
        }
    }

    #[test]
    fn names_and_text_are_quoted_as_postgresql_quotes_them() {
        assert_eq!(ident("region"), r#""region""#);
        assert_eq!(ident(r#"we"ird"#), r#""we""ird""#, "a quote inside is doubled");
        assert_eq!(ident("Mixed Case; DROP"), r#""Mixed Case; DROP""#, "nothing escapes the quotes");
        assert_eq!(literal("acme"), "'acme'");
        assert_eq!(literal("o'brien'); --"), "'o''brien''); --'");
    }

    #[test]
    fn a_tenant_column_maps_its_values_and_names_what_is_missing() {
        let columns = [host("org", "text"), host("id", "int8")];
        let column = |name: &str| columns.iter().find(|c| c.name == name);
        let (sql, tenants) = tenant_rule("app.tickets", &spec(TenantRule::Fixed("acme".into())), &column).unwrap();
        assert_eq!((sql.as_str(), tenants), ("'acme'", vec!["acme".to_owned()]));

        let map = BTreeMap::from([("1".to_owned(), "acme".to_owned()), ("2".to_owned(), "acme".to_owned())]);
        let rule = TenantRule::Column { column: "org".into(), map: map.clone() };
        let (sql, tenants) = tenant_rule("app.tickets", &spec(rule), &column).unwrap();
        assert_eq!(sql, r#"CASE ("org")::text WHEN '1' THEN 'acme' WHEN '2' THEN 'acme' END"#);
        assert_eq!(tenants, vec!["acme".to_owned()], "each tenant once");

        let missing = TenantRule::Column { column: "tenant".into(), map };
        let refused = tenant_rule("app.tickets", &spec(missing), &column).unwrap_err().to_string();
        assert!(refused.contains("--tenant-column tenant") && refused.contains("no column `tenant`"), "{refused}");
        let empty = TenantRule::Column { column: "org".into(), map: BTreeMap::new() };
        let refused = tenant_rule("app.tickets", &spec(empty), &column).unwrap_err().to_string();
        assert!(refused.contains("--tenant-map"), "{refused}");
    }

    #[test]
    fn each_dataset_type_takes_only_the_host_types_that_fit_it() {
        assert_eq!(to_json(ColumnType::String, "name", "text").unwrap(), "to_jsonb((name)::text)");
        assert_eq!(to_json(ColumnType::String, "n", "int4").unwrap(), "to_jsonb((n)::text)", "any scalar as text");
        assert_eq!(to_json(ColumnType::String, "doc", "jsonb"), None, "a document is not a string");
        assert_eq!(to_json(ColumnType::Integer, "n", "int8").unwrap(), "to_jsonb((n))");
        assert_eq!(to_json(ColumnType::Integer, "n", "numeric"), None, "a fraction could be lost");
        assert!(
            to_json(ColumnType::Number, "n", "numeric").is_some() && to_json(ColumnType::Number, "n", "int2").is_some()
        );
        assert_eq!(to_json(ColumnType::Boolean, "b", "text"), None);
        let at = to_json(ColumnType::Timestamp, "opened", "date").unwrap();
        assert!(at.contains("AT TIME ZONE 'UTC'") && at.contains(r#""Z""#), "written as UTC RFC 3339: {at}");
        assert_eq!(to_json(ColumnType::Timestamp, "opened", "text"), None);
        assert!(to_json(ColumnType::Json, "doc", "jsonb").is_some());
    }
}
