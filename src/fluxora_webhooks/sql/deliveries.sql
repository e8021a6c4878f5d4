-- Events, deliveries, attempts, replay and statistics (SPEC 15), used by deliveries.py: the
-- admin layer behind the API and the dashboard. Tenant scoping is in every query: a block
-- that takes %(tenant)s compares it when %(scoped)s is true, so another tenant's rows are
-- simply not found. A filter parameter that is NULL filters nothing.
--
-- An event is a row a producer wrote (event_id IS NULL; the list leaves out the operator's
-- own events, which an admin reads one at a time). A
-- delivery is one (event, endpoint): the rows sharing a delivery_id; its first row is the
-- one with attempt 1 that is no replay (the routed row, or the event row itself for the
-- built-in default endpoint), its current row the one with the highest id. Lists page by
-- id, newest first (keyset: %(before)s is the last id of the previous page).

-- name: idempotency_find
-- The request a live idempotency key names (younger than %(ttl_s)s seconds).
SELECT request_hash, response
FROM webhook_idempotency_keys
WHERE tenant = %(tenant)s AND key = %(key)s
  AND created_at > now() - make_interval(secs => %(ttl_s)s);

-- name: idempotency_lock
-- One request per key and tenant at a time, until its transaction ends (an endpoint's
-- creation: the requests after the first find its key and answer with its endpoint, not
-- make one of their own that the tenant's cap may refuse).
SELECT pg_advisory_xact_lock(hashtextextended(%(tenant)s || chr(31) || %(key)s, 2404968131));

-- name: idempotency_keep
-- Takes the key for the event of this transaction: a new row, or one whose key expired
-- (replaced). No row comes back when a live one holds it, committed by a request that ran
-- at the same moment (this INSERT waited for that transaction to end): the caller rolls
-- its event back and answers with that one's. Up to 10 expired keys of any tenant are
-- removed on the way (not this one: a row is not changed twice in one statement).
WITH expired AS (
    DELETE FROM webhook_idempotency_keys k
    USING (
        SELECT tenant, key FROM webhook_idempotency_keys
        WHERE created_at <= now() - make_interval(secs => %(ttl_s)s)
          AND NOT (tenant = %(tenant)s AND key = %(key)s)
        ORDER BY created_at
        LIMIT 10
        FOR UPDATE SKIP LOCKED
    ) x
    WHERE k.tenant = x.tenant AND k.key = x.key
)
INSERT INTO webhook_idempotency_keys AS k (tenant, key, request_hash, response)
VALUES (%(tenant)s, %(key)s, %(request_hash)s, %(response)s)
ON CONFLICT (tenant, key) DO UPDATE
SET request_hash = EXCLUDED.request_hash, response = EXCLUDED.response, created_at = now()
WHERE k.created_at <= now() - make_interval(secs => %(ttl_s)s)
RETURNING true;

-- name: event_list
SELECT id, tenant, stream_id, event_type, payload, enqueued_at AS created_at
FROM webhook_outbox
WHERE event_id IS NULL AND tenant <> '!operator'
  AND (NOT %(scoped)s OR tenant = %(tenant)s)
  AND (%(f_tenant)s::text IS NULL OR tenant = %(f_tenant)s)
  AND (%(stream_id)s::text IS NULL OR (stream_id = %(stream_id)s AND octet_length(stream_id) <= 2000))
  AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: event_get
-- Also an operator event, for an admin: its delivery is in the admin's lists and links
-- here. A tenant's token never sees one (no tenant is '!operator').
-- routing: pending (not routed yet), routed (its deliveries listed; a row of the built-in
-- endpoint is its own delivery), unrouted (no endpoint subscribed to its type), or
-- dead_letter (its fan-out was refused: a dead letter with no endpoint holds it).
SELECT id, tenant, stream_id, event_type, payload, enqueued_at AS created_at, traceparent,
       CASE WHEN outcome = 'unrouted' THEN 'unrouted'
            WHEN endpoint_id IS NOT NULL OR outcome = 'routed' THEN 'routed'
            WHEN outcome = 'dead_letter' THEN 'dead_letter'
            ELSE 'pending' END AS routing
FROM webhook_outbox
WHERE id = %(id)s AND event_id IS NULL
  AND (NOT %(scoped)s OR (tenant = %(tenant)s AND tenant <> '!operator'));

-- name: event_of_row
-- The event whose own row has this delivery id (what enqueue returned for it): the event
-- row (event_id IS NULL), by webhook_outbox_delivery_idx. Scoped as event_get.
SELECT id FROM webhook_outbox
WHERE delivery_id = %(delivery_id)s AND event_id IS NULL
  AND (NOT %(scoped)s OR (tenant = %(tenant)s AND tenant <> '!operator'))
ORDER BY id
LIMIT 1;

-- name: delivery_list
-- One row per delivery (its first row), with its current row's status and its attempts.
-- %(event)s: only that event's deliveries (served by webhook_outbox_event_idx and the key).
-- A row dead-lettered with no request (its endpoint removed, or its row unusable: no
-- status, no duration) is the delivery's end, not an attempt: as the dead letter's count
-- has it.
--
-- Where the first rows come from depends on %(status)s (and %(held)s): one of the five pages
-- below is planned, the others fold away (the parameters are values when planned, not placeholders
-- of a prepared statement: see api/app.py).
-- - none, or delivered: the scope's deliveries newest first (the key, or one tenant's,
--   endpoint's or stream's index), until a page of them matches;
-- - none with %(held)s: the held rows (pending, their error the held words), then their
--   deliveries' first rows;
-- - pending: the first row is the current one, not processed yet: among the backlog's
--   rows (the partial indexes on NOT processed);
-- - retrying, parked: the deliveries with such a row not processed yet, from the
--   backlog's rows, then their first rows (webhook_outbox_delivery_idx);
-- - dead_letter: the deliveries of the scope's dead letters (in any state), then their
--   first rows.
-- So a status few deliveries have is found without reading every delivery of the scope;
-- the current row's status is checked as always. (Not found this way: a delivery whose
-- current row is a processed retry, as retrying: the retry's next row is written in the
-- same statement; one whose dead letters were pruned while its rows were kept, as
-- dead_letter.)
SELECT * FROM (
    (
        -- use: delivery_list_select
        FROM webhook_outbox f
        -- use: delivery_list_current
        WHERE ((%(status)s::text IS NULL AND NOT %(held)s)
               OR %(status)s::text NOT IN ('pending', 'retrying', 'parked', 'dead_letter'))
        -- use: delivery_list_filters
    )
    UNION ALL
    (
        -- %(held)s with no status: the held rows are few, and pending (not processed):
        -- from them, then their deliveries' first rows, as for retrying below.
        -- use: delivery_list_select
        FROM (
            SELECT u.* FROM webhook_outbox u
            WHERE u.attempt = 1 AND NOT u.replay AND NOT u.processed
              AND u.error = ANY(%(held_words)s) AND u.endpoint_id IS NOT NULL
            UNION ALL
            SELECT o.* FROM webhook_outbox o
            WHERE o.processed AND o.delivery_id IN (
                SELECT u.delivery_id FROM webhook_outbox u
                WHERE (u.attempt > 1 OR u.replay) AND NOT u.processed
                  AND u.error = ANY(%(held_words)s) AND u.endpoint_id IS NOT NULL
            )
            ORDER BY id DESC
        ) f
        -- use: delivery_list_current
        WHERE %(held)s AND %(status)s::text IS NULL
        -- use: delivery_list_filters
    )
    UNION ALL
    (
        -- use: delivery_list_select
        FROM webhook_outbox f
        -- use: delivery_list_current
        WHERE %(status)s::text = 'pending' AND NOT f.processed AND f.hold IS DISTINCT FROM 'parked'
        -- use: delivery_list_filters
    )
    UNION ALL
    (
        -- use: delivery_list_select
        FROM (
            -- The backlog's rows of the status that are first rows themselves (a delivery
            -- parked before its first attempt), and the first rows of those that are not
            -- (processed: a delivery has one row not processed at a time). Sorted first, so
            -- that the current rows are read for one page only.
            SELECT u.* FROM webhook_outbox u
            WHERE u.attempt = 1 AND NOT u.replay
            -- use: delivery_list_backlog
            UNION ALL
            SELECT o.* FROM webhook_outbox o
            WHERE o.processed AND o.delivery_id IN (
                SELECT u.delivery_id FROM webhook_outbox u
                WHERE (u.attempt > 1 OR u.replay)
                -- use: delivery_list_backlog
            )
            ORDER BY id DESC
        ) f
        -- use: delivery_list_current
        WHERE %(status)s::text IN ('retrying', 'parked')
        -- use: delivery_list_filters
    )
    UNION ALL
    (
        -- use: delivery_list_select
        FROM (
            SELECT o.* FROM webhook_outbox o
            WHERE o.delivery_id IN (
                SELECT d.delivery_id FROM webhook_dead_letter d
                WHERE (NOT %(scoped)s OR d.tenant = %(tenant)s)
                  AND (%(f_tenant)s::text IS NULL OR d.tenant = %(f_tenant)s)
                  AND (%(endpoint_id)s::text IS NULL OR d.endpoint_id = %(endpoint_id)s)
                  AND (%(stream_id)s::text IS NULL OR (d.stream_id = %(stream_id)s AND octet_length(d.stream_id) <= 2000))
                  AND (%(event_type)s::text IS NULL OR d.event_type = %(event_type)s)
            )
            ORDER BY id DESC
        ) f
        -- use: delivery_list_current
        WHERE %(status)s::text = 'dead_letter'
        -- use: delivery_list_filters
    )
) page
ORDER BY seq DESC
LIMIT %(limit)s;

