//! Host row images and what they become: the binding's expressions evaluated over images in
//! exportd's database (`jsonb_to_record(image) AS src(<host columns>)`), the images kept per
//! record key, and the ordered writes of a batch (`exportd_capture_apply`).

use std::collections::HashMap;

use serde_json::{Value, json};
use sqlx::{PgConnection, Row};

use super::super::resolve::Resolved;

/// A host row: every column by name, as JSON (text values as strings, json/jsonb parsed).
pub type Image = serde_json::Map<String, Value>;

/// What a row image makes: the record's tenant (None: no tenant, no record), key and data.
#[derive(Debug, Clone)]
pub struct Evaluated {
    pub tenant: Option<String>,
    pub key: String,
    pub data: Value,
}

/// The image of a key as kept, with the copy batch that read it (None: written from the log).
#[derive(Debug, Clone)]
pub struct Kept {
    pub tenant: Option<String>,
    pub image: Image,
    pub copied: Option<(i32, i32)>,
}

/// `FROM` over a JSON array of images in `$1`, in order (`exportd_n`), each as the relation
/// `src` the binding's expressions name columns of. The aliases are ones no host column takes.
fn over_images(resolved: &Resolved) -> String {
    format!(
        "FROM jsonb_array_elements($1::jsonb) WITH ORDINALITY AS exportd_batch(exportd_image, exportd_n)
         CROSS JOIN LATERAL jsonb_to_record(exportd_image) AS src({})",
        resolved.image_relation()
    )
}

/// A row's record key, and the batch of the current copy round whose key range holds it (None
/// before the copy has reached it).
#[derive(Debug, Clone)]
pub struct Placed {
    pub key: String,
    pub batch: Option<i32>,
}

/// The record key of each image (in order), with the copy batch of `round` whose key range
/// (after its lower bound, up to its last row; the last batch up to the end) holds the row
/// (`round` None: no batch is looked up).
pub async fn keys(
    conn: &mut PgConnection,
    resolved: &Resolved,
    attachment: i64,
    round: Option<i32>,
    images: &[&Image],
) -> anyhow::Result<Vec<Placed>> {
    if images.is_empty() {
        return Ok(Vec::new());
    }
    let types = resolved.key_image_types();
    let row: Vec<&str> = resolved.key.iter().map(|(name, _)| name.as_str()).collect();
    let bound = |column: &str| -> String {
        let cast: Vec<String> =
            types.iter().enumerate().map(|(i, ty)| format!("(b.{column}[{}])::{ty}", i + 1)).collect();
        format!("({})", cast.join(", "))
    };
    let row = format!("({})", row.join(", "));
    // The batch is looked up only for a round (`$3` NULL: none).
    let sql = format!(
        "SELECT ({key})::text AS key,
                CASE WHEN $3::int IS NOT NULL THEN
                    (SELECT b.batch FROM attachment_copy_batches b
                      WHERE b.attachment = $2 AND b.round = $3
                        AND (b.after IS NULL OR {row} > {after}) AND (b.last IS NULL OR {row} <= {last})
                      ORDER BY b.batch LIMIT 1) END AS batch
         {from} ORDER BY exportd_n",
        key = resolved.key_sql,
        after = bound("after"),
        last = bound("last"),
        from = over_images(resolved),
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(json!(images))
        .bind(attachment)
        .bind(round)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| {
            let key: Option<String> = r.try_get("key")?;
            let key = key.ok_or_else(|| anyhow::anyhow!("a host row whose key is NULL"))?;
            Ok(Placed { key, batch: r.try_get("batch")? })
        })
        .collect()
}

/// Tenant, key and data of each image (in order).
pub async fn evaluate(conn: &mut PgConnection, resolved: &Resolved, images: &[&Image]) -> sqlx::Result<Vec<Evaluated>> {
    if images.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT ({})::text AS tenant, ({})::text AS key, {} AS data {} ORDER BY exportd_n",
        resolved.tenant_sql,
        resolved.key_sql,
        resolved.data_sql,
        over_images(resolved)
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(json!(images)).fetch_all(&mut *conn).await?;
    rows.iter()
        .map(|r| Ok(Evaluated { tenant: r.try_get("tenant")?, key: r.try_get("key")?, data: r.try_get("data")? }))
        .collect()
}

