-- The output formats are registered in one place, the code's format registry
-- (src/writers/format.rs), which also parses this column when a job is read: a new format no
-- longer needs a migration to widen a CHECK list.
ALTER TABLE export_jobs DROP CONSTRAINT export_jobs_format;
