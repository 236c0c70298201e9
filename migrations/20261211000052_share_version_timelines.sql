-- Delta Sharing table versions across a database failover. A version published after the
-- switch point of an asynchronous failover is lost with the commits it stood on; had the new
-- primary numbered its next version max + 1, a client that read the lost version would take
-- the new one for it and skip changes. So each version records the timeline it was published
-- on, and the first version published on a newer timeline than the table's latest skips ahead
-- (src/sharing/versions.rs): the numbers from `skipped_from` to `version - 1` were, or may have
-- been, handed out by the lost history, and requests naming them are refused.
DO $$
BEGIN
    EXECUTE format('ALTER TABLE share_versions ADD COLUMN timeline int NOT NULL DEFAULT %s',
                   exportd_timeline());
END $$;
ALTER TABLE share_versions
    ALTER COLUMN timeline SET DEFAULT exportd_timeline(),
    ADD COLUMN skipped_from bigint,
    ADD CONSTRAINT share_versions_skipped CHECK (skipped_from >= 0 AND skipped_from < version),
    -- A change file is from the version before, which a skip puts at `skipped_from - 1`.
    DROP CONSTRAINT share_versions_changes,
    ADD CONSTRAINT share_versions_changes CHECK (
        (changes_from IS NULL) = (changes_object IS NULL)
        AND (changes_from IS NULL) = (changes_rows IS NULL)
        AND (changes_from IS NULL) = (changes_bytes IS NULL)
        AND (changes_from IS NULL) = (changes_sha256 IS NULL)
        AND (changes_from IS NULL OR changes_from = coalesce(skipped_from, version) - 1));
