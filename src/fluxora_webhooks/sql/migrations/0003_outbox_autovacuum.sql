-- Rows just marked processed leave dead entries in the claim's partial index until VACUUM
-- removes them, and the claim walks over them (several ms per claim at a million). The
-- default autovacuum threshold (20 % of the table) comes far too late for a table that
-- keeps its history: vacuum after 1 % of it changed, at least every 1000 rows.
ALTER TABLE webhook_outbox SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);
