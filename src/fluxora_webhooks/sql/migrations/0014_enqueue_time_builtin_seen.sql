-- 1. An event's enqueued_at is when its INSERT ran, not when its transaction began. An
--    endpoint receives the events enqueued after it was created (SPEC 10): an event written
--    late in a long transaction (a request-long one) that had begun before the endpoint was
--    created was routed past it. A default only: no rewrite, no scan.
ALTER TABLE webhook_outbox ALTER COLUMN enqueued_at SET DEFAULT statement_timestamp();

-- 2. When a dispatcher that configures a built-in endpoint (`default` from WEBHOOK_URL,
--    `operator` from WEBHOOK_OPERATOR_URL) last said so, every HOUSEKEEPING_S. A dispatcher
--    started without the variable removes the endpoint only once none has said so for a
--    while (endpoints.BUILTIN_SEEN_S): a host missing the variable beside hosts that have
--    it no longer removes it under them (the default tenant's events routed meanwhile
--    never reached it). Not read by the claim; no trigger.
CREATE TABLE webhook_builtin_seen (
    endpoint_id text PRIMARY KEY,
    seen_at     timestamptz NOT NULL
);
