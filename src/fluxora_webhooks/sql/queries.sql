-- Named queries, loaded once by queries.py. A block starts with "-- name: <name>".
-- Parameters use psycopg's %(name)s style.

-- name: claim_due
-- The design document's claim. Served by webhook_outbox_due_idx. Parked and waiting rows
-- are due at 'infinity', so the claim never sees them.
SELECT id, delivery_id::text AS delivery_id, event_type, payload::text AS body, attempt,
       replay, floor(EXTRACT(EPOCH FROM now()))::bigint AS signed_at, tenant, stream_id,
       endpoint_id, event_id, stream_seq, traceparent, tracestate, partition_at, created_at,
       -- use: claim_routable
FROM webhook_outbox
WHERE processed = false
  AND created_at <= now()
ORDER BY created_at ASC, id ASC
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED;

-- name: claim_routable
-- A fragment of the claims: whether an event row's tenant has an endpoint of its own in
-- the registry as the claim sees it (NULL for a delivery row). Where none has, the batch
-- has nothing to route the row to and leaves the routing out of its completion statement;
-- an endpoint created before the claim is seen here whether or not the dispatcher's cache
-- knows it yet.
CASE WHEN endpoint_id IS NULL THEN EXISTS (
    SELECT 1 FROM webhook_endpoints e
    WHERE e.tenant = webhook_outbox.tenant AND e.id NOT IN ('default', 'operator'))
END AS routable

-- name: claim_due_partitioned
-- The same claim on a partitioned outbox, looking only at the partitions that can hold a
-- pending row: those from %(since)s on, the oldest write time of any unprocessed row as the
-- dispatcher last read it (partitions.pending_since, kept at least one partition interval
-- back). A row written earlier than that (a producer's transaction older than a partition)
-- is seen at the next reading, never missed: the reading looks at every partition.
SELECT id, delivery_id::text AS delivery_id, event_type, payload::text AS body, attempt,
       replay, floor(EXTRACT(EPOCH FROM now()))::bigint AS signed_at, tenant, stream_id,
       endpoint_id, event_id, stream_seq, traceparent, tracestate, partition_at, created_at,
       -- use: claim_routable
FROM webhook_outbox
WHERE processed = false
  AND created_at <= now()
  AND partition_at >= %(since)s
ORDER BY created_at ASC, id ASC
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED;

-- name: next_due_in_ms
-- How long until the earliest row due LATER is due (NULL when there is none). Rows due now
-- are either claimed by this loop, locked by another one (which completes them), or arrive
-- with a NOTIFY; counting them would make an idle loop spin while others work. (And no
-- GREATEST(0, ...): it skips NULLs, turning "nothing pending" into "due now".)
SELECT (EXTRACT(EPOCH FROM (min(created_at) - clock_timestamp())) * 1000)::bigint
FROM webhook_outbox
WHERE processed = false AND created_at > now() AND created_at < 'infinity';

-- name: next_due_in_ms_partitioned
-- next_due_in_ms on a partitioned outbox, in the partitions the claim looks at.
SELECT (EXTRACT(EPOCH FROM (min(created_at) - clock_timestamp())) * 1000)::bigint
FROM webhook_outbox
WHERE processed = false AND created_at > now() AND created_at < 'infinity'
  AND partition_at >= %(since)s;

-- name: fan_out_insert
-- A fragment, in route_events and complete_batch (a "use" line names it there): one
-- delivery row per endpoint of the event's tenant (from "ev") that subscribes to its type
-- and existed when it was enqueued. Parked while the endpoint is disabled; an ordered
-- endpoint's delivery waits for its stream's head unless it is the head at once
-- ("d.head": fan_out_head, or fan_out_head_idle when route_events swaps it in). The
-- delivery id is derived from the event's and the endpoint's, so an event routed again
-- after its batch rolled back (its requests may have gone out) gets the same ids.
INSERT INTO webhook_outbox
    (tenant, stream_id, event_type, payload, enqueued_at, endpoint_id, event_id,
     stream_seq, hold, created_at, traceparent, tracestate, delivery_id)
SELECT ev.tenant, ev.stream_id, ev.event_type, ev.payload, ev.enqueued_at, e.id, ev.id,
       CASE WHEN e.ordered THEN ev.id END,
       CASE WHEN e.state <> 'enabled' THEN 'parked'
            WHEN e.ordered AND NOT d.head THEN 'waiting' END,
       CASE WHEN e.state <> 'enabled' OR (e.ordered AND NOT d.head)
            THEN 'infinity'::timestamptz ELSE now() END,
       ev.traceparent, ev.tracestate,
       md5(ev.delivery_id::text || chr(31) || e.id)::uuid
FROM ev
JOIN webhook_endpoints e ON e.tenant = ev.tenant
CROSS JOIN LATERAL (
    -- use: fan_out_head
) d
WHERE e.id NOT IN ('default', 'operator')
  AND e.created_at <= ev.enqueued_at
  AND EXISTS (
      SELECT 1 FROM unnest(e.event_types) AS p(pattern)
      WHERE p.pattern = '*' OR p.pattern = ev.event_type
         OR (right(p.pattern, 1) = '*' AND starts_with(ev.event_type, left(p.pattern, -1))))

-- name: fan_out_head
-- A fragment of fan_out_insert: no delivery is its stream's head at once (the planner
-- folds the constant away).
SELECT false AS head

