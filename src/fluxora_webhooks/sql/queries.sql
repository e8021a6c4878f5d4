-- Named queries, loaded once by queries.py. A block starts with "-- name: <name>".
-- Parameters use psycopg's %(name)s style.

-- name: claim_due
-- The design document's claim. Served by webhook_outbox_due_idx.
SELECT id, delivery_id::text AS delivery_id, event_type, payload::text AS body, attempt
FROM webhook_outbox
WHERE processed = false
  AND created_at <= now()
ORDER BY created_at ASC, id ASC
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED;

-- name: next_due_in_ms
-- How long until the earliest unprocessed row is due (NULL when none is pending).
SELECT GREATEST(0, EXTRACT(EPOCH FROM (min(created_at) - now())) * 1000)::bigint
FROM webhook_outbox
WHERE processed = false;

-- name: complete_batch
-- Every outcome of one batch in one statement: mark attempts processed, defer rows,
-- insert retries (same delivery id, next attempt) and dead letters.
WITH r AS (
    SELECT *
    FROM unnest(
        %(ids)s::bigint[], %(outcomes)s::text[], %(delays)s::bigint[], %(codes)s::int[],
        %(errors)s::text[], %(bodies)s::text[], %(durations)s::float8[], %(reasons)s::text[]
    ) AS t(id, outcome, delay_ms, status_code, error, response_body, duration_ms, reason)
),
done AS (
    UPDATE webhook_outbox o
    SET processed = true, processed_at = now(), outcome = r.outcome,
        status_code = r.status_code, error = r.error, response_body = r.response_body,
        duration_ms = r.duration_ms
    FROM r
    WHERE o.id = r.id AND r.outcome <> 'deferred'
    RETURNING o.id
),
deferred AS (
    UPDATE webhook_outbox o
    SET created_at = now() + r.delay_ms * interval '1 millisecond',
        deferrals = o.deferrals + 1
    FROM r
    WHERE o.id = r.id AND r.outcome = 'deferred'
    RETURNING o.id
),
retried AS (
    INSERT INTO webhook_outbox
        (stream_id, event_type, payload, created_at, delivery_id, attempt, enqueued_at)
    SELECT o.stream_id, o.event_type, o.payload,
           now() + r.delay_ms * interval '1 millisecond',
           o.delivery_id, o.attempt + 1, o.enqueued_at
    FROM r JOIN webhook_outbox o ON o.id = r.id
    WHERE r.outcome = 'retry'
    RETURNING id
),
dead AS (
    INSERT INTO webhook_dead_letter
        (delivery_id, stream_id, event_type, payload, attempts, reason, last_status,
         last_error, last_response, enqueued_at)
    SELECT o.delivery_id, o.stream_id, o.event_type, o.payload, o.attempt, r.reason,
           r.status_code, r.error, r.response_body, o.enqueued_at
    FROM r JOIN webhook_outbox o ON o.id = r.id
    WHERE r.outcome = 'dead_letter'
    RETURNING id
)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM deferred),
       (SELECT count(*) FROM retried), (SELECT count(*) FROM dead);

-- name: enqueue
INSERT INTO webhook_outbox (stream_id, event_type, payload)
VALUES (%(stream_id)s, %(event_type)s, %(payload)s)
RETURNING delivery_id::text;

-- name: dlq_list
SELECT id, delivery_id::text, stream_id, event_type, attempts, reason, last_status,
       last_error, enqueued_at, dead_at, state
FROM webhook_dead_letter
WHERE (%(all)s OR state = 'dead')
ORDER BY dead_at DESC, id DESC
LIMIT %(limit)s;

-- name: dlq_show
SELECT id, delivery_id::text, stream_id, event_type, payload::text AS payload, attempts,
       reason, last_status, last_error, last_response, enqueued_at, dead_at, state,
       state_changed_at
FROM webhook_dead_letter
WHERE delivery_id::text = %(key)s OR id::text = %(key)s
ORDER BY dead_at DESC, id DESC;

-- name: dlq_replay
-- Back into the outbox, due now, same delivery id, attempts counted afresh.
WITH picked AS (
    UPDATE webhook_dead_letter
    SET state = 'replayed', state_changed_at = now()
    WHERE state = 'dead' AND (%(all)s OR delivery_id::text = ANY(%(keys)s) OR id::text = ANY(%(keys)s))
    RETURNING delivery_id, stream_id, event_type, payload, enqueued_at
)
INSERT INTO webhook_outbox (stream_id, event_type, payload, delivery_id, enqueued_at)
SELECT stream_id, event_type, payload, delivery_id, enqueued_at FROM picked
RETURNING delivery_id::text;

-- name: dlq_purge
UPDATE webhook_dead_letter
SET state = 'purged', state_changed_at = now()
WHERE state = 'dead' AND (%(all)s OR delivery_id::text = ANY(%(keys)s) OR id::text = ANY(%(keys)s))
RETURNING delivery_id::text;
