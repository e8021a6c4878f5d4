-- API tokens and dashboard sessions (SPEC 15), used by tokens.py. A token is found by the
-- sha256 of what the client sent; only live (not revoked) tokens authenticate.

-- name: token_insert
INSERT INTO webhook_api_tokens (name, token_hash, tenant, read_only)
VALUES (%(name)s, %(hash)s, %(tenant)s, %(read_only)s)
ON CONFLICT (name) DO NOTHING
RETURNING id, name, tenant, read_only, created_at, last_used_at, revoked_at;

-- name: token_list
SELECT id, name, tenant, read_only, created_at, last_used_at, revoked_at
FROM webhook_api_tokens
ORDER BY name;

-- name: token_revoke
UPDATE webhook_api_tokens SET revoked_at = now()
WHERE name = %(name)s AND revoked_at IS NULL
RETURNING id, name, tenant, read_only, created_at, last_used_at, revoked_at;

-- name: token_exists
SELECT revoked_at IS NOT NULL FROM webhook_api_tokens WHERE name = %(name)s;

-- name: token_lookup
-- The live token with this hash, and whether its last use is to be recorded (at most once
-- a minute: token_touch, a statement of its own, so that a read-only database still
-- answers reads).
SELECT id, name, token_hash, tenant, read_only,
       last_used_at IS NULL OR last_used_at < now() - interval '1 minute' AS stale
FROM webhook_api_tokens
WHERE token_hash = %(hash)s AND revoked_at IS NULL;

-- name: token_touch
UPDATE webhook_api_tokens SET last_used_at = now()
WHERE id = %(id)s AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute');

-- name: session_insert
WITH expired AS (
    -- Sign-ins clean up after themselves: no background job needed.
    DELETE FROM webhook_api_sessions WHERE expires_at < now()
)
INSERT INTO webhook_api_sessions (id_hash, token_id, csrf, expires_at)
VALUES (%(id_hash)s, %(token_id)s, %(csrf)s, now() + %(ttl_s)s * interval '1 second');

-- name: session_lookup
-- A session that has not expired, of a token that is still live.
SELECT t.id, t.name, t.tenant, t.read_only, s.csrf
FROM webhook_api_sessions s
JOIN webhook_api_tokens t ON t.id = s.token_id AND t.revoked_at IS NULL
WHERE s.id_hash = %(id_hash)s AND s.expires_at > now();

-- name: session_delete
DELETE FROM webhook_api_sessions WHERE id_hash = %(id_hash)s;

-- name: session_delete_for_token
DELETE FROM webhook_api_sessions WHERE token_id = %(token_id)s;

-- name: login_key
SELECT key FROM webhook_api_login_key WHERE id = 1;

-- name: login_value_use
-- A sign-in's form value, recorded as used: no row returned when it already was.
WITH expired AS (
    DELETE FROM webhook_api_login_used WHERE expires_at < now()
)
INSERT INTO webhook_api_login_used (value_hash, expires_at)
VALUES (%(value_hash)s, to_timestamp(%(expires_at)s))
ON CONFLICT (value_hash) DO NOTHING
RETURNING 1;
