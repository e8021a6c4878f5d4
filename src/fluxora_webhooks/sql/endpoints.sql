-- The endpoint registry (SPEC 10, 12, 13): named blocks used by endpoints.py, the one admin
-- layer behind the CLI and the API. Tenant scoping is in the queries themselves: a block
-- that takes %(tenant)s compares it only when %(scoped)s is true (an admin sees every
-- tenant); another tenant's endpoint is then simply not found.

-- name: endpoint_insert
INSERT INTO webhook_endpoints
    (id, tenant, url, event_types, secret, description, headers, rate_limit, ordered,
     client_cert, client_key)
VALUES (%(id)s, %(tenant)s, %(url)s, %(event_types)s, %(secret)s, %(description)s,
        %(headers)s, %(rate_limit)s, %(ordered)s, %(client_cert)s, %(client_key)s)
RETURNING *;

-- name: endpoint_tenant_lock
-- Creates for one tenant one at a time while its endpoints are counted against a cap.
SELECT pg_advisory_xact_lock(hashtextextended(%(tenant)s, 8512097725384027151));

-- name: endpoint_tenant_count
SELECT count(*) AS n FROM webhook_endpoints WHERE tenant = %(tenant)s;

-- name: endpoint_get
SELECT * FROM webhook_endpoints
WHERE id = %(id)s AND (NOT %(scoped)s OR tenant = %(tenant)s);

-- name: endpoint_list
-- A page of endpoints by id; %(after)s is the cursor (the last id of the previous page).
SELECT * FROM webhook_endpoints
WHERE (NOT %(scoped)s OR tenant = %(tenant)s)
  AND (%(after)s::text IS NULL OR id > %(after)s)
ORDER BY id
LIMIT %(limit)s;

-- name: endpoint_update
-- COALESCE keeps what the change leaves out; description and headers take '' and {}.
UPDATE webhook_endpoints
SET url = COALESCE(%(url)s, url),
    event_types = COALESCE(%(event_types)s, event_types),
    description = COALESCE(%(description)s, description),
    headers = COALESCE(%(headers)s, headers),
    rate_limit = CASE WHEN %(set_rate_limit)s THEN %(rate_limit)s ELSE rate_limit END,
    ordered = COALESCE(%(ordered)s, ordered),
    updated_at = now()
WHERE id = %(id)s AND (NOT %(scoped)s OR tenant = %(tenant)s)
RETURNING *;

-- name: endpoint_release_waiting
-- An endpoint no longer ordered: its waiting deliveries are ordinary pending ones now.
UPDATE webhook_outbox
SET hold = NULL, stream_seq = NULL, created_at = now()
WHERE endpoint_id = %(id)s AND NOT processed AND hold = 'waiting';

-- name: endpoint_unorder_pending
-- The rest of its pending deliveries (heads, retries) leave their streams too.
UPDATE webhook_outbox
SET stream_seq = NULL
WHERE endpoint_id = %(id)s AND NOT processed AND stream_seq IS NOT NULL;

-- name: endpoint_rotate
-- %(drop_previous)s: the old secret is not kept, whatever %(keep_ms)s asked (a secret no
-- key of the rotating process opens: it could neither sign nor be masked).
UPDATE webhook_endpoints
SET secret_previous = CASE WHEN %(drop_previous)s THEN NULL ELSE secret END,
    previous_until = CASE WHEN %(drop_previous)s THEN now()
                          ELSE now() + %(keep_ms)s * interval '1 millisecond' END,
    secret = %(secret)s,
    updated_at = now()
WHERE id = %(id)s AND (NOT %(scoped)s OR tenant = %(tenant)s)
RETURNING *;

