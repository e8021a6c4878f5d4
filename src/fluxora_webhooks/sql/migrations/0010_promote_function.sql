-- Choosing ordered streams' next heads (SPEC 14) in one statement from the dispatcher.
--
-- The per-(endpoint, stream) advisory lock must be granted before the heads are chosen,
-- and the choice must see what was committed while the lock was awaited: a routing
-- transaction and a completion of the same stream must not both decide (or both miss) a
-- head. That took two statements (the lock, then the choice under a new snapshot), which
-- cost a psycopg pipeline on every batch to an ordered endpoint (the call, the pipeline and
-- its round trip were a seventh of the dispatcher's CPU in an ordered burst). In a VOLATILE
-- PL/pgSQL function every statement takes a new snapshot under READ COMMITTED (the level
-- every caller runs at), so the same two steps run in one call.
--
-- Applied migrations are checksummed: a later change to this choice is a new migration
-- (CREATE OR REPLACE FUNCTION), never an edit of this file.
--
-- For each (endpoint, stream): when none of its deliveries is active (due, in flight,
-- leased or waiting to retry) and the endpoint is enabled, the waiting delivery with the
-- lowest place becomes due now -- unless an event of that stream with a lower id is still
-- to be routed (its delivery may come first; routing it promotes again). A few index
-- entries per pair however deep the stream: the head is the first entry of
-- webhook_outbox_stream_idx, the active check one probe of webhook_outbox_stream_active_idx.
-- Returns the ids of the deliveries that became due.
CREATE FUNCTION webhook_promote_heads(p_endpoints text[], p_streams text[])
RETURNS SETOF bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- In key order, so two transactions never wait on each other in a cycle.
    PERFORM pg_advisory_xact_lock(k)
    FROM (
        SELECT DISTINCT hashtextextended(e || chr(31) || s, 1718973816) AS k
        FROM unnest(p_endpoints, p_streams) AS p(e, s)
        ORDER BY k
    ) keys;
    RETURN QUERY
    UPDATE webhook_outbox o
    SET hold = NULL, created_at = now()
    FROM (
        SELECT head.id, head.partition_at
        FROM (SELECT DISTINCT e, s FROM unnest(p_endpoints, p_streams) AS p(e, s)) p
        JOIN webhook_endpoints ep ON ep.id = p.e AND ep.state = 'enabled'
        CROSS JOIN LATERAL (
            SELECT w.id, w.partition_at, w.hold, w.tenant, w.stream_id, w.stream_seq
            FROM webhook_outbox w
            WHERE w.endpoint_id = p.e AND w.stream_id = p.s AND NOT w.processed
              AND w.stream_seq IS NOT NULL
            ORDER BY w.stream_seq, w.id
            LIMIT 1
        ) head
        WHERE head.hold = 'waiting'
          AND NOT EXISTS (
              SELECT 1 FROM webhook_outbox a
              WHERE a.endpoint_id = p.e AND a.stream_id = p.s AND NOT a.processed
                AND a.stream_seq IS NOT NULL AND a.hold IS NULL)
          AND NOT EXISTS (
              SELECT 1 FROM webhook_outbox u
              WHERE u.endpoint_id IS NULL AND NOT u.processed AND u.tenant = head.tenant
                AND u.stream_id = head.stream_id AND u.id < head.stream_seq)
    ) h
    WHERE o.id = h.id AND o.partition_at = h.partition_at
    RETURNING o.id;
END
$$;
