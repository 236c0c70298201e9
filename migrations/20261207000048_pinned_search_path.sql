-- exportd's PL/pgSQL functions run with a fixed search_path: host applications call them from
-- their own sessions (exportd_upsert, exportd_delete, attached tables' capture triggers), and a
-- function or table earlier on a writer's path must never take a call meant for the record
-- store. pg_catalog first, exportd's own schema next, pg_temp last (a temporary table can never
-- shadow one of ours). SQL-language functions are left alone: the planner inlines them into
-- export queries, which a SET clause would prevent, and they name nothing a writer can shadow.
-- A later migration that replaces one of these functions must pin it again (CREATE OR REPLACE
-- resets its settings); tests/it/attach.rs checks that every one is pinned.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'exportd\_%'
           AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp', f, current_schema());
    END LOOP;
END $$;