-- name: fan_out_head_idle
-- fan_out_head as route_events runs it when the batch holds some ordered streams' locks
-- (outbox.route_events swaps it in): an ordered endpoint's delivery is its stream's head
-- at once when the stream is idle: its lock is held by this transaction (the locked
-- pairs, from try_lock_streams), none of its deliveries is pending, and no earlier event
-- of it is still to be routed (this batch's own included: only the first of a stream's
-- events in a batch can be due). It is due now and sent by this batch, with no row version
-- of its own for the wait. In a fragment of its own: its lookups cost every routing
-- statement's start-up. CASE: they run only for a locked stream of an enabled ordered
-- endpoint.
SELECT CASE
    WHEN e.ordered AND e.state = 'enabled' AND EXISTS (
        SELECT 1
        FROM unnest(%(locked_endpoints)s::text[], %(locked_streams)s::text[]) AS l(e, s)
        WHERE l.e = e.id AND l.s = ev.stream_id)
    THEN NOT EXISTS (
            SELECT 1 FROM webhook_outbox w
            WHERE w.endpoint_id = e.id AND w.stream_id = ev.stream_id
              AND NOT w.processed AND w.stream_seq IS NOT NULL)
         AND NOT EXISTS (
            SELECT 1 FROM webhook_outbox u
            WHERE u.endpoint_id IS NULL AND NOT u.processed AND u.tenant = ev.tenant
              AND u.stream_id = ev.stream_id AND u.id < ev.id)
    ELSE false END AS head

-- name: complete_batch
-- Every outcome of one batch in one statement: route its event rows, mark attempts
-- processed, hold rows (deferred, parked, leased), insert retries (same delivery id, next
-- attempt) and dead letters (and tell the operator), and end or start endpoints' failure
-- streaks. Times are clock_timestamp(), not now(): now() is the start of the claim
-- transaction, before the HTTP attempts, and a delay (Retry-After above all) counts from
-- their end. A row recorded after its batch (its request outlived it, under a lease) is
-- written only while it still holds that lease and is pending. %(part_lo)s and %(part_hi)s
-- bound the rows' partition_at: a partitioned outbox plans only their partitions.
-- Each part below is a fragment with an empty form (complete_<part>_none, the same
-- columns and no row): outbox.complete_statement swaps that in for every part the batch
-- has nothing for. Each data-modifying part opens its table and all its indexes at
-- executor start-up whether or not it gets a row (the outbox has twelve); the empty form
-- opens nothing: a batch of deliveries only costs the database a quarter to a third less.
-- The last column lifts the session's lock and statement timeouts for the rest of the
-- transaction (set_config local, at no round trip of its own): its requests have been
-- sent, and a COMMIT that gave up on a lock (the outbox's NOTIFY lock, held by a commit
-- waiting for a synchronous standby) would roll back and send them all again.
WITH r AS (
    SELECT *
    FROM unnest(
        %(ids)s::bigint[], %(outcomes)s::text[], %(delays)s::bigint[], %(codes)s::int[],
        %(errors)s::text[], %(bodies)s::text[], %(durations)s::float8[], %(reasons)s::text[],
        %(endpoints)s::text[], %(leases)s::uuid[], %(parts)s::timestamptz[]
    ) AS t(id, outcome, delay_ms, status_code, error, response_body, duration_ms, reason,
           endpoint_id, lease, partition_at)
),
-- use: complete_routing
-- use: complete_done
-- use: complete_held
-- use: complete_retried
-- use: complete_dead
-- Any success ends an endpoint's failure streak; a failure with no streak starts one.
-- use: complete_streak_ended
-- use: complete_streak_started
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM held),
       (SELECT count(*) FROM retried), (SELECT count(*) FROM dead),
       (SELECT count(*) FROM routed),
       ARRAY(SELECT endpoint_id FROM ordered_pairs ORDER BY 1, stream_id),
       ARRAY(SELECT stream_id FROM ordered_pairs ORDER BY endpoint_id, 1),
       (SELECT count(*) FROM told) + (SELECT count(*) FROM streak_ended)
       + (SELECT count(*) FROM streak_started),
       set_config('lock_timeout', '0', true) || set_config('statement_timeout', '0', true),
       (SELECT count(*) FROM done WHERE recorded = 'unrouted');

