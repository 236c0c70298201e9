-- Incremental exports: the changes from a start cursor through the window chain up to the tick
-- sealed when the export was created.
ALTER TABLE export_jobs
    ADD COLUMN from_cursor   text,
    -- Where the chain starts: a snapshot, and (when the cursor was inside a window) the last key read.
    ADD COLUMN start_from    text,
    ADD COLUMN start_after   text,
    -- The export ends with the window that reaches this tick (0: no window was sealed yet).
    ADD COLUMN until_tick    bigint,
    ADD CONSTRAINT export_jobs_incremental CHECK ((mode = 'incremental') = (start_from IS NOT NULL));

-- One running incremental export per principal and dataset: each advances the stored cursor.
CREATE UNIQUE INDEX export_jobs_one_incremental ON export_jobs (tenant, principal, dataset)
    WHERE mode = 'incremental' AND state IN ('QUEUED', 'RUNNING', 'CANCEL_REQUESTED');