-- name: endpoint_secrets_page
-- `secrets encrypt|decrypt`: one page of the endpoints that store a secret (a signing
-- secret, a client certificate's private key, custom headers that may hold credentials),
-- by id, locked until the page is rewritten (a rotation or an update meanwhile waits,
-- then moves or replaces the rewritten value).
SELECT id, secret, secret_previous, client_key, headers FROM webhook_endpoints
WHERE id > %(after)s
  AND (secret IS NOT NULL OR secret_previous IS NOT NULL OR client_key IS NOT NULL
       OR headers <> '{}'::jsonb)
ORDER BY id
LIMIT %(limit)s
FOR UPDATE;

-- name: endpoint_secrets_set
-- The same secrets in another stored form (sealed or plain): no change an endpoint's
-- other readers see, so updated_at stays.
UPDATE webhook_endpoints
SET secret = %(secret)s, secret_previous = %(secret_previous)s, client_key = %(client_key)s,
    headers = %(headers)s
WHERE id = %(id)s;

-- name: endpoint_client_cert_set
-- An endpoint's client certificate set (both) or removed (both NULL).
UPDATE webhook_endpoints
SET client_cert = %(client_cert)s, client_key = %(client_key)s, updated_at = now()
WHERE id = %(id)s AND (NOT %(scoped)s OR tenant = %(tenant)s)
RETURNING *;

-- name: endpoint_disable
UPDATE webhook_endpoints
SET state = 'disabled', disabled_reason = %(reason)s, disabled_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE id = %(id)s AND state = 'enabled' AND (NOT %(scoped)s OR tenant = %(tenant)s)
RETURNING *;

-- name: endpoint_park
-- A disabled endpoint's pending deliveries are parked: kept, not due, no attempt consumed.
-- A row a batch holds (SKIP LOCKED) is parked by that batch's completion (its retry row
-- is inserted parked) or at its next claim; a leased row in flight finishes first. What
-- held it before (an egress outage's wait reason) no longer does: it goes.
UPDATE webhook_outbox
SET hold = 'parked', created_at = 'infinity', error = NULL
WHERE (id, partition_at) IN (
    SELECT id, partition_at FROM webhook_outbox
    WHERE endpoint_id = %(id)s AND NOT processed AND lease IS NULL
      AND hold IS DISTINCT FROM 'parked'
    FOR UPDATE SKIP LOCKED
);

-- name: endpoint_enable
UPDATE webhook_endpoints
SET state = 'enabled', disabled_reason = NULL, disabled_at = NULL, failing_since = NULL,
    updated_at = now()
WHERE id = %(id)s AND state = 'disabled' AND (NOT %(scoped)s OR tenant = %(tenant)s)
RETURNING *;

-- name: endpoint_unpark
-- Every parked delivery is due again; an ordered stream's deliveries wait for their head,
-- which promote_heads then chooses. Returns the streams to promote. First attempts are due
-- now; those the gate admits as retries (a later attempt, a replay) one after another at
-- the endpoint's retry rate, as recover_dead_letters does: an endpoint that failed for
-- days has thousands of them, all refused and claimed again every second if due at once.
WITH parked AS (
    SELECT o.id, o.partition_at, o.attempt > 1 OR o.replay AS gated,
           row_number() OVER (PARTITION BY o.attempt > 1 OR o.replay ORDER BY o.id) AS k
    FROM webhook_outbox o
    WHERE o.endpoint_id = %(id)s AND NOT o.processed AND o.hold = 'parked'
),
unparked AS (
    UPDATE webhook_outbox o
    SET hold = CASE WHEN o.stream_seq IS NULL THEN NULL ELSE 'waiting' END,
        created_at = CASE
            WHEN o.stream_seq IS NOT NULL THEN 'infinity'::timestamptz
            WHEN p.gated THEN now() + (p.k - 1) * interval '1 second'
                 / COALESCE((SELECT rate_limit FROM webhook_endpoints WHERE id = %(id)s),
                            %(rps)s)
            ELSE now() END
    FROM parked p
    WHERE o.id = p.id AND o.partition_at = p.partition_at
    RETURNING o.stream_id, o.stream_seq
)
SELECT DISTINCT stream_id FROM unparked WHERE stream_seq IS NOT NULL;

-- name: endpoint_stragglers
-- Enabled endpoints, changed within the window, that still have a parked delivery. A
-- statement that parks a row (a batch routing an event or recording a retry, the claim's
-- parking, a replay) decides from the endpoint's state in its own snapshot: one that read
-- "disabled" just before an enable committed commits its parked row after the enable's
-- unpark, which could not see it. Taking the endpoint's lock in those statements instead
-- put every batch behind an enable's or a removal's (rolled back and sent again past the
-- lock timeout, a deadlock with a removal, an enable starved by the batches' share locks);
-- the dispatchers' sweep unparks such rows again instead (endpoints.unpark_stragglers).
-- An enable sets updated_at; the window outlasts any parking transaction.
SELECT e.id
FROM webhook_endpoints e
WHERE e.state = 'enabled'
  AND e.updated_at > now() - %(window_ms)s * interval '1 millisecond'
  AND EXISTS (
      SELECT 1 FROM webhook_outbox o
      WHERE o.endpoint_id = e.id AND NOT o.processed AND o.hold = 'parked')
ORDER BY e.id;

-- name: endpoint_remove
-- The endpoint goes, and every pending delivery of it becomes a dead letter (reason
-- endpoint_removed) in the same transaction: nothing vanishes. A row a batch holds is
-- waited for (not skipped): it is either recorded by then or dead-lettered here.
WITH gone AS (
    DELETE FROM webhook_endpoints
    WHERE id = %(id)s AND (NOT %(scoped)s OR tenant = %(tenant)s)
    RETURNING id
),
pending AS (
    UPDATE webhook_outbox o
    SET processed = true, processed_at = clock_timestamp(), outcome = 'dead_letter',
        error = 'endpoint removed', lease = NULL
    FROM gone
    WHERE o.endpoint_id = gone.id AND NOT o.processed
    RETURNING o.*
),
dead AS (
    INSERT INTO webhook_dead_letter
        (delivery_id, stream_id, event_type, payload, attempts, reason, last_status,
         last_error, enqueued_at, tenant, endpoint_id, event_id, stream_seq, traceparent,
         tracestate)
    SELECT delivery_id, stream_id, event_type, payload, attempt - 1, 'endpoint_removed', NULL,
           'endpoint removed', enqueued_at, tenant, endpoint_id, event_id, stream_seq,
           traceparent, tracestate
    FROM pending
    RETURNING delivery_id, tenant, endpoint_id, event_type, attempts, stream_id, dead_at
),
told AS (
    INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)
    SELECT '!operator', d.delivery_id::text, 'delivery.dead_lettered',
           jsonb_build_object('endpoint_id', d.endpoint_id, 'tenant', d.tenant,
                              'reason', 'endpoint_removed', 'delivery_id', d.delivery_id,
                              'event_type', d.event_type, 'attempts', d.attempts,
                              'stream_id', d.stream_id, 'dead_at', d.dead_at),
           'operator'
    FROM dead d
    WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = 'operator')
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM dead) AS dead_lettered;

