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

-- name: endpoint_health
-- The endpoints, worst first, %(limit)s of them: disabled by the dispatcher (gone,
-- failing), then the longest failure streak, then the largest backlog. Pending deliveries
-- are counted up to %(cap)s per endpoint (webhook_outbox_endpoint_pending_idx), so a reading
-- costs at most that many index entries per endpoint however large a backlog grows; the
-- window totals cover every endpoint, not only those returned.
SELECT e.id, e.tenant, e.state, e.disabled_reason, e.disabled_at, e.failing_since,
       -- a disabled endpoint's streak ended when it was disabled (nothing is sent to it)
       EXTRACT(EPOCH FROM COALESCE(e.disabled_at, now()) - e.failing_since)::float8
           AS failing_for_s,
       p.pending, p.parked,
       count(*) OVER () AS endpoints_total,
       count(*) FILTER (WHERE e.state = 'disabled') OVER () AS disabled_total,
       count(*) FILTER (WHERE e.state = 'enabled' AND e.failing_since IS NOT NULL) OVER ()
         AS failing_total,
       sum(p.pending) OVER () AS pending_total
FROM webhook_endpoints e
CROSS JOIN LATERAL (
    SELECT count(*) AS pending, count(*) FILTER (WHERE x.hold = 'parked') AS parked
    FROM (
        SELECT o.hold FROM webhook_outbox o
        WHERE o.endpoint_id = e.id AND NOT o.processed
        LIMIT %(cap)s
    ) x
) p
ORDER BY (e.state = 'disabled' AND e.disabled_reason <> 'manual') DESC,
         e.failing_since ASC NULLS LAST, p.pending DESC, (e.state = 'disabled') DESC, e.id
LIMIT %(limit)s;

-- name: endpoint_last_errors
-- The last failure of each of %(ids)s: the attempt before its newest pending retry (among
-- its newest pending rows, through webhook_outbox_endpoint_pending_idx and the delivery
-- id), its newest dead letter (webhook_dead_letter_endpoint_idx), or, for an endpoint the
-- dispatcher disabled, the failure recorded as it did (webhook_outbox_processed_at_idx,
-- the seconds around its disabled_at: its parked deliveries, newer than its retries, hide
-- them from the first), whichever is latest.
SELECT e.id, f.status_code, f.error, f.at
FROM unnest(%(ids)s::text[]) AS e(id)
CROSS JOIN LATERAL (
    SELECT c.status_code, c.error, c.at
    FROM (
        (SELECT prev.status_code, prev.error, prev.processed_at AS at
         FROM (
             SELECT r.delivery_id, r.attempt FROM webhook_outbox r
             WHERE r.endpoint_id = e.id AND NOT r.processed
             ORDER BY r.id DESC
             LIMIT 200
         ) r
         JOIN webhook_outbox prev
           ON prev.delivery_id = r.delivery_id AND prev.attempt = r.attempt - 1
          AND prev.processed AND prev.outcome = 'retry'
         WHERE r.attempt > 1
         ORDER BY prev.processed_at DESC
         LIMIT 1)
        UNION ALL
        (SELECT d.last_status, d.last_error, d.dead_at
         FROM webhook_dead_letter d
         WHERE d.endpoint_id = e.id AND d.state = 'dead'
         ORDER BY d.dead_at DESC, d.id DESC
         LIMIT 1)
        UNION ALL
        -- LATERAL: the endpoint row first, so that its disabled_at bounds are the index
        -- condition. As a join under ORDER BY processed_at DESC LIMIT 1 it was planned as a
        -- backward walk of the whole processed_at index filtered by endpoint, for every
        -- endpoint asked about, disabled or not (1.6 s each at 3.6 million rows).
        (SELECT a.status_code, a.error, a.processed_at
         FROM webhook_endpoints ep
         CROSS JOIN LATERAL (
             SELECT a.status_code, a.error, a.processed_at
             FROM webhook_outbox a
             WHERE a.processed
               AND a.processed_at BETWEEN ep.disabled_at - interval '10 seconds'
                                      AND ep.disabled_at + interval '1 second'
               AND a.endpoint_id = ep.id AND a.outcome IN ('retry', 'dead_letter')
             ORDER BY a.processed_at DESC
             LIMIT 1
         ) a
         WHERE ep.id = e.id AND ep.state = 'disabled' AND ep.disabled_reason <> 'manual')
    ) c
    ORDER BY c.at DESC
    LIMIT 1
) f;
