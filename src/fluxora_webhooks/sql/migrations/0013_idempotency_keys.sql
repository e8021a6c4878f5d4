-- Idempotency keys of POST /api/v1/events: a client that sends `Idempotency-Key` with an
-- event and retries the request (a timeout, a 503 cut off by a failover) gets the first
-- answer again instead of a second event. A key names one request of its tenant for 24
-- hours (deliveries.IDEMPOTENCY_TTL_S); the row is written in the event's transaction, so
-- a key is taken exactly when its event is committed. Not touched by the dispatcher.

CREATE TABLE webhook_idempotency_keys (
    -- '' the default tenant (an admin's request without a tenant).
    tenant       text NOT NULL,
    key          text NOT NULL,
    -- sha256 of the request (tenant, stream, type and payload as canonical JSON), hex: the
    -- same key with another request is refused, not answered with the first one's event.
    request_hash text NOT NULL,
    -- The first answer's body, returned as it was (also once the event row is pruned).
    response     jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);
-- Expired keys are removed a few at a time by the requests that write new ones.
CREATE INDEX webhook_idempotency_keys_created_idx ON webhook_idempotency_keys (created_at);
