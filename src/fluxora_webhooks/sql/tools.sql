-- Named queries of the integration tools (`send`, `tail`) and of the per-endpoint health
-- that `status` and the service's metrics read. Loaded by queries.py.

-- name: sent_event
-- The event row enqueue() just wrote, by its delivery id (webhook_outbox_delivery_idx), in
-- the same transaction.
SELECT id, partition_at
FROM webhook_outbox
WHERE delivery_id = %(delivery_id)s::uuid AND endpoint_id IS NULL;

-- name: event_routing
-- Whether a dispatcher has routed the event: its row names the default endpoint or is
-- processed (routed / unrouted) in the transaction that wrote its delivery rows.
SELECT endpoint_id, processed, outcome, delivery_id::text
FROM webhook_outbox
WHERE id = %(id)s AND partition_at = %(partition_at)s;

-- name: event_deliveries
-- The deliveries the routing wrote for the event (webhook_outbox_event_idx): one first
-- attempt per endpoint (the default endpoint's retries name the event too: left out).
SELECT DISTINCT ON (endpoint_id) endpoint_id, delivery_id::text
FROM webhook_outbox
WHERE event_id = %(id)s AND attempt = 1 AND NOT replay
ORDER BY endpoint_id, id;

-- name: tail_now
SELECT now();

-- name: tail_attempts
-- Attempts recorded after (%(after)s, %(after_id)s), oldest first, of one tenant and/or one
-- endpoint when given (webhook_outbox_processed_at_idx: only the recent range is read).
SELECT id, processed_at, delivery_id::text, tenant, endpoint_id, event_type, stream_id,
       attempt, outcome, status_code, duration_ms, error
FROM webhook_outbox
WHERE processed AND processed_at >= %(after)s
  AND (processed_at, id) > (%(after)s, %(after_id)s)
  AND outcome IN ('delivered', 'retry', 'dead_letter')
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND (%(endpoint)s::text IS NULL OR endpoint_id = %(endpoint)s)
ORDER BY processed_at, id
LIMIT %(limit)s;
