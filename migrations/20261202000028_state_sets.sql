-- The sets of export states that statements ask about, spelled once, next to the transition
-- table (migration state_transitions.sql). `ExportState::is_terminal` and `was_published`
-- (exports/state.rs) are the same sets; a test checks both agree for every state. Plain SQL
-- expressions, so PostgreSQL inlines them and a partial index on `state IN (…)` still applies.

-- Not terminal: a worker has or will have work on it; it holds its watermark.
CREATE FUNCTION exportd_export_unfinished(state text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT state IN ('QUEUED', 'RUNNING', 'CANCEL_REQUESTED')
$$;

-- Ran to publication (its files may be gone since).
CREATE FUNCTION exportd_export_published(state text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT state IN ('SUCCEEDED', 'EXPIRED', 'REVOKED')
$$;

-- Terminal without files to keep: what the cleaner deletes files of.
CREATE FUNCTION exportd_export_ended_without_files(state text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT state IN ('CANCELLED', 'FAILED', 'EXPIRED', 'REVOKED')
$$;

-- A planned shard nobody is writing: never finished, and its writer (if any) gave it back or
-- vanished (its lease ran out). Helpers and lease holders take only such rows.
CREATE FUNCTION exportd_shard_free(done boolean, writer_expires_at timestamptz) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT NOT done AND (writer_expires_at IS NULL OR writer_expires_at < now())
$$;