-- name: delivery_list_select
-- A fragment of delivery_list: its columns.
SELECT f.id AS seq, f.delivery_id::text AS delivery_id, COALESCE(f.event_id, f.id) AS event_id,
       f.endpoint_id, f.tenant, f.stream_id, f.event_type, f.enqueued_at AS created_at,
       s.attempt_count, s.last_attempt_at,
       CASE WHEN NOT c.processed THEN
                CASE WHEN c.hold = 'parked' THEN 'parked'
                     WHEN c.attempt > 1 OR c.replay THEN 'retrying'
                     ELSE 'pending' END
            WHEN c.outcome = 'delivered' THEN 'delivered'
            WHEN c.outcome = 'dead_letter' THEN 'dead_letter'
            ELSE 'retrying' END AS status,
       CASE WHEN NOT c.processed AND c.created_at < 'infinity' THEN c.created_at END AS next_attempt_at

-- name: delivery_list_current
-- A fragment of delivery_list: the first row's attempts and its current row.
CROSS JOIN LATERAL (
    SELECT max(a.id) AS current_id,
           count(*) FILTER (WHERE a.processed AND a.attempted) AS attempt_count,
           max(a.processed_at) FILTER (WHERE a.processed AND a.attempted) AS last_attempt_at
    FROM (
        SELECT o.id, o.processed, o.processed_at,
               o.outcome IN ('delivered', 'retry', 'dead_letter')
               AND NOT (o.outcome = 'dead_letter' AND o.status_code IS NULL
                        AND o.duration_ms IS NULL)
                   AS attempted
        FROM webhook_outbox o
        WHERE o.delivery_id = f.delivery_id AND o.endpoint_id IS NOT NULL
    ) a
) s
JOIN webhook_outbox c ON c.id = s.current_id

