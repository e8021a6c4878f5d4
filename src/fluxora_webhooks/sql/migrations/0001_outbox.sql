-- The outbox, its attempt history and the dead letters.
-- Producers INSERT (stream_id, event_type, payload); every other column has a default.

CREATE TABLE webhook_outbox (
    id              bigserial PRIMARY KEY,
    stream_id       text NOT NULL,
    event_type      text NOT NULL,
    payload         jsonb NOT NULL,
    -- Doubles as "due at": a retry or deferral is a row due later.
    created_at      timestamptz NOT NULL DEFAULT now(),
    processed       boolean NOT NULL DEFAULT false,
    -- Stable across retries and replays: consumers de-duplicate on it.
    delivery_id     uuid NOT NULL DEFAULT gen_random_uuid(),
    attempt         integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    -- When the event was first enqueued (carried over to retry rows).
    enqueued_at     timestamptz NOT NULL DEFAULT now(),
    deferrals       integer NOT NULL DEFAULT 0,
    -- The outcome of this row's attempt, written when it is marked processed.
    processed_at    timestamptz,
    outcome         text CHECK (outcome IN ('delivered', 'retry', 'dead_letter')),
    status_code     integer,
    error           text,
    response_body   text,
    duration_ms     double precision
);

-- The claim: due, unprocessed rows in order. Stays small however many processed rows exist.
CREATE INDEX webhook_outbox_due_idx ON webhook_outbox (created_at, id) WHERE NOT processed;
CREATE INDEX webhook_outbox_delivery_idx ON webhook_outbox (delivery_id);
-- Retention prunes processed rows oldest first.
CREATE INDEX webhook_outbox_processed_at_idx ON webhook_outbox (processed_at) WHERE processed;

CREATE TABLE webhook_dead_letter (
    id              bigserial PRIMARY KEY,
    delivery_id     uuid NOT NULL,
    stream_id       text NOT NULL,
    event_type      text NOT NULL,
    payload         jsonb NOT NULL,
    attempts        integer NOT NULL,
    reason          text NOT NULL,
    last_status     integer,
    last_error      text,
    last_response   text,
    enqueued_at     timestamptz NOT NULL,
    dead_at         timestamptz NOT NULL DEFAULT now(),
    -- 'dead' until replayed or purged; kept for the record until pruned.
    state           text NOT NULL DEFAULT 'dead' CHECK (state IN ('dead', 'replayed', 'purged')),
    state_changed_at timestamptz
);
CREATE INDEX webhook_dead_letter_dead_idx ON webhook_dead_letter (dead_at DESC, id DESC)
    WHERE state = 'dead';
CREATE INDEX webhook_dead_letter_delivery_idx ON webhook_dead_letter (delivery_id);

-- Wake dispatchers within milliseconds of a commit. Once per statement, not per row;
-- PostgreSQL folds identical notifications of one transaction into one.
-- Rows inserted due later (retries) do not wake anyone: the dispatcher sleeps until the
-- earliest due time it knows of.
CREATE FUNCTION webhook_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE created_at <= now()) THEN
        PERFORM pg_notify('webhook_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER webhook_outbox_notify_trg
    AFTER INSERT ON webhook_outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_outbox_notify();
