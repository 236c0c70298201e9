//! Deterministic synthetic records for demos and benchmarks, loaded with COPY.
//!
//! The same (dataset, rows, start, seed) always produces the same records. Text cells include the
//! awkward cases exports must survive: quotes, commas, newlines, non-ASCII and a share of cells
//! that start with `=`, `+`, `-`, `@` or a tab (formula injection).

use std::time::Instant;

use anyhow::Context;
use serde_json::{Map, Value, json};
use sqlx::PgPool;

use crate::dataset::{ColumnType, DatasetSchema, TenantId};

const COPY_CHUNK_BYTES: usize = 1 << 20;
/// Seeds at least this large are analyzed at once (reads do not depend on it; plans elsewhere may).
const ANALYZE_AFTER_ROWS: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedReport {
    pub rows: u64,
    pub elapsed_ms: u128,
}

/// Writes records `start .. start + rows` of `schema` for `tenant` in one transaction, as new
/// versions (existing keys are updated, exactly as `exportd_upsert` would).
pub async fn seed(
    pool: &PgPool,
    tenant: &TenantId,
    schema: &DatasetSchema,
    start: u64,
    rows: u64,
    seed: u64,
) -> anyhow::Result<SeedReport> {
    let began = Instant::now();
    let mut tx = pool.begin().await?;
    // Runtime SQL (not `query!`): the statements read a temporary table, which the compile-time
    // check cannot see.
    sqlx::query("CREATE TEMP TABLE seed_rows (key text COLLATE \"C\" NOT NULL, data jsonb NOT NULL) ON COMMIT DROP")
        .execute(&mut *tx)
        .await?;
    let mut copy = tx.copy_in_raw("COPY seed_rows (key, data) FROM STDIN").await?;
    let mut buf = String::with_capacity(COPY_CHUNK_BYTES + 4096);
    for i in start..start + rows {
        let key = format!("{}-{i:09}", schema.name);
        let data = Value::Object(synthetic_record(schema, i, seed));
        push_copy_field(&mut buf, &key);
        buf.push('\t');
        push_copy_field(&mut buf, &data.to_string());
        buf.push('\n');
        if buf.len() >= COPY_CHUNK_BYTES {
            copy.send(buf.as_bytes()).await?;
            buf.clear();
        }
    }
    if !buf.is_empty() {
        copy.send(buf.as_bytes()).await?;
    }
    copy.finish().await.context("copying seed rows")?;

    // Same protocol as exportd_write_version, set-based: lock heads, close old versions, add new.
    sqlx::query(
        "WITH locked AS (
             INSERT INTO record_heads AS h (tenant, dataset, key)
             SELECT $1, $2, key FROM seed_rows ORDER BY key
             ON CONFLICT ON CONSTRAINT record_heads_pkey DO UPDATE SET version_id = h.version_id
             RETURNING h.version_id)
         UPDATE record_versions v SET closed_xid = pg_current_xact_id()
         FROM locked WHERE v.id = locked.version_id",
    )
    .bind(tenant.as_str())
    .bind(schema.name.as_str())
    .execute(&mut *tx)
    .await
    .context("locking seeded keys")?;
    sqlx::query(
        "WITH added AS (
             INSERT INTO record_versions (tenant, dataset, key, data)
             SELECT $1, $2, key, data FROM seed_rows ORDER BY key
             RETURNING id, key)
         UPDATE record_heads h SET version_id = added.id
         FROM added WHERE h.tenant = $1 AND h.dataset = $2 AND h.key = added.key",
    )
    .bind(tenant.as_str())
    .bind(schema.name.as_str())
    .execute(&mut *tx)
    .await
    .context("writing seeded versions")?;
    tx.commit().await?;
    // Give the planner statistics for what was just written, as autovacuum would later.
    if rows >= ANALYZE_AFTER_ROWS {
        sqlx::query("ANALYZE record_versions, record_heads").execute(pool).await.context("analyzing seeded tables")?;
    }
    Ok(SeedReport { rows, elapsed_ms: began.elapsed().as_millis() })
}

/// COPY text format: backslash, tab, newline and carriage return are escaped.
fn push_copy_field(buf: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => buf.push_str("\\\\"),
            '\t' => buf.push_str("\\t"),
            '\n' => buf.push_str("\\n"),
            '\r' => buf.push_str("\\r"),
            c => buf.push(c),
        }
    }
}

/// SplitMix64: tiny, fast and deterministic across platforms.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