/// The kept images of `keys`.
pub async fn kept(conn: &mut PgConnection, attachment: i64, keys: &[String]) -> sqlx::Result<HashMap<String, Kept>> {
    let rows = sqlx::query!(
        r#"SELECT key, tenant, image AS "image: sqlx::types::Json<Image>", copy_round, copy_batch
           FROM attachment_rows WHERE attachment = $1 AND key = ANY ($2)"#,
        attachment,
        keys
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let copied = r.copy_round.zip(r.copy_batch);
            (r.key, Kept { tenant: r.tenant, image: r.image.0, copied })
        })
        .collect())
}

/// One ordered write of a batch (see `exportd_capture_apply`).
#[derive(Debug, Clone)]
pub enum Op {
    /// The row as it now is, replacing the record it was (`old`: tenant and key) when that was
    /// another.
    Put {
        row: Evaluated,
        image: Image,
        old: Option<(Option<String>, String)>,
        copied: Option<(i32, i32)>,
        lsn: Option<String>,
    },
    /// The row is gone.
    Remove { tenant: Option<String>, key: String },
    /// Every row but those copied in these batches of `round` is gone.
    KeepOnly { round: i32, batches: Vec<i32> },
}

impl Op {
    fn to_json(&self) -> Value {
        match self {
            Op::Put { row, image, old, copied, lsn } => json!({
                "op": "put", "tenant": row.tenant, "key": row.key, "data": row.data, "image": image,
                "old_tenant": old.as_ref().and_then(|(t, _)| t.clone()), "old_key": old.as_ref().map(|(_, k)| k),
                "copy_round": copied.map(|c| c.0), "copy_batch": copied.map(|c| c.1), "lsn": lsn,
            }),
            Op::Remove { tenant, key } => json!({"op": "remove", "tenant": tenant, "key": key}),
            Op::KeepOnly { round, batches } => json!({"op": "keep_only", "round": round, "batches": batches}),
        }
    }
}

/// Applies `ops` in order; returns the record versions written.
pub async fn apply(conn: &mut PgConnection, attachment: i64, dataset: &str, ops: &[Op]) -> sqlx::Result<i64> {
    if ops.is_empty() {
        return Ok(0);
    }
    let ops: Vec<Value> = ops.iter().map(Op::to_json).collect();
    let written = sqlx::query_scalar!(
        r#"SELECT exportd_capture_apply($1, $2, $3) AS "written!""#,
        attachment,
        dataset,
        Value::Array(ops)
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(i64::from(written))
}

/// Announces, per tenant, the rows this transaction quarantined (`attachment.quarantined`: how
/// many, and up to ten keys with field and reason — never a value).
pub async fn announce_quarantined(conn: &mut PgConnection, attachment: i64, dataset: &str) -> sqlx::Result<u64> {
    let raised = sqlx::query!(
        r#"INSERT INTO webhook_events (tenant, type, dataset, data)
           SELECT q.tenant, 'attachment.quarantined', $2::text, jsonb_build_object(
                      'dataset', $2::text,
                      'quarantined', (SELECT count(*) FROM attachment_quarantine a WHERE a.attachment = $1 AND a.tenant = q.tenant),
                      'new', count(*),
                      'rows', jsonb_path_query_array(
                          jsonb_agg(jsonb_build_object('key', q.key, 'field', q.field, 'reason', q.reason) ORDER BY q.key),
                          '$[0 to 9]'))
           FROM attachment_quarantine q WHERE q.attachment = $1 AND q.at = now()
           GROUP BY q.tenant"#,
        attachment,
        dataset
    )
    .execute(&mut *conn)
    .await?;
    Ok(raised.rows_affected())
}