-- name: delivery_list_filters
-- A fragment of delivery_list: which first rows, the status, the page.
  AND f.attempt = 1 AND NOT f.replay AND f.endpoint_id IS NOT NULL
  AND f.outcome IS DISTINCT FROM 'routed' AND f.outcome IS DISTINCT FROM 'unrouted'
  AND (NOT %(scoped)s OR f.tenant = %(tenant)s)
  AND (%(event)s::bigint IS NULL OR f.event_id = %(event)s OR f.id = %(event)s)
  AND (%(f_tenant)s::text IS NULL OR f.tenant = %(f_tenant)s)
  AND (%(endpoint_id)s::text IS NULL OR f.endpoint_id = %(endpoint_id)s)
  AND (%(stream_id)s::text IS NULL OR (f.stream_id = %(stream_id)s AND octet_length(f.stream_id) <= 2000))
  AND (%(event_type)s::text IS NULL OR f.event_type = %(event_type)s)
  AND (%(before)s::bigint IS NULL OR f.id < %(before)s)
  -- %(held)s: only those held by an outage of this service's way out (delivery.HELD).
  AND (NOT %(held)s OR (NOT c.processed AND c.error = ANY(%(held_words)s)))
  AND (%(status)s::text IS NULL OR %(status)s = CASE
        WHEN NOT c.processed THEN
            CASE WHEN c.hold = 'parked' THEN 'parked'
                 WHEN c.attempt > 1 OR c.replay THEN 'retrying'
                 ELSE 'pending' END
        WHEN c.outcome = 'delivered' THEN 'delivered'
        WHEN c.outcome = 'dead_letter' THEN 'dead_letter'
        ELSE 'retrying' END)
