-- A replayed dead letter is gated like a retry (its consumer already failed it), so that
-- `dlq replay --all` after an outage respects the shared retry rate limit. Carried over to
-- the replay's own retry rows. A constant default: no table rewrite.
ALTER TABLE webhook_outbox ADD COLUMN replay boolean NOT NULL DEFAULT false;
