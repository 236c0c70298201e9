-- Delivery into partners' buckets: subscriptions (declared in tenant files, mirrored here so
-- triggers and schedulers can read them), the deliveries of published exports to them, and the
-- multipart uploads of every store (exportd's own and the partners') in one registry.

-- A subscription as the tenant file declares it, plus the state of its schedule. `definition`
-- is the sha256 of what shapes its exports (principal, destination, dataset, format): when it
-- changes, the chain of scheduled exports starts again with a full export (`cursor` NULL).
CREATE TABLE subscriptions (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant           text        NOT NULL,
    name             text        NOT NULL,
    principal        text        NOT NULL,
    destination      text        NOT NULL,
    dataset          text        NOT NULL,
    format           text        NOT NULL,
    definition       text        NOT NULL,
    -- Deliver every full export the principal creates of the dataset in the format.
    deliver_full     boolean     NOT NULL,
    -- Every this many seconds an incremental export chained by `cursor` (NULL: none).
    every_seconds    integer,
    active           boolean     NOT NULL DEFAULT true,
    -- Where the chain stands: the next_cursor of the last export of the chain that succeeded.
    cursor           text,
    -- Scheduled exports created so far (their Idempotency-Keys count with it).
    runs             bigint      NOT NULL DEFAULT 0,
    next_run_at      timestamptz NOT NULL DEFAULT now(),
    last_export_id   uuid,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT subscriptions_pkey PRIMARY KEY (id),
    CONSTRAINT subscriptions_name UNIQUE (tenant, name),
    CONSTRAINT subscriptions_every CHECK (every_seconds IS NULL OR every_seconds >= 1)
);

-- The subscription whose schedule created the export: its cursor advances instead of the
-- principal's stored cursor when the export is published.
ALTER TABLE export_jobs ADD COLUMN subscription_id uuid REFERENCES subscriptions (id);

-- One row per export and subscription it goes to. A lease with a fencing generation like export
-- jobs: every checkpoint and outcome is written only under the generation that claimed it.
CREATE TABLE bucket_deliveries (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    tenant           text        NOT NULL,
    principal        text        NOT NULL,
    subscription_id  uuid        NOT NULL REFERENCES subscriptions (id),
    subscription     text        NOT NULL,
    destination      text        NOT NULL,
    export_id        uuid        NOT NULL REFERENCES export_jobs (id),
    dataset          text        NOT NULL,
    mode             text        NOT NULL,
    state            text        NOT NULL DEFAULT 'pending',
    attempts         integer     NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_generation bigint      NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    -- Files of the export copied and verified so far, in manifest order (shards, then the
    -- manifest); the `_SUCCESS` marker follows them.
    files_done       integer     NOT NULL DEFAULT 0,
    bytes_done       bigint      NOT NULL DEFAULT 0,
    -- The export's bytes were counted against the tenant's egress quota (once, whatever retries).
    egress_counted   boolean     NOT NULL DEFAULT false,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- Set by the first attempt (now + EXPORTD_DELIVERY_RETRY_FOR); a retry by hand sets it anew.
    give_up_at       timestamptz,
    last_attempt_at  timestamptz,
    last_error       text,
    delivered_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT bucket_deliveries_pkey PRIMARY KEY (id),
    CONSTRAINT bucket_deliveries_once UNIQUE (subscription_id, export_id),
    CONSTRAINT bucket_deliveries_state CHECK (state IN ('pending', 'delivered', 'failed'))
);
CREATE INDEX bucket_deliveries_open ON bucket_deliveries (subscription_id, seq) WHERE state <> 'delivered';
CREATE INDEX bucket_deliveries_by_tenant ON bucket_deliveries (tenant, seq DESC);

-- A published export goes to every active subscription that wants it, in the transaction that
-- publishes it (whichever process does): a delivery exists exactly when its export was published.
CREATE FUNCTION exportd_route_delivery() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO bucket_deliveries (tenant, principal, subscription_id, subscription, destination, export_id,
                                   dataset, mode)
    SELECT s.tenant, s.principal, s.id, s.name, s.destination, NEW.id, NEW.dataset, NEW.mode
      FROM subscriptions s
     WHERE s.active AND s.tenant = NEW.tenant
       AND (s.id = NEW.subscription_id
            OR (NEW.subscription_id IS NULL AND s.deliver_full AND NEW.mode = 'full'
                AND s.principal = NEW.principal AND s.dataset = NEW.dataset AND s.format = NEW.format))
    ON CONFLICT ON CONSTRAINT bucket_deliveries_once DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER export_jobs_bucket_deliveries AFTER UPDATE OF state ON export_jobs
    FOR EACH ROW WHEN (NEW.state = 'SUCCEEDED' AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION exportd_route_delivery();

-- `delivery.succeeded` and `delivery.failed` webhook events, in the transaction of the outcome.
CREATE FUNCTION exportd_delivery_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_events (tenant, type, principal, dataset, export_id, data)
    VALUES (NEW.tenant, CASE NEW.state WHEN 'delivered' THEN 'delivery.succeeded' ELSE 'delivery.failed' END,
            NEW.principal, NEW.dataset, NEW.export_id, jsonb_strip_nulls(jsonb_build_object(
                'delivery_id', NEW.id,
                'export_id', NEW.export_id,
                'dataset', NEW.dataset,
                'principal', NEW.principal,
                'mode', NEW.mode,
                'subscription', NEW.subscription,
                'destination', NEW.destination,
                'state', NEW.state,
                'attempts', NEW.attempts,
                'files', NEW.files_done,
                'bytes', NEW.bytes_done,
                'error', CASE WHEN NEW.state = 'failed' THEN NEW.last_error END,
                'delivered_at', exportd_utc(NEW.delivered_at))));
    RETURN NULL;
END
$$;

CREATE TRIGGER bucket_deliveries_webhook_events AFTER UPDATE OF state ON bucket_deliveries
    FOR EACH ROW WHEN (NEW.state IN ('delivered', 'failed') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION exportd_delivery_event();

-- Uploads of every store: '' is exportd's own artifact store, `destination:<tenant>/<name>` a
-- partner's bucket. Upload ids are unique only within a store.
ALTER TABLE pending_uploads ADD COLUMN store text NOT NULL DEFAULT '';
ALTER TABLE pending_uploads DROP CONSTRAINT pending_uploads_pkey;
ALTER TABLE pending_uploads ADD CONSTRAINT pending_uploads_pkey PRIMARY KEY (store, upload_id);

-- A delivery's bytes are audited (and counted against egress) like a download's.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action
    CHECK (action IN ('created', 'cancelled', 'revoked', 'downloaded', 'delivered'));
CREATE INDEX bucket_deliveries_due ON bucket_deliveries (next_attempt_at) WHERE state = 'pending';
