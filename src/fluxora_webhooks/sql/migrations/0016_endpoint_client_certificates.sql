-- An endpoint's own TLS client certificate, presented to its consumer when the consumer
-- asks for one (in place of WEBHOOK_TLS_CLIENT_CERT's): the PEM chain as given, and its
-- private key, a secret stored as the signing secrets are (sealed with
-- WEBHOOK_ENCRYPTION_KEY when one is set: fxenc:v1:..., bound to the endpoint's id; plain
-- PEM otherwise). Both or neither. Nullable columns with no default: no table rewrite.
ALTER TABLE webhook_endpoints
    ADD COLUMN client_cert text,
    ADD COLUMN client_key text,
    ADD CONSTRAINT webhook_endpoints_client_cert_pair
        CHECK ((client_cert IS NULL) = (client_key IS NULL));
