-- The producers' wake-up NOTIFY, switchable: `fluxora.notify = off` leaves it out.
--
-- A transaction that notifies holds one cluster-wide lock from before its commit record
-- until after it (PostgreSQL queues notifications in commit order), so producers that
-- notify commit one at a time: they share no WAL flush and no wait for a synchronous
-- standby (docs/scaling.md, "What limits it first"). Where producers commit more events
-- than that allows, the wake-up can be left out, for a database or a role
-- (`ALTER DATABASE app SET fluxora.notify = off`, `ALTER ROLE ... SET ...`), for a session
-- or for one transaction (`SET LOCAL fluxora.notify = off`, a bulk import, say). Idle
-- dispatchers then find new events within WEBHOOK_POLL_INTERVAL_MS instead of at once;
-- busy ones claim again at once either way. Unset, or any other value, notifies as before.
CREATE OR REPLACE FUNCTION webhook_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF lower(coalesce(current_setting('fluxora.notify', true), '')) NOT IN ('off', 'false', '0')
       AND EXISTS (SELECT 1 FROM inserted WHERE created_at <= now()) THEN
        PERFORM pg_notify('webhook_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;
