-- The consumer's inbox (SPEC 17), in the consumer's own database: one row per delivery id
-- received. Not part of the outbox migrations: the consumer's database has no outbox.

-- name: inbox_lock
-- Concurrent installs: CREATE ... IF NOT EXISTS alone can still collide on the catalog.
SELECT pg_advisory_xact_lock(%(key)s);

-- name: inbox_shape
-- An existing webhook_inbox (no row when there is none): delivery_id's type as PostgreSQL
-- writes it (NULL: no such column), whether that type holds every id receive stores (text,
-- or varchar unbounded or as long as receive's longest id: receive binds the id as untyped
-- text, so another type would cast it and refuse some ids, or all), and a key on it
-- that ON CONFLICT (delivery_id) can use (unique, immediate, valid, on that column alone,
-- not partial, not an expression).
SELECT
    (
        SELECT format_type(atttypid, atttypmod) FROM pg_attribute
        WHERE attrelid = t.oid AND attname = 'delivery_id' AND NOT attisdropped
    ),
    EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = t.oid AND attname = 'delivery_id' AND NOT attisdropped
          AND (atttypid = 'pg_catalog.text'::regtype
               OR (atttypid = 'pg_catalog.varchar'::regtype
                   AND (atttypmod < 0 OR atttypmod - 4 >= %(id_chars)s)))
    ),
    EXISTS (
        SELECT 1 FROM pg_index i
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
        WHERE i.indrelid = t.oid AND i.indisunique AND i.indimmediate AND i.indisvalid
          AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL
          AND a.attname = 'delivery_id'
    ),
    -- The columns install adds to it (it says which).
    ARRAY(
        SELECT wanted.name FROM (VALUES (1, 'event_type'), (2, 'attempt'), (3, 'received_at'))
            AS wanted (n, name)
        WHERE NOT EXISTS (
            SELECT 1 FROM pg_attribute
            WHERE attrelid = t.oid AND attname = wanted.name AND NOT attisdropped
        )
        ORDER BY wanted.n
    )
FROM (SELECT to_regclass('webhook_inbox') AS oid) t
WHERE t.oid IS NOT NULL;

-- name: inbox_install
-- Idempotent, and safe to run again after an upgrade. A table made by hand is completed
-- first (inbox_add_columns); a missing primary key is not added: receive names it.
CREATE TABLE IF NOT EXISTS webhook_inbox (
    delivery_id  text PRIMARY KEY,
    event_type   text,
    attempt      integer,
    received_at  timestamptz NOT NULL DEFAULT now()
);
-- Prune deletes the oldest ids first, in bounded batches. A timestamp that only grows
-- appends to the right edge of this index: cheap next to the primary key.
CREATE INDEX IF NOT EXISTS webhook_inbox_received_at_idx ON webhook_inbox (received_at);

-- name: inbox_add_columns
-- The columns receive writes or prune reads that inbox_shape found missing. Run only
-- then: ALTER TABLE locks the table even when it changes nothing.
ALTER TABLE webhook_inbox
    ADD COLUMN IF NOT EXISTS event_type text,
    ADD COLUMN IF NOT EXISTS attempt integer,
    ADD COLUMN IF NOT EXISTS received_at timestamptz NOT NULL DEFAULT now();

-- name: inbox_receive
-- In the caller's transaction. A concurrent transaction that inserted the same id and has
-- not finished makes this one wait: its commit turns this into a conflict (no row
-- returned), its rollback lets this insert go through. It returns the transaction's id
-- (the top-level one, a savepoint's too), which inbox_transaction compares, and no column:
-- nothing is read back (no SELECT on one needed, no time read in the session's DateStyle).
INSERT INTO webhook_inbox (delivery_id, event_type, attempt)
VALUES (%(delivery_id)s, %(event_type)s, %(attempt)s)
ON CONFLICT (delivery_id) DO NOTHING
RETURNING pg_current_xact_id()::text;

-- name: inbox_transaction
-- The current transaction's id, if it has one: another than inbox_receive returned means
-- the transaction that recorded the id ended (a COMMIT or ROLLBACK run as SQL), and a
-- later statement began a new one (psycopg does, on a connection not in autocommit mode).
-- And whether every id it recorded is still there: a savepoint rolled back takes its ids
-- with it (the ids are distinct: one transaction records an id once).
SELECT pg_current_xact_id_if_assigned()::text,
       %(delivery_ids)s::text[] IS NULL
       OR (SELECT count(*) FROM webhook_inbox WHERE delivery_id = ANY(%(delivery_ids)s::text[]))
          = cardinality(%(delivery_ids)s::text[]);

-- name: inbox_current_transaction
-- After a copy received again: the current transaction's id, if it has one, to tell
-- whether the ids recorded earlier on the connection belong to it.
SELECT pg_current_xact_id_if_assigned()::text;

-- name: inbox_prune
-- One bounded batch, oldest first. SKIP LOCKED: never waits on a row someone else holds.
WITH gone AS (
    DELETE FROM webhook_inbox
    WHERE delivery_id IN (
        SELECT delivery_id FROM webhook_inbox
        WHERE received_at < %(cutoff)s
        ORDER BY received_at
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: inbox_prune_count
SELECT count(*) FROM webhook_inbox WHERE received_at < %(cutoff)s;
