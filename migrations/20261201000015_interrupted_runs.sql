-- A run given back because the database or the object store was unavailable (after its
-- in-place retries) is not the job's fault: its next claim verifies the checkpoints as after
-- any error, but is not counted towards attempts-exhausted. An outage delays an export; it
-- does not fail it.
ALTER TABLE export_jobs ADD COLUMN interrupted boolean NOT NULL DEFAULT false;