-- name: complete_routing
-- complete_batch's routing (ev, routed, ordered_pairs).
-- Fan-out (fan_out_insert) of the event rows route_events did not route: those of tenants
-- with no endpoint known to the dispatcher, and a batch's recorded again after its
-- transaction rolled back (with the same delivery ids).
ev AS (
    SELECT o.id, o.tenant, o.stream_id, o.event_type, o.payload, o.enqueued_at, o.traceparent,
           o.tracestate, o.delivery_id
    FROM r JOIN webhook_outbox o ON o.id = r.id AND o.partition_at = r.partition_at
    WHERE r.id = ANY(%(route)s::bigint[]) AND o.endpoint_id IS NULL
      AND o.partition_at BETWEEN %(part_lo)s AND %(part_hi)s
),
routed AS (
    -- use: fan_out_insert
    RETURNING event_id
),
-- Every ordered endpoint of a routed event's tenant: its stream's head is chosen next
-- (promote_heads), also where this event reached no ordered endpoint.
ordered_pairs AS (
    SELECT DISTINCT e.id AS endpoint_id, ev.stream_id
    FROM ev JOIN webhook_endpoints e ON e.tenant = ev.tenant AND e.ordered
),

-- name: complete_routing_none
-- No event row to route.
routed AS (SELECT NULL::bigint AS event_id WHERE false),
ordered_pairs AS (SELECT NULL::text AS endpoint_id, NULL::text AS stream_id WHERE false),

-- name: complete_done
-- complete_batch's attempts and routed event rows, marked processed.
done AS (
    UPDATE webhook_outbox o
    SET processed = true, processed_at = clock_timestamp(),
        outcome = CASE
            WHEN r.outcome <> 'routed' THEN r.outcome
            WHEN o.id = ANY(%(prerouted)s::bigint[]) THEN 'routed'
            WHEN EXISTS (SELECT 1 FROM routed x WHERE x.event_id = o.id) THEN 'routed'
            ELSE 'unrouted' END,
        endpoint_id = COALESCE(o.endpoint_id, r.endpoint_id),
        status_code = r.status_code, error = r.error, response_body = r.response_body,
        duration_ms = r.duration_ms, lease = NULL
    FROM r
    -- "processed IS FALSE", not "NOT processed" (the column is NOT NULL: the same rows):
    -- with the latter the planner could match the partial indexes over pending rows and
    -- read all of them (webhook_outbox_endpoint_pending_idx) to find the batch's, on every
    -- batch, as long as the backlog; so the rows are found by their key, one probe each.
    WHERE o.id = r.id AND o.partition_at = r.partition_at
      AND o.partition_at BETWEEN %(part_lo)s AND %(part_hi)s
      AND r.outcome IN ('delivered', 'retry', 'dead_letter', 'routed')
      AND o.processed IS FALSE AND (r.lease IS NULL OR o.lease = r.lease)
    RETURNING o.id, r.outcome AS wanted, o.outcome AS recorded, r.delay_ms, r.reason,
              r.status_code, r.error, r.response_body, o.tenant, o.stream_id, o.event_type,
              o.payload, o.delivery_id, o.attempt, o.enqueued_at, o.replay, o.endpoint_id,
              o.event_id, o.stream_seq, o.traceparent, o.tracestate, r.duration_ms
),

-- name: complete_done_none
-- No row to mark processed (nor, then, a retry or a dead letter).
done AS (SELECT NULL::bigint AS id, NULL::text AS recorded WHERE false),

