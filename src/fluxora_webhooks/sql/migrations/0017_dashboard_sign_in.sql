-- The dashboard's sign-in form (api/dashboard/signin.py): the value it carries is issued by
-- the server, an HMAC over a random part and its issue time, valid for an hour and used
-- once. The key is made here, once, so every API process serving one dashboard (behind a
-- load balancer) checks the values of every other; it is read by the API only. A used
-- value is kept (its sha256) until it would have expired anyway: a sign-in with it again
-- is refused. Not touched by the dispatcher.
CREATE TABLE webhook_api_login_key (
    id         smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    -- 32 random bytes (gen_random_uuid() draws from PostgreSQL's strong random source).
    key        bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO webhook_api_login_key (key)
VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));

CREATE TABLE webhook_api_login_used (
    value_hash text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
-- Expired rows are removed by the sign-ins that write new ones.
CREATE INDEX webhook_api_login_used_expires_idx ON webhook_api_login_used (expires_at);