const WORDS: &[&str] = &[
    "invoice",
    "refund",
    "login",
    "password",
    "shipment",
    "delayed",
    "customer",
    "says",
    "the",
    "order",
    "arrived",
    "broken",
    "please",
    "help",
    "urgent",
    "billing",
    "café",
    "naïve",
    "Zürich",
    "東京",
    "données",
    "“quoted”",
    "size: 10\"",
    "a, b and c",
    "O'Brien",
    "emoji 🚀",
    "tab\there",
];
const FORMULA_STARTS: &[&str] = &["=", "+", "-", "@", "\t", "=HYPERLINK(\"http://x\")", "+1 555", "-2+3", "@SUM(A1)"];
const REGIONS: &[&str] = &["emea", "amer", "apac"];
const STATUSES: &[&str] = &["new", "open", "pending", "solved", "closed"];

pub(crate) fn synthetic_record(schema: &DatasetSchema, index: u64, seed: u64) -> Map<String, Value> {
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ index);
    let mut data = Map::new();
    for column in &schema.columns {
        let name = column.name.as_str();
        // Optional columns are sometimes null, so exports see missing values too.
        if !column.required && rng.below(20) == 0 {
            data.insert(name.to_owned(), Value::Null);
            continue;
        }
        let value = match column.ty {
            ColumnType::String => match name {
                "region" => json!(rng.pick(REGIONS)),
                "status" => json!(rng.pick(STATUSES)),
                "email" => json!(format!("user{}@example.{}", rng.below(100_000), rng.pick(&["com", "org", "de"]))),
                "phone" => json!(format!("+{} {:03} {:04}", 1 + rng.below(98), rng.below(1000), rng.below(10_000))),
                _ => json!(sentence(&mut rng, if name == "body" { 24 } else { 6 })),
            },
            ColumnType::Integer => json!(rng.below(5) as i64 - 1),
            ColumnType::Number => json!((rng.below(2_000_000) as f64 - 500_000.0) / 100.0),
            ColumnType::Boolean => json!(rng.below(2) == 1),
            ColumnType::Timestamp => json!(timestamp(&mut rng)),
            ColumnType::Json => json!([rng.pick(WORDS), rng.below(100)]),
        };
        data.insert(name.to_owned(), value);
    }
    data
}

fn sentence(rng: &mut Rng, max_words: u64) -> String {
    let mut text = String::new();
    if rng.below(10) == 0 {
        text.push_str(rng.pick(FORMULA_STARTS));
    }
    for i in 0..1 + rng.below(max_words) {
        if i > 0 {
            text.push(if rng.below(12) == 0 { '\n' } else { ' ' });
        }
        text.push_str(rng.pick(WORDS));
    }
    text
}

fn timestamp(rng: &mut Rng) -> String {
    let seconds = 1_700_000_000 + rng.below(60_000_000) as i64;
    let at = time::OffsetDateTime::from_unix_timestamp(seconds).expect("in range");
    at.format(&time::format_description::well_known::Rfc3339).expect("formats")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tickets() -> DatasetSchema {
        toml::from_str(include_str!("../../tenants/datasets/tickets.toml")).unwrap()
    }

    #[test]
    fn records_are_deterministic_and_vary_by_index_and_seed() {
        let schema = tickets();
        assert_eq!(synthetic_record(&schema, 7, 1), synthetic_record(&schema, 7, 1));
        assert_ne!(synthetic_record(&schema, 7, 1), synthetic_record(&schema, 8, 1));
        assert_ne!(synthetic_record(&schema, 7, 1), synthetic_record(&schema, 7, 2));
    }

    #[test]
    fn text_includes_formula_starts_and_awkward_characters() {
        let schema = tickets();
        let subjects: Vec<String> =
            (0..2000).filter_map(|i| synthetic_record(&schema, i, 1)["subject"].as_str().map(str::to_owned)).collect();
        for start in ["=", "+", "-", "@", "\t"] {
            assert!(subjects.iter().any(|s| s.starts_with(start)), "no subject starts with {start:?}");
        }
        for needle in ["\"", ",", "\n", "é"] {
            assert!(subjects.iter().any(|s| s.contains(needle)), "no subject contains {needle:?}");
        }
    }

    #[test]
    fn copy_fields_escape_control_characters() {
        let mut buf = String::new();
        push_copy_field(&mut buf, "a\tb\nc\\d\re");
        assert_eq!(buf, "a\\tb\\nc\\\\d\\re");
    }
}
