-- Incremental feeds. A ticker records pg_current_snapshot() about every second; a window is the
-- set of record changes whose writing transaction is visible in the window's end snapshot and
-- not in its start snapshot, so every committed change lands in exactly one window whatever
-- order transactions commit in.

CREATE TABLE feed_ticks (
    id         bigint      GENERATED ALWAYS AS IDENTITY,
    snapshot   pg_snapshot NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT feed_ticks_pkey PRIMARY KEY (id)
);

-- Windows are cut once and then fixed, so a cursor replayed later reads the same changes. Each
-- starts at a snapshot (a tick, an export's watermark, or "now") and ends at a sealed tick.
CREATE TABLE feed_windows (
    id            bigint      GENERATED ALWAYS AS IDENTITY,
    tenant        text        NOT NULL,
    dataset       text        NOT NULL,
    from_snapshot text        NOT NULL,
    to_tick       bigint      NOT NULL,
    keys          bigint      NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT feed_windows_pkey PRIMARY KEY (id),
    CONSTRAINT feed_windows_start UNIQUE (tenant, dataset, from_snapshot),
    CONSTRAINT feed_windows_to_tick FOREIGN KEY (to_tick) REFERENCES feed_ticks (id)
);

-- The keys changed in a window, in byte order: pages are keyset reads of this list.
CREATE TABLE feed_window_keys (
    window_id bigint NOT NULL,
    key       text   COLLATE "C" NOT NULL,
    CONSTRAINT feed_window_keys_pkey PRIMARY KEY (window_id, key),
    CONSTRAINT feed_window_keys_window FOREIGN KEY (window_id) REFERENCES feed_windows (id) ON DELETE CASCADE
);

-- Whether snapshot b sees every transaction snapshot a sees (b was taken after a, on the primary).
CREATE FUNCTION exportd_snapshot_dominates(b pg_snapshot, a pg_snapshot) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT pg_snapshot_xmax(b) >= pg_snapshot_xmax(a)
       AND NOT EXISTS (SELECT 1 FROM pg_snapshot_xip(b) AS x WHERE pg_visible_in_snapshot(x, a))
$$;

-- The principal's stored cursor per dataset, advanced with each SUCCEEDED incremental export.
CREATE TABLE feed_cursors (
    tenant     text        NOT NULL,
    principal  text        NOT NULL,
    dataset    text        NOT NULL,
    cursor     text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT feed_cursors_pkey PRIMARY KEY (tenant, principal, dataset)
);
