-- The heads of ordered streams that are active now (due, in flight, or waiting to retry),
-- in the claim's order: a batch that routes events sends the due ones in the room its own
-- routed deliveries leave (route_events), so an ordered stream's delivery does not cost a
-- claim transaction of its own. At most one entry per (endpoint, stream), and none for
-- unordered endpoints or the event rows: it costs an outbox without ordered endpoints
-- nothing.
CREATE INDEX webhook_outbox_heads_due_idx ON webhook_outbox (created_at, id)
    WHERE NOT processed AND stream_seq IS NOT NULL AND hold IS NULL;
