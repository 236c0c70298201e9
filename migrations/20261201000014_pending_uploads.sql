-- Multipart uploads to object storage that have started but not completed. The writer registers
-- an upload before its first part and removes it on completion or abort; the cleaner aborts the
-- ones left by writers that died (not touched for an hour), so no part is stored forever.
CREATE TABLE pending_uploads (
    upload_id  text PRIMARY KEY,
    object_path text NOT NULL, -- the full path in the bucket (prefix included)
    started_at timestamptz NOT NULL DEFAULT now(),
    touched_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX pending_uploads_touched ON pending_uploads (touched_at);
