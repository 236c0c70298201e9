-- Live exportd processes (`serve` and `worker`), renewed by a heartbeat every 2 s and forgotten
-- after 10 s of silence. Each process splits the per-tenant rates (API requests, scan rows)
-- by the number of live processes that enforce them, so the rates hold cluster-wide.
CREATE TABLE cluster_processes (
    id           uuid PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    serves_api   boolean NOT NULL,
    runs_workers boolean NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