-- name: complete_held
-- complete_batch's deferred, parked and leased rows.
held AS (
    UPDATE webhook_outbox o
    SET created_at = CASE
            WHEN r.outcome = 'parked' THEN 'infinity'::timestamptz
            ELSE clock_timestamp() + r.delay_ms * interval '1 millisecond' END,
        hold = CASE WHEN r.outcome = 'parked' THEN 'parked' ELSE o.hold END,
        deferrals = o.deferrals + (r.outcome = 'deferred')::int,
        -- What a deferred row says while it waits (an egress proxy's outage), none for a
        -- passing deferral, a parked row (its endpoint's state says why) or a leased one
        -- (in flight): a pending row's error is never an attempt's.
        error = CASE WHEN r.outcome = 'deferred' THEN r.error END,
        lease = CASE WHEN r.outcome = 'leased' THEN r.lease END,
        endpoint_id = COALESCE(o.endpoint_id, r.endpoint_id)
    FROM r
    WHERE o.id = r.id AND o.partition_at = r.partition_at
      AND o.partition_at BETWEEN %(part_lo)s AND %(part_hi)s
      AND r.outcome IN ('deferred', 'parked', 'leased') AND o.processed IS FALSE
      AND (r.outcome = 'leased' OR r.lease IS NULL OR o.lease = r.lease)
    RETURNING o.id
),

-- name: complete_held_none
-- No row held.
held AS (SELECT NULL::bigint AS id WHERE false),

-- name: complete_retried
-- complete_batch's retries.
retried AS (
    INSERT INTO webhook_outbox
        (tenant, stream_id, event_type, payload, created_at, delivery_id, attempt, enqueued_at,
         replay, endpoint_id, event_id, stream_seq, hold, traceparent, tracestate)
    SELECT d.tenant, d.stream_id, d.event_type, d.payload,
           CASE WHEN ep.state = 'disabled' THEN 'infinity'::timestamptz
                ELSE clock_timestamp() + d.delay_ms * interval '1 millisecond' END,
           d.delivery_id, d.attempt + 1, d.enqueued_at, d.replay, d.endpoint_id,
           COALESCE(d.event_id, d.id), d.stream_seq,
           CASE WHEN ep.state = 'disabled' THEN 'parked' END, d.traceparent, d.tracestate
    FROM done d LEFT JOIN webhook_endpoints ep ON ep.id = d.endpoint_id
    WHERE d.wanted = 'retry'
    RETURNING id
),

-- name: complete_retried_none
-- No retry.
retried AS (SELECT NULL::bigint AS id WHERE false),

-- name: complete_dead
-- complete_batch's dead letters, and what the operator is told of them.
dead AS (
    INSERT INTO webhook_dead_letter
        (delivery_id, stream_id, event_type, payload, attempts, reason, last_status,
         last_error, last_response, enqueued_at, dead_at, tenant, endpoint_id, event_id,
         stream_seq, traceparent, tracestate)
    -- A dead letter made with no request (its endpoint removed, or its row unusable:
    -- no duration) counts the attempts made, not the one that was not.
    SELECT d.delivery_id, d.stream_id, d.event_type, d.payload,
           d.attempt - (d.duration_ms IS NULL)::int, d.reason,
           d.status_code, d.error, d.response_body, d.enqueued_at, clock_timestamp(),
           d.tenant, d.endpoint_id, COALESCE(d.event_id, d.id), d.stream_seq, d.traceparent,
           d.tracestate
    FROM done d
    WHERE d.wanted = 'dead_letter'
    RETURNING delivery_id, tenant, endpoint_id, event_type, attempts, reason, stream_id,
              last_status, dead_at
),
-- The operator hears of every dead letter but its own endpoint's (SPEC 12).
told AS (
    INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)
    SELECT '!operator', x.delivery_id::text, 'delivery.dead_lettered',
           jsonb_build_object('endpoint_id', x.endpoint_id, 'tenant', x.tenant,
                              'reason', x.reason, 'delivery_id', x.delivery_id,
                              'event_type', x.event_type, 'attempts', x.attempts,
                              'stream_id', x.stream_id, 'last_status', x.last_status,
                              'dead_at', x.dead_at),
           'operator'
    FROM dead x
    WHERE x.endpoint_id IS DISTINCT FROM 'operator'
      AND EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = 'operator')
    RETURNING 1
),

-- name: complete_dead_none
-- No dead letter.
dead AS (SELECT NULL::uuid AS delivery_id WHERE false),
told AS (SELECT 1 WHERE false),

