-- Lookups that stay bounded however deep a backlog grows.
--
-- Ordered streams (SPEC 14): choosing a stream's next head reads a few index entries,
-- however deep the stream's backlog. Before this, the head was found by sorting every
-- pending delivery of the stream by (stream_seq, id), and "no delivery of the stream is
-- active" was checked by reading each of them (hold is not in the stream index): one
-- completed head of a stream 100,000 deliveries deep read all 100,000, and the sweep for
-- stuck streams did that for every waiting delivery.
--
-- The stream index now carries the id, so ORDER BY stream_seq, id LIMIT 1 is one index
-- probe; and the active deliveries of ordered streams (due, in flight, leased, retrying:
-- hold IS NULL; normally just the head of each stream) have an index of their own.
DROP INDEX webhook_outbox_stream_idx;
CREATE INDEX webhook_outbox_stream_idx
    ON webhook_outbox (endpoint_id, stream_id, stream_seq, id)
    WHERE NOT processed AND stream_seq IS NOT NULL;
CREATE INDEX webhook_outbox_stream_active_idx
    ON webhook_outbox (endpoint_id, stream_id)
    WHERE NOT processed AND stream_seq IS NOT NULL AND hold IS NULL;

-- `dlq list --tenant` (and the API's tenant-scoped dead letters): a tenant's dead letters,
-- newest first, without walking every other tenant's.
CREATE INDEX webhook_dead_letter_tenant_idx ON webhook_dead_letter (tenant, dead_at, id)
    WHERE state = 'dead';
