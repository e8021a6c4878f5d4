-- A delivery is parked only while its endpoint is disabled *and stays so until the parking
-- commits*. Each statement that parks a row read the endpoint's state in its snapshot: one
-- that read "disabled" just before an enable committed wrote its parked row after the
-- enable had unparked what it could see, and nothing ever looked at that row again (an
-- enabled endpoint with a delivery parked for good). The statements that park now ask this
-- function instead, only for an endpoint their snapshot shows disabled (it never runs for
-- an enabled one): it locks the endpoint's row FOR SHARE until the parking transaction
-- ends, so an enable waits for it and then unparks that row too; an endpoint enabled since
-- the snapshot answers false (the lock re-reads the row), and the row is written due.
-- FOR SHARE conflicts with the enable's UPDATE only: the dispatchers' own reads of the
-- endpoint table do not wait.
CREATE OR REPLACE FUNCTION webhook_endpoint_parks(endpoint text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM webhook_endpoints
    WHERE id = endpoint AND state <> 'enabled'
    FOR SHARE;
    RETURN FOUND;
END
$$;
