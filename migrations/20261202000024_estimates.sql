-- Estimates. `rows_estimate`: the rows a census of the dataset expected when the job was created
-- (records/census.rs; NULL if it could not be taken). `planned_rows`: the rows of the job's shard
-- plan so far, exact under the watermark; once a full export's plan is complete it is the total.
ALTER TABLE export_jobs
    ADD COLUMN rows_estimate bigint,
    ADD COLUMN planned_rows bigint NOT NULL DEFAULT 0;

UPDATE export_jobs j SET planned_rows = p.rows
FROM (SELECT export_id, sum(rows)::bigint AS rows FROM export_shard_plan GROUP BY export_id) p
WHERE p.export_id = j.id AND p.rows IS NOT NULL;
