-- The key of a partitioned outbox (SPEC 16, `fluxora-webhooks migrate --partitioned`):
-- when the row was written. It never changes (a retry, a routed delivery and a replay are
-- rows of their own, written now), so a time range's partition only ever receives rows of
-- that range and is done once they are processed. Every query that names a row by its id
-- names its partition_at too, so a partitioned outbox looks in one partition only; on an
-- ordinary table it is just one more column. A stable default: no table rewrite.
ALTER TABLE webhook_outbox ADD COLUMN partition_at timestamptz NOT NULL DEFAULT now();