ORDER BY f.id DESC
LIMIT %(limit)s

-- name: delivery_list_backlog
-- A fragment of delivery_list: the scope's rows not processed yet that make a delivery
-- retrying or parked (%(status)s), as u.
  AND NOT u.processed AND u.endpoint_id IS NOT NULL
  AND CASE WHEN %(status)s::text = 'parked' THEN u.hold = 'parked'
           ELSE u.hold IS DISTINCT FROM 'parked' AND (u.attempt > 1 OR u.replay) END
  AND (NOT %(scoped)s OR u.tenant = %(tenant)s)
  AND (%(f_tenant)s::text IS NULL OR u.tenant = %(f_tenant)s)
  AND (%(endpoint_id)s::text IS NULL OR u.endpoint_id = %(endpoint_id)s)
  AND (%(stream_id)s::text IS NULL OR (u.stream_id = %(stream_id)s AND octet_length(u.stream_id) <= 2000))
  AND (%(event_type)s::text IS NULL OR u.event_type = %(event_type)s)

-- name: delivery_rows
-- Every row of one delivery, oldest first (webhook_outbox_delivery_idx); whether each was
-- an attempt, as delivery_list counts them.
SELECT id, delivery_id::text AS delivery_id, COALESCE(event_id, id) AS event_id, endpoint_id,
       tenant, stream_id, event_type, payload, enqueued_at,
       -- psycopg reads no 'infinity': a parked or waiting row has no due time.
       CASE WHEN created_at < 'infinity' THEN created_at END AS due_at, processed,
       processed_at, outcome, status_code, error, response_body, duration_ms, attempt,
       replay, hold, lease, stream_seq, traceparent,
       processed AND outcome IN ('delivered', 'retry', 'dead_letter')
       AND NOT (outcome = 'dead_letter' AND status_code IS NULL AND duration_ms IS NULL)
           AS attempted
FROM webhook_outbox
WHERE delivery_id = %(delivery_id)s::uuid AND endpoint_id IS NOT NULL
  AND outcome IS DISTINCT FROM 'routed' AND outcome IS DISTINCT FROM 'unrouted'
  AND (NOT %(scoped)s OR tenant = %(tenant)s)
ORDER BY id;

-- name: delivery_dead_reason
-- Why a dead-lettered delivery ended (its latest dead letter: webhook_dead_letter_delivery_idx).
SELECT reason FROM webhook_dead_letter
WHERE delivery_id = %(delivery_id)s::uuid
ORDER BY dead_at DESC, id DESC
LIMIT 1;

-- name: delivery_lock
-- Replays of one delivery take turns (two at once must not both queue a new attempt).
SELECT pg_advisory_xact_lock(hashtextextended(%(delivery_id)s, 125779117023609));