-- name: complete_streak_ended
-- complete_batch's failure streaks ended by a success. An endpoint row another transaction
-- holds (an operator's edit left open) is skipped, not waited for: the wait would end in
-- the session's lock timeout, rolling back a batch whose requests went out (sent again);
-- its streak ends with its next success.
streak_ended AS (
    UPDATE webhook_endpoints SET failing_since = NULL
    WHERE id IN (SELECT id FROM webhook_endpoints
                 WHERE id = ANY(%(succeeded)s::text[]) AND failing_since IS NOT NULL
                 FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING id
),

-- name: complete_streak_ended_none
-- No success.
streak_ended AS (SELECT NULL::text AS id WHERE false),

-- name: complete_streak_started
-- complete_batch's failure streaks started by a failure (a held row skipped, as above: its
-- streak starts with its next failure).
streak_started AS (
    UPDATE webhook_endpoints SET failing_since = clock_timestamp()
    WHERE id IN (SELECT id FROM webhook_endpoints
                 WHERE id = ANY(%(failed)s::text[]) AND failing_since IS NULL
                 FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING id
)

-- name: complete_streak_started_none
-- No failure.
streak_started AS (SELECT NULL::text AS id WHERE false)

-- name: route_events
-- Fan-out of a batch's event rows, before its requests (fan_out_insert, as complete_batch
-- routes the others). Up to %(cap)s of the rows due now are returned in the claim's
-- columns and sent in the same batch (routed ones, then ordered streams' heads); the rest
-- are claimed like any other once it commits.
-- Each row of the answer also carries the events that reached an endpoint, the ordered
-- (endpoint, stream) pairs whose next head the batch chooses after its completion (also
-- where this event reached no ordered endpoint), and the fresh pairs, which need no such
-- choice (see "fresh").
WITH ev AS (
    -- id = ANY: one probe of the key per event whatever the planner's statistics say (a
    -- join with the unnested ids was planned as a scan of the outbox right after a bulk
    -- insert); ids are unique, the partition_at bounds are for a partitioned outbox.
    SELECT o.id, o.tenant, o.stream_id, o.event_type, o.payload, o.enqueued_at, o.traceparent,
           o.tracestate, o.delivery_id
    FROM webhook_outbox o
    WHERE o.id = ANY(%(ids)s::bigint[]) AND o.endpoint_id IS NULL AND NOT o.processed
      AND o.partition_at BETWEEN %(part_lo)s AND %(part_hi)s
),
routed AS (
    -- use: fan_out_insert
    RETURNING id, delivery_id, event_type, payload, attempt, replay, tenant, stream_id,
              endpoint_id, event_id, stream_seq, traceparent, tracestate, partition_at,
              created_at, hold
),
-- Pairs whose delivery was made due as it was routed (the stream idle, its lock held
-- since before this statement) and that got no waiting delivery here: nothing of the
-- stream can be waiting when the batch ends but what this batch inserts (another
-- transaction that routes into it meanwhile finds the lock taken, and chooses its head
-- after its own commit), so whatever becomes of that delivery, there is no next head to
-- choose.
fresh AS (
    SELECT DISTINCT r.endpoint_id, r.stream_id
    FROM routed r
    WHERE r.stream_seq IS NOT NULL AND r.hold IS NULL
      AND NOT EXISTS (
          SELECT 1 FROM routed w
          WHERE w.endpoint_id = r.endpoint_id AND w.stream_id = r.stream_id
            AND w.hold IS NOT NULL)
),
ordered_pairs AS (
    SELECT DISTINCT e.id AS endpoint_id, ev.stream_id
    FROM ev JOIN webhook_endpoints e ON e.tenant = ev.tenant AND e.ordered
    EXCEPT
    SELECT endpoint_id, stream_id FROM fresh
),
sendable AS (
    SELECT * FROM routed WHERE hold IS NULL ORDER BY id LIMIT %(cap)s
),
-- The room the routed rows leave is taken by ordered streams' heads due now, oldest
-- first, claimed as the claim would (SKIP LOCKED; the batch's own claimed rows are
-- excluded, its locks do not skip them): an ordered endpoint's routed deliveries wait, so
-- without them an ordered stream's delivery would cost a transaction of its own. Served
-- by webhook_outbox_heads_due_idx, which holds only heads active now; LIMIT 0 (no ordered
-- endpoint known to the dispatcher, or no room) reads none of it.
heads AS (
    SELECT h.id, h.delivery_id, h.event_type, h.payload, h.attempt, h.replay, h.tenant,
           h.stream_id, h.endpoint_id, h.event_id, h.stream_seq, h.traceparent, h.tracestate,
           h.partition_at, h.created_at, h.hold
    FROM webhook_outbox h
    WHERE NOT h.processed AND h.stream_seq IS NOT NULL AND h.hold IS NULL
      AND h.created_at <= now() AND h.partition_at >= %(since)s
      AND h.id <> ALL(%(claimed)s::bigint[])
    ORDER BY h.created_at, h.id
    LIMIT GREATEST(0, LEAST(%(heads)s, %(cap)s - (SELECT count(*) FROM sendable)))
    FOR UPDATE SKIP LOCKED
)
SELECT x.id, x.delivery_id::text, x.event_type, x.payload::text, x.attempt, x.replay,
       floor(EXTRACT(EPOCH FROM now()))::bigint, x.tenant, x.stream_id, x.endpoint_id,
       x.event_id, x.stream_seq, x.traceparent, x.tracestate, x.partition_at, x.created_at,
       ARRAY(SELECT DISTINCT event_id FROM routed),
       ARRAY(SELECT endpoint_id FROM ordered_pairs ORDER BY 1, stream_id),
       ARRAY(SELECT stream_id FROM ordered_pairs ORDER BY endpoint_id, 1),
       ARRAY(SELECT endpoint_id FROM fresh ORDER BY 1, stream_id),
       ARRAY(SELECT stream_id FROM fresh ORDER BY endpoint_id, 1)
FROM (SELECT 1) one
LEFT JOIN LATERAL (
    SELECT * FROM sendable UNION ALL SELECT * FROM heads
) x ON true;

-- name: try_lock_streams
-- The ordered streams a routing batch may make a delivery due in as it routes it
-- (fan_out_insert): those whose lock it gets now. It never waits for one (migration 0011
-- says why); a stream it did not get has its delivery wait, as before. The same keys as
-- webhook_promote_heads.
SELECT p.e, p.s
FROM unnest(%(endpoints)s::text[], %(streams)s::text[]) AS p(e, s)
WHERE pg_try_advisory_xact_lock(hashtextextended(p.e || chr(31) || p.s, 1718973816));

-- name: try_promote_heads
-- promote_heads inside a dispatcher's transaction: without waiting for a stream's lock
-- (migration 0011). Rows with promoted set are deliveries that became due; rows with
-- busy_endpoint and busy_stream set, streams whose lock another transaction holds, whose
-- heads the dispatcher chooses after its commit (promote_heads).
SELECT promoted, busy_endpoint, busy_stream
FROM webhook_try_promote_heads(%(endpoints)s::text[], %(streams)s::text[]);

-- name: promote_heads
-- For each (endpoint, stream) that has none, its next head (the function in migration
-- 0010): under a per-pair advisory lock taken in key order, then read under a snapshot
-- taken after the lock was granted, so that a routing transaction and a completion of the
-- same stream never both decide (or both miss) it. One statement: the lock and the choice
-- went in two, a pipeline on every batch to an ordered endpoint. Returns the ids of the
-- deliveries that became due. The choice lives in the migration: change it with a new one
-- (CREATE OR REPLACE FUNCTION), never by editing 0010.
SELECT id FROM webhook_promote_heads(%(endpoints)s::text[], %(streams)s::text[]) AS h(id);

-- name: sweep_lock
-- One dispatcher at a time sweeps ("fluxora-webhooks sweep"): stuck ordered streams, and
-- deliveries parked on an endpoint enabled meanwhile.
SELECT pg_try_advisory_lock(7382390104629133160);

-- name: sweep_unlock
SELECT pg_advisory_unlock(7382390104629133160);

-- name: stuck_streams
-- Ordered streams whose head is waiting with no delivery active: their next head was never
-- chosen (a failure after an outcome was recorded). promote_heads chooses it. The streams
-- are walked one index probe each (a skip scan of webhook_outbox_stream_idx), so the cost
-- is the number of streams with a backlog, not the backlog's depth. A page: the streams
-- after (%(after_endpoint)s, %(after_stream)s) in key order ('', '' for the first).
WITH RECURSIVE streams(endpoint_id, stream_id) AS (
    (SELECT w.endpoint_id, w.stream_id
     FROM webhook_outbox w
     WHERE NOT w.processed AND w.stream_seq IS NOT NULL
       AND (w.endpoint_id, w.stream_id) > (%(after_endpoint)s::text, %(after_stream)s::text)
     ORDER BY w.endpoint_id, w.stream_id
     LIMIT 1)
    UNION ALL
    SELECT n.endpoint_id, n.stream_id
    FROM streams s
    CROSS JOIN LATERAL (
        SELECT w.endpoint_id, w.stream_id
        FROM webhook_outbox w
        WHERE NOT w.processed AND w.stream_seq IS NOT NULL
          AND (w.endpoint_id, w.stream_id) > (s.endpoint_id, s.stream_id)
        ORDER BY w.endpoint_id, w.stream_id
        LIMIT 1
    ) n
)
SELECT s.endpoint_id, s.stream_id
FROM streams s
CROSS JOIN LATERAL (
    SELECT w.hold
    FROM webhook_outbox w
    WHERE w.endpoint_id = s.endpoint_id AND w.stream_id = s.stream_id AND NOT w.processed
      AND w.stream_seq IS NOT NULL
    ORDER BY w.stream_seq, w.id
    LIMIT 1
) head
WHERE head.hold = 'waiting'
  AND NOT EXISTS (
      SELECT 1 FROM webhook_outbox a
      WHERE a.endpoint_id = s.endpoint_id AND a.stream_id = s.stream_id AND NOT a.processed
        AND a.stream_seq IS NOT NULL AND a.hold IS NULL)
LIMIT %(page)s;

-- name: relock_claimed
-- complete_batch runs without a savepoint; when it fails, its transaction rolls back and
-- the dispatcher locks again the rows of that batch that are still its to record (not
-- processed meanwhile, not claimed by another loop) and records them one by one.
SELECT o.id
FROM unnest(%(ids)s::bigint[], %(parts)s::timestamptz[]) AS c(id, partition_at)
JOIN webhook_outbox o ON o.id = c.id AND o.partition_at = c.partition_at
WHERE o.processed = false
FOR UPDATE OF o SKIP LOCKED;

-- name: bring_forward
-- Rows of an endpoint deferred before any request to it had ended (each expected to last
-- until its timeout, as a hanging endpoint's does), due now once one was answered: the
-- endpoint answers, only slowly. Those still deferred, unprocessed and not held by a
-- batch right now (SKIP LOCKED: a batch that has one records its own outcome).
WITH x AS (
    SELECT o.id, o.partition_at
    FROM unnest(%(ids)s::bigint[], %(parts)s::timestamptz[]) AS c(id, partition_at)
    JOIN webhook_outbox o ON o.id = c.id AND o.partition_at = c.partition_at
    WHERE o.processed = false AND o.hold IS NULL AND o.lease IS NULL
      AND o.created_at > clock_timestamp()
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE webhook_outbox o SET created_at = clock_timestamp()
FROM x
WHERE o.id = x.id AND o.partition_at = x.partition_at;

-- name: enqueue
INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, traceparent, tracestate)
VALUES (%(tenant)s, %(stream_id)s, %(event_type)s, %(payload)s, %(traceparent)s, %(tracestate)s)
RETURNING delivery_id::text;

-- name: dlq_list
-- %(endpoint_id)s / %(tenant)s filter when not NULL.
SELECT id, delivery_id::text, stream_id, event_type, attempts, reason, last_status,
       last_error, enqueued_at, dead_at, state, tenant, endpoint_id
FROM webhook_dead_letter
WHERE (%(all)s OR state = 'dead')
  AND (%(endpoint_id)s::text IS NULL OR endpoint_id = %(endpoint_id)s)
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
ORDER BY dead_at DESC, id DESC
LIMIT %(limit)s;

-- name: dlq_show
SELECT id, delivery_id::text, stream_id, event_type, payload::text AS payload, attempts,
       reason, last_status, last_error, last_response, enqueued_at, dead_at, state,
       state_changed_at, tenant, endpoint_id, event_id
FROM webhook_dead_letter
WHERE delivery_id::text = %(key)s OR id::text = %(key)s
ORDER BY dead_at DESC, id DESC;

-- name: dlq_replay
-- Back into the outbox, due now, same delivery id and endpoint, attempts counted afresh;
-- parked while its endpoint is disabled, waiting for its stream's head when ordered. A
-- dead letter with no endpoint is the default endpoint's (written before endpoints
-- existed, or by plain SQL) when it is the default tenant's; another tenant's is an event
-- whose fan-out the database rejected, and goes back as that event, to be routed again
-- (under the same delivery ids). One of an endpoint removed since stays where it is.
-- An endpoint's replays are due one after another at its retry rate, as the gate will
-- admit them (see recover_dead_letters).
WITH picked AS (
    UPDATE webhook_dead_letter d
    SET state = 'replayed', state_changed_at = now()
    WHERE d.state = 'dead'
      AND (%(all)s OR d.delivery_id::text = ANY(%(keys)s) OR d.id::text = ANY(%(keys)s))
      AND (COALESCE(d.endpoint_id, 'default') IN ('default', 'operator')
           OR EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = d.endpoint_id))
    RETURNING d.*,
              CASE WHEN d.endpoint_id IS NULL AND d.tenant NOT IN ('', '!operator') THEN NULL
                   ELSE COALESCE(d.endpoint_id, 'default') END AS target
),
queued AS (
    INSERT INTO webhook_outbox
        (tenant, stream_id, event_type, payload, delivery_id, enqueued_at, replay,
         endpoint_id, event_id, stream_seq, hold, created_at, traceparent, tracestate)
    SELECT p.tenant, p.stream_id, p.event_type, p.payload, p.delivery_id, p.enqueued_at, true,
           p.target, CASE WHEN p.target IS NOT NULL THEN p.event_id END,
           CASE WHEN e.ordered THEN p.stream_seq END,
           CASE WHEN e.state = 'disabled' THEN 'parked'
                WHEN e.ordered AND p.stream_seq IS NOT NULL THEN 'waiting' END,
           CASE WHEN e.state = 'disabled' OR (e.ordered AND p.stream_seq IS NOT NULL)
                THEN 'infinity'::timestamptz
                WHEN p.target IS NULL THEN now()  -- an event, routed again: no one URL
                ELSE now() + (row_number() OVER (PARTITION BY p.target ORDER BY p.dead_at, p.id)
                              - 1) * interval '1 second' / COALESCE(e.rate_limit, %(rps)s) END,
           p.traceparent, p.tracestate
    FROM picked p LEFT JOIN webhook_endpoints e ON e.id = p.target
    RETURNING 1
)
SELECT p.delivery_id::text, p.id::text, p.target, p.stream_id,
       (COALESCE(e.ordered, false) AND p.stream_seq IS NOT NULL) AS ordered,
       COALESCE(e.state = 'disabled', false) AS parked
