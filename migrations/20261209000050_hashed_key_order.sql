-- A partner whose column policy hashes the key column receives rows ordered and cut by the
-- hashed key it sees, never by the real key's order (which would let it undo the hash from row
-- positions alone). The hash is the one the partner receives: HMAC-SHA256 of the key under the
-- partner's own key, its first 16 bytes. HMAC(k, m) = H((k ^ opad) || H((k ^ ipad) || m)), so
-- exportd passes the two padded keys (`inner`, `outer`) and PostgreSQL needs no extension. A
-- SQL-language function without settings, so the planner inlines it; it names only pg_catalog.
CREATE FUNCTION exportd_keyed_hash(key text, inner_pad bytea, outer_pad bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT pg_catalog.substring(
        pg_catalog.sha256(outer_pad OPERATOR(pg_catalog.||)
            pg_catalog.sha256(inner_pad OPERATOR(pg_catalog.||) pg_catalog.convert_to(key, 'UTF8'))),
        1, 16)
$$;

-- Exports cut in that order (their shard positions are hashed keys). Jobs created before this
-- migration keep the key order they were planned in.
ALTER TABLE export_jobs ADD COLUMN hashed_key_order boolean NOT NULL DEFAULT false;