-- name: delivery_current_for_update
-- The delivery's current row, locked; a batch sending it right now is waited for
-- (bounded by the caller's lock_timeout), then the row it left is the one read.
SELECT o.id, o.processed, o.hold, o.lease, o.created_at > now() AS later, o.endpoint_id,
       o.stream_id, o.stream_seq, e.state AS endpoint_state, e.ordered AS endpoint_ordered
FROM webhook_outbox o
LEFT JOIN webhook_endpoints e ON e.id = o.endpoint_id
WHERE o.id = (
    SELECT max(id) FROM webhook_outbox
    WHERE delivery_id = %(delivery_id)s::uuid AND endpoint_id IS NOT NULL
      AND outcome IS DISTINCT FROM 'routed' AND outcome IS DISTINCT FROM 'unrouted'
      AND (NOT %(scoped)s OR tenant = %(tenant)s)
)
FOR UPDATE OF o;

-- name: delivery_due_now
-- A pending delivery due later is due now (and the dispatchers are woken: an UPDATE does
-- not fire the insert trigger's notification).
WITH moved AS (
    UPDATE webhook_outbox SET created_at = now()
    WHERE id = %(id)s AND NOT processed AND hold IS NULL AND lease IS NULL
      AND created_at > now()
    RETURNING id
)
SELECT pg_notify('webhook_outbox', '') FROM moved;

-- name: delivery_requeue
-- A finished delivery (delivered or dead-lettered) gets a new attempt under its delivery
-- id, gated as a replay; parked while its endpoint is disabled, waiting behind its
-- stream's head when the endpoint is ordered (promote_heads decides). Its dead letter, if
-- still waiting, is marked replayed.
WITH cur AS (SELECT * FROM webhook_outbox WHERE id = %(id)s AND processed),
ep AS (SELECT * FROM webhook_endpoints WHERE id = (SELECT endpoint_id FROM cur)),
queued AS (
    INSERT INTO webhook_outbox
        (tenant, stream_id, event_type, payload, delivery_id, enqueued_at, replay,
         endpoint_id, event_id, stream_seq, hold, created_at, traceparent, tracestate)
    SELECT c.tenant, c.stream_id, c.event_type, c.payload, c.delivery_id, c.enqueued_at, true,
           c.endpoint_id, COALESCE(c.event_id, c.id),
           CASE WHEN ep.ordered THEN c.stream_seq END,
           CASE WHEN ep.state = 'disabled' THEN 'parked'
                WHEN ep.ordered AND c.stream_seq IS NOT NULL THEN 'waiting' END,
           CASE WHEN ep.state = 'disabled' OR (ep.ordered AND c.stream_seq IS NOT NULL)
                THEN 'infinity'::timestamptz ELSE now() END,
           c.traceparent, c.tracestate
    FROM cur c CROSS JOIN ep
    RETURNING id, stream_id, stream_seq
),
revived AS (
    UPDATE webhook_dead_letter SET state = 'replayed', state_changed_at = now()
    WHERE delivery_id = (SELECT delivery_id FROM cur) AND state = 'dead'
      AND EXISTS (SELECT 1 FROM queued)
    RETURNING 1
)
SELECT q.id, q.stream_id, q.stream_seq, (SELECT count(*) FROM revived) AS revived
FROM queued q;

-- name: stats_backlog
-- The scope's backlog: counts stop at the cap (webhook_outbox_due_idx and
-- webhook_dead_letter_dead_idx serve them), as ops.read_backlog does for the service.
-- The dead letters waiting are told apart by their endpoint: one removed since (as
-- dlq_orphaned finds them; reason endpoint_removed, or dead before the removal) is refused
-- by a replay and a recovery, and waits for a purge only. The cap bounds the dead letters
-- read, both parts together (all of them: webhook_dead_letter_endpoint_idx, partial on
-- state 'dead', which holds the endpoint; one tenant's: an index by tenant, then the
-- rows); their endpoints are looked up after it, once (a hash of the endpoints).
SELECT
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_outbox
        WHERE NOT processed AND (NOT %(scoped)s OR tenant = %(tenant)s) LIMIT %(cap)s
    ) p) AS pending,
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_outbox
        WHERE NOT processed AND created_at <= now() AND (NOT %(scoped)s OR tenant = %(tenant)s)
        LIMIT %(cap)s
    ) d) AS due,
    (SELECT count(*) FROM (
        SELECT 1 FROM webhook_outbox
        WHERE NOT processed AND hold = 'parked' AND (NOT %(scoped)s OR tenant = %(tenant)s)
        LIMIT %(cap)s
    ) k) AS parked,
    (SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8
     FROM webhook_outbox
     WHERE NOT processed AND created_at <= now()
       AND (NOT %(scoped)s OR tenant = %(tenant)s)) AS oldest_due_age_s,
    (
        -- use: egress_held
    ) AS egress_held,
    x.waiting AS dead_letters,
    x.of_removed AS dead_letters_of_removed
