-- Who this deployment is: one row, made by the first migration of the database. The artifact
-- store records the id as its owner (`_exportd/owner.json`), so a second deployment pointed at
-- the same directory or bucket prefix refuses to start instead of deleting the first one's files.
-- `link_kid`/`link_secret` hold the key that signs links and seals cursors when no
-- EXPORTD_LINK_KEYS is configured: generated once by the first process that needs it, so links
-- and cursors outlive restarts and verify on every process of the deployment.
CREATE TABLE deployment (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    id          uuid NOT NULL DEFAULT gen_random_uuid(),
    created_at  timestamptz NOT NULL DEFAULT now(),
    link_kid    text,
    link_secret text,
    CHECK ((link_kid IS NULL) = (link_secret IS NULL))
);
INSERT INTO deployment DEFAULT VALUES;
