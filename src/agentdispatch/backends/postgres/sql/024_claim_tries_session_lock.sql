-- A claim only tries the session lock of the item it reads: another
-- transaction holding it is claiming a turn of that session right now, and
-- the item answers as blocked (busy, retried shortly) instead of waiting.
-- Claims of several delivered items (a Kafka batch, duplicate deliveries
-- after a broker restart) took row and session locks item by item in
-- delivery order and deadlocked one another; lease renewals queued behind
-- them until leases ran out. Items are now read in id order (as every batch
-- locks its rows) and no claim waits for a session lock, so no cycle forms.
CREATE OR REPLACE FUNCTION dispatch_item_read(p_id text, p_session boolean)
RETURNS TABLE (
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w work_items;
BEGIN
    now := extract(epoch FROM clock_timestamp())::float8;
    SELECT * INTO w FROM work_items WHERE id = p_id FOR UPDATE;
    IF FOUND THEN
        item := row_to_json(w);
        leaf := NOT EXISTS (SELECT 1 FROM work_dependencies d WHERE d.depends_on = p_id);
        IF p_session THEN
            -- Fleet-wide per-session exclusion, held to the end of the claim.
            IF NOT pg_try_advisory_xact_lock(hashtextextended('agentdispatch.session:' || w.session_ref, 0)) THEN
                blocker_status := 'leased';
                blocker_expires_at := now + 0.2;
                RETURN NEXT;
                RETURN;
            END IF;
            SELECT b.status, b.lease_expires_at INTO blocker_status, blocker_expires_at
            FROM work_items b
            WHERE b.session_ref = w.session_ref
              AND b.status IN ('submitted', 'ready', 'leased', 'running')
              AND b.id <> w.id
              AND (b.seq < w.seq OR b.status IN ('leased', 'running'))
            LIMIT 1;
        END IF;
    END IF;
    RETURN NEXT;
END $$;