FROM (
    SELECT count(*) FILTER (WHERE NOT removed) AS waiting,
           count(*) FILTER (WHERE removed) AS of_removed
    FROM (
        SELECT d.endpoint_id IS NOT NULL AND d.endpoint_id NOT IN ('default', 'operator')
               AND e.id IS NULL AS removed
        FROM (
            SELECT endpoint_id FROM webhook_dead_letter
            WHERE state = 'dead' AND (NOT %(scoped)s OR tenant = %(tenant)s) LIMIT %(cap)s
        ) d
        LEFT JOIN webhook_endpoints e ON e.id = d.endpoint_id
    ) y
) x;

-- name: egress_held
-- The scope's deliveries held by an outage of this service's way out (its egress proxy or
-- its DNS resolver), counted up to the cap: pending rows whose error is held words
-- (%(held)s, delivery.HELD's: EGRESS_HELD, RESOLVER_HELD, written by complete_held and
-- replaced when the row is sent), due later or due again and
-- not claimed yet. Parked and waiting rows (due at 'infinity') are left out by the index
-- (webhook_outbox_due_idx); the rest are read.
SELECT count(*) FROM (
    SELECT 1 FROM webhook_outbox
    WHERE NOT processed AND created_at < 'infinity' AND error = ANY(%(held)s)
      AND (NOT %(scoped)s OR tenant = %(tenant)s)
    LIMIT %(cap)s
) h

-- name: stats_outcomes
-- Attempts completed within the window, by outcome (webhook_outbox_processed_at_idx): a
-- dead letter no request was made for (its endpoint removed, a row that could not be
-- sent: no status, no duration) is no attempt, as delivery_list counts them.
SELECT outcome, count(*) AS attempts,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50_ms,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms) AS p95_ms,
       max(processed_at) AS last_at
FROM webhook_outbox
WHERE processed AND processed_at >= now() - %(window_ms)s * interval '1 millisecond'
  AND outcome IN ('delivered', 'retry', 'dead_letter')
  AND NOT (outcome = 'dead_letter' AND status_code IS NULL AND duration_ms IS NULL)
  AND (NOT %(scoped)s OR tenant = %(tenant)s)
GROUP BY outcome
ORDER BY outcome;

-- name: stats_endpoints
-- Each endpoint of the scope (a page by id, after %(after)s; or only those of %(ids)s) with
-- its attempts in the window, its success rate and attempt duration, and its pending
-- deliveries (counted up to the cap, through webhook_outbox_endpoint_pending_idx).
WITH eps AS (
    SELECT id, tenant, url, state, disabled_reason, ordered
    FROM webhook_endpoints
    WHERE (NOT %(scoped)s OR tenant = %(tenant)s)
      AND NOT (%(scoped)s AND tenant = '!operator')
      AND (%(after)s::text IS NULL OR id > %(after)s)
      AND (%(ids)s::text[] IS NULL OR id = ANY(%(ids)s::text[]))
    ORDER BY id
    LIMIT %(limit)s
),
recent AS (
    SELECT endpoint_id,
           count(*) AS attempts,
           count(*) FILTER (WHERE outcome = 'delivered') AS delivered,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50_ms,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms) AS p95_ms
    FROM webhook_outbox
    WHERE processed AND processed_at >= now() - %(window_ms)s * interval '1 millisecond'
      AND outcome IN ('delivered', 'retry', 'dead_letter')
      AND NOT (outcome = 'dead_letter' AND status_code IS NULL AND duration_ms IS NULL)
      AND endpoint_id IN (SELECT id FROM eps)
    GROUP BY endpoint_id
)
SELECT e.id, e.tenant, e.url, e.state, e.disabled_reason, e.ordered,
       COALESCE(r.attempts, 0) AS attempts, COALESCE(r.delivered, 0) AS delivered,
       r.p50_ms, r.p95_ms,
       (SELECT count(*) FROM (
           SELECT 1 FROM webhook_outbox o
           WHERE o.endpoint_id = e.id AND NOT o.processed LIMIT %(cap)s
       ) p) AS pending
FROM eps e LEFT JOIN recent r ON r.endpoint_id = e.id
ORDER BY e.id;

