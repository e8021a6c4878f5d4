-- The management API and dashboard (SPEC 15): its tokens and the dashboard's sessions.
-- Neither table is touched by the dispatcher; no index is added to webhook_outbox (the
-- API's lists page by primary key and by the existing delivery_id and event_id indexes).

CREATE TABLE webhook_api_tokens (
    id           bigserial PRIMARY KEY,
    name         text NOT NULL UNIQUE,
    -- sha256 of the token, hex: the token itself is printed once and never stored.
    token_hash   text NOT NULL UNIQUE,
    -- NULL: an admin token (every tenant); '' the default tenant; else that tenant only.
    tenant       text,
    read_only    boolean NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- Written at most once a minute, so a busy client costs no write per request.
    last_used_at timestamptz,
    revoked_at   timestamptz
);

-- A dashboard sign-in: the browser holds a random session id in an HttpOnly cookie; the
-- table holds its sha256, the token it was opened with and the session's CSRF token.
-- Revoking the token ends its sessions (they are looked up joined to a live token).
CREATE TABLE webhook_api_sessions (
    id_hash      text PRIMARY KEY,
    token_id     bigint NOT NULL REFERENCES webhook_api_tokens (id) ON DELETE CASCADE,
    csrf         text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX webhook_api_sessions_expires_idx ON webhook_api_sessions (expires_at);
