-- Many endpoints (SPEC 10-14): tenants, the endpoint registry, fan-out, parking, per-key
-- ordering, leases for slow requests, and the producer's trace context (SPEC 18).
--
-- The producer's INSERT stays the contract: `INSERT INTO webhook_outbox (stream_id,
-- event_type, payload)` still works, and `tenant` defaults to the default tenant ''. A row
-- the producer writes is an *event row* (endpoint_id NULL). The dispatcher that claims it
-- routes it, in the claim transaction: one delivery row per matching endpoint of its
-- tenant (its own delivery id), and the event row itself becomes the delivery of the
-- built-in endpoint `default` (so enqueue's delivery id stays the default endpoint's).

CREATE TABLE webhook_endpoints (
    id              text PRIMARY KEY,
    tenant          text NOT NULL DEFAULT '',
    url             text NOT NULL,
    -- '*' (every type), exact names, or prefixes ending in '*' such as 'stream.*'.
    event_types     text[] NOT NULL DEFAULT '{*}',
    -- NULL for the built-in endpoints, whose secret comes from the environment only.
    secret          text,
    -- During a rotation: the replaced secret, still signing until previous_until.
    secret_previous text,
    previous_until  timestamptz,
    description     text NOT NULL DEFAULT '',
    headers         jsonb NOT NULL DEFAULT '{}',
    -- Retries per second to this URL (NULL: WEBHOOK_RETRY_RPS).
    rate_limit      integer CHECK (rate_limit >= 1),
    ordered         boolean NOT NULL DEFAULT false,
    state           text NOT NULL DEFAULT 'enabled' CHECK (state IN ('enabled', 'disabled')),
    disabled_reason text CHECK (disabled_reason IN ('manual', 'gone', 'failing')),
    disabled_at     timestamptz,
    -- The first failed attempt of the current streak (NULL: the last attempt succeeded).
    failing_since   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((state = 'enabled') = (disabled_reason IS NULL))
);
-- Routing looks endpoints up by tenant; lists page through a tenant's endpoints.
CREATE INDEX webhook_endpoints_tenant_idx ON webhook_endpoints (tenant, id);

-- Every change reaches the running dispatchers at once (their cache reloads that endpoint);
-- the table stays the truth.
CREATE FUNCTION webhook_endpoints_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('webhook_endpoints', COALESCE(NEW.id, OLD.id));
    RETURN NULL;
END;
$$;
CREATE TRIGGER webhook_endpoints_notify_trg
    AFTER INSERT OR UPDATE OR DELETE ON webhook_endpoints
    FOR EACH ROW EXECUTE FUNCTION webhook_endpoints_notify();

ALTER TABLE webhook_outbox
    ADD COLUMN tenant      text NOT NULL DEFAULT '',
    -- NULL: an event row not yet routed. Otherwise the endpoint this row is a delivery to.
    ADD COLUMN endpoint_id text,
    -- The event row a delivery was routed from (NULL on the event row itself).
    ADD COLUMN event_id    bigint,
    -- An ordered endpoint's delivery: its place in its stream (the event's id).
    ADD COLUMN stream_seq  bigint,
    -- Why a pending row is not due: 'parked' (its endpoint is disabled) or 'waiting' (an
    -- ordered stream's later event, behind its head). Such rows are due at 'infinity'.
    ADD COLUMN hold        text CHECK (hold IN ('parked', 'waiting')),
    -- A request that outlived its batch: the row is due again when the lease ends (its
    -- dispatcher died), and only the lease's holder may record its outcome.
    ADD COLUMN lease       uuid,
    -- The producer's W3C trace context (filled by enqueue with the OpenTelemetry extra).
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;

-- Rows written before endpoints existed: pending retries and replays were the one
-- consumer's, which is the built-in endpoint now (first attempts are routed as events).
UPDATE webhook_outbox SET endpoint_id = 'default'
WHERE NOT processed AND (attempt > 1 OR replay);

ALTER TABLE webhook_outbox DROP CONSTRAINT webhook_outbox_outcome_check;
-- 'routed': an event row fanned out with no default endpoint to deliver it itself;
-- 'unrouted': an event no endpoint subscribed to (kept, visible, counted).
ALTER TABLE webhook_outbox ADD CONSTRAINT webhook_outbox_outcome_check
    CHECK (outcome IN ('delivered', 'retry', 'dead_letter', 'routed', 'unrouted')) NOT VALID;
ALTER TABLE webhook_outbox VALIDATE CONSTRAINT webhook_outbox_outcome_check;

-- An endpoint's pending deliveries: parking, unparking, removal, per-endpoint backlog.
CREATE INDEX webhook_outbox_endpoint_pending_idx ON webhook_outbox (endpoint_id, id)
    WHERE NOT processed;
-- An ordered endpoint's streams: the head and the next waiting delivery of each.
CREATE INDEX webhook_outbox_stream_idx ON webhook_outbox (endpoint_id, stream_id, stream_seq)
    WHERE NOT processed AND stream_seq IS NOT NULL;
-- Events still to be routed, by stream: an ordered stream's next delivery waits for them.
CREATE INDEX webhook_outbox_unrouted_idx ON webhook_outbox (tenant, stream_id, id)
    WHERE NOT processed AND endpoint_id IS NULL;
-- The history of one event (its deliveries) and of one stream.
CREATE INDEX webhook_outbox_event_idx ON webhook_outbox (event_id) WHERE event_id IS NOT NULL;

ALTER TABLE webhook_dead_letter
    ADD COLUMN tenant      text NOT NULL DEFAULT '',
    ADD COLUMN endpoint_id text,
    ADD COLUMN event_id    bigint,
    ADD COLUMN stream_seq  bigint,
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;
UPDATE webhook_dead_letter SET endpoint_id = 'default';
-- Recovery: an endpoint's dead letters within a window.
CREATE INDEX webhook_dead_letter_endpoint_idx ON webhook_dead_letter (endpoint_id, dead_at, id)
    WHERE state = 'dead';
