-- Choosing ordered streams' next heads (SPEC 14) without waiting for a stream's lock inside
-- a dispatcher's transaction.
--
-- A routing batch may now make an ordered delivery due as it inserts it, when its stream
-- is idle (route_events). That decision needs the stream's lock before the insert, so a
-- batch holds some stream locks from its start to its commit; were it also to wait for
-- another stream's lock at its end (webhook_promote_heads), two batches could each hold
-- what the other waits for. So a dispatcher's transaction never waits for a stream lock:
-- it tries each (pg_try_advisory_xact_lock) and chooses the heads of the streams it got;
-- the streams another transaction holds are returned, and the dispatcher chooses their
-- heads after its commit, in a transaction of its own that holds nothing else
-- (webhook_promote_heads, which waits). That holder's choice, if it made one, was made
-- under the lock; the later one sees it committed.
--
-- Returns one row per promoted delivery (promoted set) and one per stream whose lock was
-- held elsewhere (busy_endpoint, busy_stream set).
CREATE FUNCTION webhook_try_promote_heads(p_endpoints text[], p_streams text[])
RETURNS TABLE (promoted bigint, busy_endpoint text, busy_stream text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    got_e text[];
    got_s text[];
BEGIN
    -- The same keys as webhook_promote_heads; a lock this transaction holds already is
    -- granted again at once.
    SELECT coalesce(array_agg(p.e), '{}'), coalesce(array_agg(p.s), '{}')
    INTO got_e, got_s
    FROM (SELECT DISTINCT e, s FROM unnest(p_endpoints, p_streams) AS q(e, s)) p
    WHERE pg_try_advisory_xact_lock(hashtextextended(p.e || chr(31) || p.s, 1718973816));
    RETURN QUERY
    SELECT NULL::bigint, p.e, p.s
    FROM (SELECT DISTINCT e, s FROM unnest(p_endpoints, p_streams) AS q(e, s)) p
    WHERE NOT EXISTS (
        SELECT 1 FROM unnest(got_e, got_s) AS g(e, s) WHERE g.e = p.e AND g.s = p.s);
    -- Held now: webhook_promote_heads's locks are granted at once, and its choice runs
    -- under a snapshot taken after them.
    RETURN QUERY
    SELECT h.id, NULL::text, NULL::text FROM webhook_promote_heads(got_e, got_s) AS h(id);
END
$$;