-- name: operator_event
-- An operator event (SPEC 12), when the operator endpoint is configured: a row of the
-- outbox of its own (no tenant sees it), delivered, retried and dead-lettered like others.
INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)
SELECT '!operator', %(stream_id)s, %(event_type)s, %(payload)s, 'operator'
WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = 'operator')
RETURNING delivery_id::text;

-- name: builtin_upsert
-- The built-in endpoints (default, operator) as the running service configures them.
INSERT INTO webhook_endpoints (id, tenant, url)
VALUES (%(id)s, %(tenant)s, %(url)s)
ON CONFLICT (id) DO UPDATE SET url = EXCLUDED.url, updated_at = now()
WHERE webhook_endpoints.url IS DISTINCT FROM EXCLUDED.url
RETURNING id;

-- name: builtin_restore
-- A built-in endpoint this dispatcher configures, put back if a dispatcher started without
-- its variable removed it meanwhile (only then: no URL tug-of-war between dispatchers).
INSERT INTO webhook_endpoints (id, tenant, url)
VALUES (%(id)s, %(tenant)s, %(url)s)
ON CONFLICT (id) DO NOTHING
RETURNING id;

-- name: builtin_seen
-- A dispatcher that configures this built-in endpoint is running (at most one write a
-- housekeeping period per dispatcher; none while another wrote it moments ago).
INSERT INTO webhook_builtin_seen (endpoint_id, seen_at)
VALUES (%(id)s, now())
ON CONFLICT (endpoint_id) DO UPDATE SET seen_at = EXCLUDED.seen_at
WHERE webhook_builtin_seen.seen_at < EXCLUDED.seen_at - interval '2 seconds';

