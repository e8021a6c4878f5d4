-- The management API's lists of one tenant's events and of one endpoint's deliveries read
-- one page, however many rows other tenants and endpoints have. Before this, both walked
-- the outbox newest first until a page of matches was found: a small tenant's portal
-- among many large ones read most of the outbox for each page.
--
-- Each index holds only the rows its list reads, and leaves out the default tenant and
-- the built-in endpoints: their rows are the event rows themselves (the default endpoint's
-- deliveries), the bulk of a single-consumer outbox, where the newest-first walk finds a
-- page at once; so a deployment without tenants writes no entry to either.
CREATE INDEX webhook_outbox_tenant_events_idx ON webhook_outbox (tenant, id)
    WHERE event_id IS NULL AND tenant <> '' AND tenant <> '!operator';
CREATE INDEX webhook_outbox_endpoint_deliveries_idx ON webhook_outbox (endpoint_id, id)
    WHERE attempt = 1 AND NOT replay AND endpoint_id IS NOT NULL
      AND endpoint_id <> 'default' AND endpoint_id <> 'operator';
