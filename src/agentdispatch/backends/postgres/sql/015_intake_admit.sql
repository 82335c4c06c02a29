-- The intake request path in one statement (one round trip, autocommit):
-- the receipt under its unique source identity, the agent's backlog slot and
-- the WorkItem (dispatch_submit_new), or the original answer of a duplicate.
-- Run as some ten statements from a gateway thread each, intakes spent most
-- of their time in round trips, idle in transaction, behind the gateway's
-- other threads.
--
-- The commit is asynchronous: a commit that notifies (the new queue row wakes
-- workers) holds a database-wide lock until it ends, so flushing here made
-- intakes take turns at the disk. The caller answers 200 only after a flush
-- of the WAL that began after this commit (one flush shared by the gateway's
-- concurrent intakes), so an update answered 200 is on disk.
--
-- p_receipt: the receipt's columns (received_at is set here, on the database
-- clock, and copied into the envelope); p_channel: the channel whose route
-- names the agent (NULL: no agent); p_accept: create the WorkItem planned in
-- p_items/p_events/p_queue, its agent_name set here from the route.
-- outcome: accepted | duplicate | backlog_full | queue_full | exists (a
-- WorkItem has the id but no receipt does: nothing written, the caller takes
-- the general path).
CREATE OR REPLACE FUNCTION dispatch_intake_admit(
    p_receipt json, p_channel text, p_accept boolean, p_bound integer,
    p_max bigint, p_at double precision, p_items json, p_events json, p_queue json
)
RETURNS TABLE (outcome text, agent text, answer_status integer, answer_type text, answer_body text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r intake_receipts;
    old intake_receipts;
    v_now double precision := extract(epoch FROM clock_timestamp())::float8;
    v_sub record;
BEGIN
    r := json_populate_record(NULL::intake_receipts, p_receipt);
    SELECT * INTO old FROM intake_receipts i WHERE i.connector = r.connector AND i.source_id = r.source_id;
    IF NOT FOUND THEN
        r.agent := '';
        IF p_channel IS NOT NULL THEN
            r.agent := coalesce((SELECT t.agent FROM intake_routes t
                                 WHERE t.installation_id = r.installation_id AND t.channel IN (p_channel, '*')
                                 ORDER BY CASE WHEN t.channel = '*' THEN 1 ELSE 0 END LIMIT 1), '');
        END IF;
        r.received_at := v_now;
        IF r.envelope IS NOT NULL THEN
            r.envelope := jsonb_set(r.envelope::jsonb, '{received_at}', to_jsonb(v_now))::text;
        END IF;
        -- The receipt first: a concurrent copy of the same update waits here
        -- for the first to end, and then answers as its duplicate.
        INSERT INTO intake_receipts
            (id, connector, source_id, installation_id, tenant, state, reason, job_id, agent, conversation, sender,
             message_key, body_sha256, body_size, envelope, raw, answer_status, answer_type, answer_body, retry_num,
             retry_reason, received_at)
        VALUES (r.id, r.connector, r.source_id, r.installation_id, r.tenant, r.state, r.reason, r.job_id, r.agent,
                r.conversation, r.sender, r.message_key, r.body_sha256, r.body_size, r.envelope, r.raw,
                r.answer_status, r.answer_type, r.answer_body, r.retry_num, r.retry_reason, r.received_at)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            IF p_accept THEN
                IF dispatch_intake_backlog(r.agent, p_bound, r.job_id) >= p_bound THEN
                    DELETE FROM intake_receipts i WHERE i.id = r.id;
                    RETURN QUERY SELECT 'backlog_full'::text, r.agent, 0, ''::text, ''::text;
                    RETURN;
                END IF;
                SELECT * INTO v_sub FROM dispatch_submit_new(
                    p_max, p_at,
                    (SELECT json_agg(jsonb_set(x::jsonb, '{agent_name}', to_jsonb(r.agent))) FROM json_array_elements(p_items) x),
                    p_events, p_queue);
                IF v_sub.outcome <> 'ok' THEN
                    -- Nothing of the WorkItem was written; the slot taken
                    -- above names no active item, so it is free again.
                    DELETE FROM intake_receipts i WHERE i.id = r.id;
                    RETURN QUERY SELECT (CASE WHEN v_sub.outcome = 'full' THEN 'queue_full' ELSE v_sub.outcome END),
                                        r.agent, 0, ''::text, ''::text;
                    RETURN;
                END IF;
                -- dispatch_submit_new asked for a synchronous commit: the caller flushes instead.
                PERFORM set_config('synchronous_commit', 'off', true);
            END IF;
            RETURN QUERY SELECT 'accepted'::text, r.agent, r.answer_status, r.answer_type, r.answer_body;
            RETURN;
        END IF;
        SELECT * INTO old FROM intake_receipts i WHERE i.connector = r.connector AND i.source_id = r.source_id;
        IF NOT FOUND THEN
            -- The colliding row holds the same receipt id under another source
            -- identity (a hash collision of ids): the general path reports it.
            RETURN QUERY SELECT 'exists'::text, ''::text, 0, ''::text, ''::text;
            RETURN;
        END IF;
    END IF;
    IF old.body_sha256 <> r.body_sha256 THEN
        INSERT INTO intake_mismatches (receipt_id, body_sha256, at) VALUES (old.id, r.body_sha256, v_now);
        UPDATE intake_receipts i SET mismatches = i.mismatches + 1 WHERE i.id = old.id;
    END IF;
    RETURN QUERY SELECT 'duplicate'::text, old.agent, old.answer_status, old.answer_type, old.answer_body;
END $$;
