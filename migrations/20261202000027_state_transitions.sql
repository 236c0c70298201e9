-- The export state machine, enforced by the database too: a statement that would move a job
-- along a transition the machine does not have fails (SQLSTATE EXD02) instead of corrupting
-- it, whichever module or host application issued it. The same table is `ExportState::may_become`
-- (exports/state.rs); a test checks that both agree on every pair of states.
CREATE FUNCTION exportd_export_transition_allowed(from_state text, to_state text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT from_state = to_state OR (from_state, to_state) IN (
        ('QUEUED', 'RUNNING'), ('QUEUED', 'CANCEL_REQUESTED'),
        ('RUNNING', 'SUCCEEDED'), ('RUNNING', 'FAILED'), ('RUNNING', 'CANCEL_REQUESTED'),
        ('CANCEL_REQUESTED', 'CANCELLED'),
        ('SUCCEEDED', 'EXPIRED'), ('SUCCEEDED', 'REVOKED'))
$$;

CREATE FUNCTION exportd_check_export_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT exportd_export_transition_allowed(OLD.state, NEW.state) THEN
        RAISE EXCEPTION USING ERRCODE = 'EXD02',
            MESSAGE = format('export %s cannot go from %s to %s', OLD.id, OLD.state, NEW.state);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER export_jobs_transitions BEFORE UPDATE OF state ON export_jobs
    FOR EACH ROW EXECUTE FUNCTION exportd_check_export_transition();