-- name: stats_series
-- The window in equal buckets, from the outbox history: attempts by outcome, the latency
-- from enqueue to delivery (p50, p95), the backlog at each bucket's end, and dead letters.
-- The backlog counts each delivery from its enqueue to its final row (delivered or dead
-- letter) or, still pending, to now; history pruned by WEBHOOK_RETENTION is not counted.
WITH w AS (
    SELECT now() - %(window_ms)s * interval '1 millisecond' AS start,
           %(window_ms)s / 1000.0 / %(buckets)s AS width_s
),
done AS (
    SELECT o.processed_at, o.outcome, o.enqueued_at, o.replay,
           -- a request was made (as stats_outcomes counts attempts)
           NOT (o.outcome = 'dead_letter' AND o.status_code IS NULL AND o.duration_ms IS NULL)
               AS attempted,
           LEAST(%(buckets)s - 1,
                 floor(EXTRACT(EPOCH FROM o.processed_at - w.start) / w.width_s))::int AS b
    FROM webhook_outbox o, w
    -- The bound is written out, not w.start: a CTE's column is no index condition, and
    -- with it every window read the whole outbox (a sequential scan) instead of
    -- webhook_outbox_processed_at_idx. now() is the statement's, as in w.
    WHERE o.processed AND o.processed_at >= now() - %(window_ms)s * interval '1 millisecond'
      AND o.endpoint_id IS NOT NULL
      AND o.outcome IN ('delivered', 'retry', 'dead_letter')
      AND (NOT %(scoped)s OR o.tenant = %(tenant)s)
),
pending AS (
    SELECT o.enqueued_at
    FROM webhook_outbox o
    WHERE NOT o.processed AND o.tenant <> '!operator'
      AND (NOT %(scoped)s OR o.tenant = %(tenant)s)
),
arrivals AS (
    SELECT GREATEST(0, LEAST(%(buckets)s - 1,
               floor(EXTRACT(EPOCH FROM x.enqueued_at - w.start) / w.width_s)))::int AS b,
           count(*) AS n
    FROM (
        SELECT enqueued_at FROM done WHERE outcome IN ('delivered', 'dead_letter')
        UNION ALL SELECT enqueued_at FROM pending
    ) x, w
    GROUP BY 1
),
departures AS (
    SELECT b, count(*) AS n FROM done WHERE outcome IN ('delivered', 'dead_letter') GROUP BY b
),
attempts AS (
    SELECT b,
           count(*) FILTER (WHERE outcome = 'delivered') AS delivered,
           count(*) FILTER (WHERE outcome = 'retry') AS retry,
           count(*) FILTER (WHERE outcome = 'dead_letter' AND attempted) AS dead_letter,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM processed_at - enqueued_at) * 1000)
               FILTER (WHERE outcome = 'delivered' AND NOT replay) AS p50_ms,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM processed_at - enqueued_at) * 1000)
               FILTER (WHERE outcome = 'delivered' AND NOT replay) AS p95_ms
    FROM done GROUP BY b
),
dead AS (
    SELECT LEAST(%(buckets)s - 1,
                 floor(EXTRACT(EPOCH FROM d.dead_at - w.start) / w.width_s))::int AS b,
           count(*) AS n
    FROM webhook_dead_letter d, w
    WHERE d.dead_at >= now() - %(window_ms)s * interval '1 millisecond'
      AND (NOT %(scoped)s OR d.tenant = %(tenant)s)
      AND NOT (%(scoped)s AND d.tenant = '!operator')
    GROUP BY 1
)
SELECT g.b, w.start + (g.b + 1) * w.width_s * interval '1 second' AS at,
       COALESCE(a.delivered, 0) AS delivered, COALESCE(a.retry, 0) AS retry,
       COALESCE(a.dead_letter, 0) AS dead_letter, a.p50_ms, a.p95_ms,
       (SUM(COALESCE(ar.n, 0) - COALESCE(dp.n, 0)) OVER (ORDER BY g.b))::bigint AS backlog,
       COALESCE(dd.n, 0) AS dead_letters
FROM w
CROSS JOIN generate_series(0, %(buckets)s - 1) AS g(b)
LEFT JOIN attempts a ON a.b = g.b
LEFT JOIN arrivals ar ON ar.b = g.b
LEFT JOIN departures dp ON dp.b = g.b
LEFT JOIN dead dd ON dd.b = g.b
ORDER BY g.b;