FROM picked p LEFT JOIN webhook_endpoints e ON e.id = p.target;

-- name: dlq_orphaned
-- Waiting dead letters (of these keys, or all) whose endpoint was removed since: dlq_replay
-- leaves them where they are, and the command line says why. Returns each one's delivery
-- id, row id and endpoint id.
SELECT delivery_id::text, id::text, endpoint_id
FROM webhook_dead_letter d
WHERE d.state = 'dead' AND d.endpoint_id IS NOT NULL
  AND d.endpoint_id NOT IN ('default', 'operator')
  AND (%(all)s OR d.delivery_id::text = ANY(%(keys)s) OR d.id::text = ANY(%(keys)s))
  AND NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = d.endpoint_id)
ORDER BY d.id;

-- name: dlq_purge
UPDATE webhook_dead_letter
SET state = 'purged', state_changed_at = now()
WHERE state = 'dead' AND (%(all)s OR delivery_id::text = ANY(%(keys)s) OR id::text = ANY(%(keys)s))
RETURNING delivery_id::text, id::text;

-- name: backlog
-- The backlog as the service's gauges and `status` read it. Every part is served by a
-- partial index (webhook_outbox_due_idx, webhook_dead_letter_dead_idx), and the counts
-- stop at the cap so a huge backlog costs a bounded scan; above the cap,
-- pending_estimate (the planner statistics of the partial index) says how large it is.
SELECT
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_outbox WHERE NOT processed LIMIT %(cap)s
    ) p) AS pending,
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_outbox WHERE NOT processed AND created_at <= now() LIMIT %(cap)s
    ) d) AS due,
    (SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8
     FROM webhook_outbox WHERE NOT processed AND created_at <= now()) AS oldest_due_age_s,
    (SELECT EXTRACT(EPOCH FROM min(created_at) - now())::float8
     FROM webhook_outbox
     WHERE NOT processed AND created_at > now() AND created_at < 'infinity') AS next_due_in_s,
    (SELECT reltuples::float8 FROM pg_class
     WHERE oid = to_regclass('webhook_outbox_due_idx')) AS pending_estimate,
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_dead_letter WHERE state = 'dead' LIMIT %(cap)s
    ) x) AS dead_letters;

