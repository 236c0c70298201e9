//! The `datasets` table: the tenant files' schemas where the SQL write functions read them.

use anyhow::Context;
use sqlx::PgPool;

use super::Registry;

/// Makes the `datasets` table match the tenant files, so the SQL write functions validate
/// records against the same schemas the HTTP API uses. One transaction: readers never see a
/// half-synced catalogue.
pub async fn sync_catalogue(pool: &PgPool, registry: &Registry) -> anyhow::Result<()> {
    let mut tenants = Vec::new();
    let mut datasets = Vec::new();
    let mut key_columns = Vec::new();
    let mut columns = Vec::new();
    for tenant in registry.tenants() {
        for (name, schema) in &tenant.datasets {
            tenants.push(tenant.id.to_string());
            datasets.push(name.to_string());
            key_columns.push(schema.key_column.to_string());
            columns.push(serde_json::to_value(&schema.columns)?);
        }
    }
    let mut tx = pool.begin().await?;
    sqlx::query!(
        "DELETE FROM datasets d WHERE NOT EXISTS (
             SELECT 1 FROM unnest($1::text[], $2::text[]) AS c(tenant, dataset)
             WHERE c.tenant = d.tenant AND c.dataset = d.dataset)",
        &tenants,
        &datasets,
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
        "INSERT INTO datasets (tenant, dataset, key_column, columns)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[])
         ON CONFLICT ON CONSTRAINT datasets_pkey
         DO UPDATE SET key_column = EXCLUDED.key_column, columns = EXCLUDED.columns",
        &tenants,
        &datasets,
        &key_columns,
        &columns,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await.context("syncing the dataset catalogue")
}
