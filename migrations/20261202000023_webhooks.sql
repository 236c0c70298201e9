-- Webhooks: a transactional outbox of events, their deliveries to the tenant's endpoints, and
-- where each partner's feed stands (for `feed.lagging`).

-- One row per event. Export events are written by the trigger below in the very transaction
-- that moves an export into an ending state — whichever statement, module or process made the
-- transition — so an event exists exactly when its transition was committed.
CREATE TABLE webhook_events (
    id            uuid        NOT NULL DEFAULT gen_random_uuid(),
    seq           bigint      GENERATED ALWAYS AS IDENTITY,
    tenant        text        NOT NULL,
    type          text        NOT NULL,
    principal     text,
    dataset       text,
    export_id     uuid,
    data          jsonb       NOT NULL,
    occurred_at   timestamptz NOT NULL DEFAULT now(),
    -- Set once the event's deliveries were created for the endpoints subscribed to it.
    routed_at     timestamptz,
    CONSTRAINT webhook_events_pkey PRIMARY KEY (id)
);
CREATE INDEX webhook_events_unrouted ON webhook_events (seq) WHERE routed_at IS NULL;
CREATE INDEX webhook_events_by_time ON webhook_events (occurred_at);

-- One row per event and endpoint. The body is fixed when the delivery is created, so every
-- attempt sends the same bytes under the same webhook-id (the event id).
CREATE TABLE webhook_deliveries (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    event_id         uuid        NOT NULL,
    tenant           text        NOT NULL,
    endpoint         text        NOT NULL,
    body             text        NOT NULL,
    state            text        NOT NULL DEFAULT 'pending',
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    give_up_at       timestamptz NOT NULL,
    -- The lease of the process making the current attempt; `attempts` fences its result.
    lease_owner      text,
    lease_expires_at timestamptz,
    last_attempt_at  timestamptz,
    last_status      integer,
    last_error       text,
    delivered_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (id),
    CONSTRAINT webhook_deliveries_once UNIQUE (event_id, endpoint),
    CONSTRAINT webhook_deliveries_event FOREIGN KEY (event_id) REFERENCES webhook_events (id) ON DELETE CASCADE,
    CONSTRAINT webhook_deliveries_state CHECK (state IN ('pending', 'delivered', 'failed'))
);
-- Each endpoint's oldest pending delivery goes first; listings page newest first per tenant.
CREATE INDEX webhook_deliveries_pending ON webhook_deliveries (tenant, endpoint, seq) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_by_tenant ON webhook_deliveries (tenant, seq DESC);

CREATE FUNCTION exportd_utc(at timestamptz) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
$$;

CREATE FUNCTION exportd_export_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    kind text := CASE NEW.state
        WHEN 'SUCCEEDED' THEN 'export.succeeded'
        WHEN 'FAILED'    THEN 'export.failed'
        WHEN 'CANCELLED' THEN 'export.cancelled'
        WHEN 'EXPIRED'   THEN 'export.expired'
        WHEN 'REVOKED'   THEN 'export.revoked'
    END;
BEGIN
    IF kind IS NOT NULL THEN
        INSERT INTO webhook_events (tenant, type, principal, dataset, export_id, data)
        VALUES (NEW.tenant, kind, NEW.principal, NEW.dataset, NEW.id, jsonb_strip_nulls(jsonb_build_object(
            'export_id', NEW.id,
            'dataset', NEW.dataset,
            'principal', NEW.principal,
            'mode', NEW.mode,
            'format', NEW.format,
            'state', NEW.state,
            'created_at', exportd_utc(NEW.created_at),
            'finished_at', exportd_utc(coalesce(NEW.finished_at, now())),
            'total_rows', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.rows_done END,
            'total_bytes', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.bytes_done END,
            'shards', CASE WHEN NEW.manifest IS NOT NULL THEN NEW.shards_done END,
            'file_sha256', NEW.file_sha256,
            'manifest_sha256', NEW.manifest_sha256,
            'error_code', CASE WHEN NEW.state = 'FAILED' THEN NEW.error_code END)));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER export_jobs_webhook_events AFTER UPDATE OF state ON export_jobs
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION exportd_export_event();

-- Where each partner's feed stands: the position of the cursor it last presented to
-- `GET …/changes` (everything committed before it was delivered) and when. `lagging_since` is
-- set when a `feed.lagging` event was raised, and cleared once the partner catches up, so a
-- lagging partner raises one event per episode.
CREATE TABLE feed_positions (
    tenant        text        NOT NULL,
    principal     text        NOT NULL,
    dataset       text        NOT NULL,
    position_at   timestamptz NOT NULL,
    last_read_at  timestamptz NOT NULL,
    lagging_since timestamptz,
    CONSTRAINT feed_positions_pkey PRIMARY KEY (tenant, principal, dataset)
);
