-- Dashboard sign-in tickets are single-use: the first sign-in records the ticket's id (shared by
-- every API process), a second is refused. Rows outlive the ticket's minute briefly, then go.
CREATE TABLE dashboard_tickets_spent (
    id uuid NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT dashboard_tickets_spent_pkey PRIMARY KEY (id)
);
CREATE INDEX dashboard_tickets_spent_by_expiry ON dashboard_tickets_spent (expires_at);
