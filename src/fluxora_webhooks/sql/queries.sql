-- Named queries, loaded once by queries.py. A block starts with "-- name: <name>".
-- Parameters use psycopg's %(name)s style.

-- name: claim_due
-- The design document's claim. Served by webhook_outbox_due_idx.
SELECT id, delivery_id::text AS delivery_id, event_type, payload::text AS body, attempt,
       replay, floor(EXTRACT(EPOCH FROM now()))::bigint AS signed_at
FROM webhook_outbox
WHERE processed = false
  AND created_at <= now()
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
WHERE processed = false AND created_at > now();

-- name: complete_batch
-- Every outcome of one batch in one statement: mark attempts processed, defer rows,
-- insert retries (same delivery id, next attempt) and dead letters.
-- Times are clock_timestamp(), not now(): now() is the start of the claim transaction,
-- before the HTTP attempts, and a delay (Retry-After above all) counts from their end.
WITH r AS (
    SELECT *
    FROM unnest(
        %(ids)s::bigint[], %(outcomes)s::text[], %(delays)s::bigint[], %(codes)s::int[],
        %(errors)s::text[], %(bodies)s::text[], %(durations)s::float8[], %(reasons)s::text[]
    ) AS t(id, outcome, delay_ms, status_code, error, response_body, duration_ms, reason)
),
done AS (
    UPDATE webhook_outbox o
    SET processed = true, processed_at = clock_timestamp(), outcome = r.outcome,
        status_code = r.status_code, error = r.error, response_body = r.response_body,
        duration_ms = r.duration_ms
    FROM r
    WHERE o.id = r.id AND r.outcome <> 'deferred'
    RETURNING o.id
),
deferred AS (
    UPDATE webhook_outbox o
    SET created_at = clock_timestamp() + r.delay_ms * interval '1 millisecond',
        deferrals = o.deferrals + 1
    FROM r
    WHERE o.id = r.id AND r.outcome = 'deferred'
    RETURNING o.id
),
retried AS (
    INSERT INTO webhook_outbox
        (stream_id, event_type, payload, created_at, delivery_id, attempt, enqueued_at, replay)
    SELECT o.stream_id, o.event_type, o.payload,
           clock_timestamp() + r.delay_ms * interval '1 millisecond',
           o.delivery_id, o.attempt + 1, o.enqueued_at, o.replay
    FROM r JOIN webhook_outbox o ON o.id = r.id
    WHERE r.outcome = 'retry'
    RETURNING id
),
dead AS (
    INSERT INTO webhook_dead_letter
        (delivery_id, stream_id, event_type, payload, attempts, reason, last_status,
         last_error, last_response, enqueued_at, dead_at)
    SELECT o.delivery_id, o.stream_id, o.event_type, o.payload, o.attempt, r.reason,
           r.status_code, r.error, r.response_body, o.enqueued_at, clock_timestamp()
    FROM r JOIN webhook_outbox o ON o.id = r.id
    WHERE r.outcome = 'dead_letter'
    RETURNING id
)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM deferred),
       (SELECT count(*) FROM retried), (SELECT count(*) FROM dead);

-- name: relock_claimed
-- complete_batch runs without a savepoint; when it fails, its transaction rolls back and
-- the dispatcher locks again the rows of that batch that are still its to record (not
-- processed meanwhile, not claimed by another loop) and records them one by one.
SELECT id
FROM webhook_outbox
WHERE id = ANY(%(ids)s::bigint[]) AND processed = false
FOR UPDATE SKIP LOCKED;

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
    RETURNING id, delivery_id, stream_id, event_type, payload, enqueued_at
),
queued AS (
    INSERT INTO webhook_outbox (stream_id, event_type, payload, delivery_id, enqueued_at, replay)
    SELECT stream_id, event_type, payload, delivery_id, enqueued_at, true FROM picked
)
SELECT delivery_id::text, id::text FROM picked;

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
     FROM webhook_outbox WHERE NOT processed AND created_at > now()) AS next_due_in_s,
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
    WHERE id IN (
        SELECT id FROM webhook_outbox
        WHERE processed AND processed_at < %(cutoff)s
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
          AND (backend_type IS NULL OR backend_type = 'client backend'))::int AS in_use;
