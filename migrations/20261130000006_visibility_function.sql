-- The one definition of "this version is the record as of snapshot s": created by a transaction
-- s sees, and not closed by one s sees. Inlined by the planner (a simple immutable SQL function).
CREATE FUNCTION exportd_live_at(created xid8, closed xid8, s pg_snapshot) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_visible_in_snapshot(created, s) AND (closed IS NULL OR NOT pg_visible_in_snapshot(closed, s))
$$;
