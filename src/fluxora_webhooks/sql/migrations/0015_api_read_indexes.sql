-- fluxora: concurrently
-- The management API's reads of one tenant, one stream and the statistics read their own
-- rows, however many other tenants' rows the outbox holds. Before this, a small tenant's
-- list of deliveries, a search by stream or by event type and the statistics read the
-- whole outbox (a parallel scan of every row) or walked it newest first.
--
-- Built CONCURRENTLY, outside a transaction (the marker line above; see migrations.py):
-- the producers' INSERTs go on while each index is built. Each statement can run again: a
-- run interrupted half-way is completed by the next `fluxora-webhooks migrate`.
--
-- As in 0008, the lists' indexes hold only the rows their list reads, and those of the
-- default tenant ('') and the operator only where the list reads them.

-- A tenant's deliveries, newest first (GET /deliveries of a tenant token, ?tenant=).
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_outbox_tenant_deliveries_idx
    ON webhook_outbox (tenant, id)
    WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL
      AND tenant <> '' AND tenant <> '!operator';

-- Events and deliveries of one stream (?stream_id=, the dashboard's search), of one tenant
-- or of every tenant. Not the rows whose stream id is longer than a btree entry can hold
-- (a plain SQL INSERT, or a first release's, could write one; enqueue and the API refuse
-- over 500 characters, at most 2,000 bytes): one such row would fail the build, every time.
-- The lists' filter names the same bound, so a search uses these indexes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_outbox_stream_events_idx
    ON webhook_outbox (stream_id, tenant, id)
    WHERE event_id IS NULL AND tenant <> '!operator' AND octet_length(stream_id) <= 2000;
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_outbox_stream_deliveries_idx
    ON webhook_outbox (stream_id, tenant, id)
    WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL
      AND octet_length(stream_id) <= 2000;

-- A tenant's events of one type (?event_type=).
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_outbox_tenant_type_events_idx
    ON webhook_outbox (tenant, event_type, id)
    WHERE event_id IS NULL AND tenant <> '' AND tenant <> '!operator';

-- Not here: a tenant's backlog and its attempts in a window (the statistics) by tenant.
-- Two indexes over every pending and every processed row doubled the database's CPU per
-- delivery at WEBHOOK_BATCH_SIZE=100 and cost a third of the throughput
-- (docs/performance.md, twenty-second pass); a tenant's statistics read its share of the
-- window's rows instead.

-- A tenant's dead letters in a window, whatever became of them since (the series).
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_dead_letter_tenant_dead_at_idx
    ON webhook_dead_letter (tenant, dead_at);