-- name: recent_outcomes
-- Attempts completed within the window, by outcome (processed_at index).
SELECT outcome, count(*) AS attempts,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50_ms,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms) AS p95_ms,
       max(processed_at) AS last_at
FROM webhook_outbox
WHERE processed AND processed_at >= now() - %(window_ms)s * interval '1 millisecond'
GROUP BY outcome
ORDER BY outcome;

-- name: retention_cutoff
-- One cutoff for a whole prune run, from the database's clock.
SELECT now() - %(older_than_ms)s * interval '1 millisecond';

-- name: prune_outbox
-- One bounded batch of processed rows older than the cutoff, oldest first (served by
-- webhook_outbox_processed_at_idx). SKIP LOCKED: never waits on a row another
-- transaction holds. Unprocessed rows are never candidates.
WITH gone AS (
    DELETE FROM webhook_outbox
    WHERE (id, partition_at) IN (
        SELECT id, partition_at FROM webhook_outbox
        WHERE processed AND processed_at < %(cutoff)s
        ORDER BY processed_at
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    AND processed
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_outbox_sparing
-- prune_outbox on a partitioned outbox: not the rows of the partitions that retention
-- drops whole later, [spare_from, spare_until) (the one holding the cutoff and those after
-- it). A row deleted there would only be deleted twice, once as a row and once with its
-- partition; the condition on the partition key lets PostgreSQL skip those partitions.
WITH gone AS (
    DELETE FROM webhook_outbox
    WHERE (id, partition_at) IN (
        SELECT id, partition_at FROM webhook_outbox
        WHERE processed AND processed_at < %(cutoff)s
          AND (partition_at < %(spare_from)s OR partition_at >= %(spare_until)s)
        ORDER BY processed_at
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    AND processed
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_dead_letters
-- One bounded batch of dead letters already replayed or purged before the cutoff.
-- Dead letters still waiting ('dead') are never candidates.
WITH gone AS (
    DELETE FROM webhook_dead_letter
    WHERE id IN (
        SELECT id FROM webhook_dead_letter
        WHERE state IN ('replayed', 'purged')
          AND COALESCE(state_changed_at, dead_at) < %(cutoff)s
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    AND state IN ('replayed', 'purged')
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_outbox_count
SELECT count(*) FROM webhook_outbox WHERE processed AND processed_at < %(cutoff)s;

-- name: prune_outbox_sparing_count
SELECT count(*) FROM webhook_outbox
WHERE processed AND processed_at < %(cutoff)s
  AND (partition_at < %(spare_from)s OR partition_at >= %(spare_until)s);

-- name: prune_dead_letters_count
SELECT count(*) FROM webhook_dead_letter
WHERE state IN ('replayed', 'purged') AND COALESCE(state_changed_at, dead_at) < %(cutoff)s;

-- name: connection_budget
-- What the server allows and what is in use now: `run` checks that its workers' connections
-- fit. Other roles' backends show no backend_type (NULL) but do show their database, so
-- they are counted; reserved_connections exists from PostgreSQL 16 on.
SELECT current_setting('max_connections')::int AS max_connections,
       current_setting('superuser_reserved_connections')::int
         + COALESCE(current_setting('reserved_connections', true)::int, 0) AS reserved,
       (SELECT count(*) FROM pg_stat_activity
        WHERE datid IS NOT NULL
          AND (backend_type IS NULL OR backend_type = 'client backend'))::int AS in_use,
       -- A role's and a database's own CONNECTION LIMIT (-1: none; a superuser has none),
       -- and their connections now.
       (SELECT CASE WHEN rolsuper THEN -1 ELSE rolconnlimit END FROM pg_roles
        WHERE rolname = session_user) AS role_limit,
       (SELECT count(*) FROM pg_stat_activity WHERE usename = session_user
          AND (backend_type IS NULL OR backend_type = 'client backend'))::int AS role_in_use,
       (SELECT CASE WHEN r.rolsuper THEN -1 ELSE d.datconnlimit END
        FROM pg_database d, pg_roles r
        WHERE d.datname = current_database() AND r.rolname = session_user) AS database_limit,
       (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
          AND (backend_type IS NULL OR backend_type = 'client backend'))::int
         AS database_in_use;