-- name: builtin_retire
-- A built-in endpoint no running dispatcher configures any more: removed once none has
-- said it does for %(seen_s)s seconds. A disabled one stays: its state and its parked
-- deliveries outlive a start without it.
DELETE FROM webhook_endpoints
WHERE id = %(id)s AND state = 'enabled'
  AND NOT EXISTS (
      SELECT 1 FROM webhook_builtin_seen
      WHERE endpoint_id = %(id)s AND seen_at > now() - %(seen_s)s * interval '1 second'
  )
RETURNING id;

-- name: recover_dead_letters
-- One bounded batch of an endpoint's dead letters from the window, back into the outbox:
-- same delivery id, attempts counted afresh, gated as retries, parked if the endpoint is
-- disabled, waiting behind its stream's head if it is ordered (promote_heads decides).
-- Due one after another at the endpoint's retry rate (%(start)s: how many of this recovery
-- the batches before queued), as the gate will admit them: all due at once, tens of
-- thousands were each refused and claimed again every second, at the head of everyone's
-- claim order, until the last went. The endpoint's own tenant's only (an id is never
-- reused, and a scope checked twice costs nothing).
WITH picked AS (
    UPDATE webhook_dead_letter
    SET state = 'replayed', state_changed_at = now()
    WHERE id IN (
        SELECT id FROM webhook_dead_letter
        WHERE endpoint_id = %(endpoint_id)s AND state = 'dead'
          AND tenant = (SELECT tenant FROM webhook_endpoints WHERE id = %(endpoint_id)s)
          AND dead_at >= %(since)s AND dead_at < %(until)s
        ORDER BY dead_at, id
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING *
),
ep AS (SELECT * FROM webhook_endpoints WHERE id = %(endpoint_id)s),
queued AS (
    INSERT INTO webhook_outbox
        (tenant, stream_id, event_type, payload, delivery_id, enqueued_at, replay,
         endpoint_id, event_id, stream_seq, hold, created_at, traceparent, tracestate)
    SELECT p.tenant, p.stream_id, p.event_type, p.payload, p.delivery_id, p.enqueued_at, true,
           p.endpoint_id, p.event_id, CASE WHEN ep.ordered THEN p.stream_seq END,
           CASE WHEN ep.state = 'disabled' THEN 'parked'
                WHEN ep.ordered AND p.stream_seq IS NOT NULL THEN 'waiting' END,
           CASE WHEN ep.state = 'disabled' OR (ep.ordered AND p.stream_seq IS NOT NULL)
                THEN 'infinity'::timestamptz
                ELSE now() + (%(start)s + row_number() OVER (ORDER BY p.dead_at, p.id) - 1)
                             * interval '1 second' / COALESCE(ep.rate_limit, %(rps)s) END,
           p.traceparent, p.tracestate
    FROM picked p CROSS JOIN ep
    RETURNING stream_id, stream_seq
)
SELECT (SELECT count(*) FROM picked) AS requeued,
       ARRAY(SELECT DISTINCT stream_id FROM queued WHERE stream_seq IS NOT NULL) AS streams;
