-- A submission of new items in one statement: one round trip (autocommit)
-- before the caller has its handle, instead of a read, then a write with the
-- COMMIT. The engine plans the rows in the client without reading (every id
-- new, the client's clock p_at); here they are checked and written:
--   * any id that exists already: nothing is written, the answer is 'exists'
--     and the caller takes the general path (which answers with that item);
--   * compare-and-admit as the general path does (dispatch_admission): over
--     the bound, nothing is written and the answer is 'full' with the depth;
--   * else the rows are written with their times moved onto the database
--     clock (by the returned shift, which the caller applies to its copies)
--     and sequence numbers drawn in submission order (returned in that order).
-- The statement triggers (depth, fairness rows, NOTIFY) run as for any insert.
CREATE OR REPLACE FUNCTION dispatch_submit_new(
    p_max bigint, p_at double precision, p_items json, p_events json, p_queue json
)
RETURNS TABLE (outcome text, depth bigint, shift double precision, seqs bigint[])
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ids text[];
    v_n integer;
BEGIN
    -- An accepted submission is durable before the caller hears of it, whatever
    -- the server's default.
    PERFORM set_config('synchronous_commit', 'on', true);
    v_ids := ARRAY(SELECT i.id FROM json_populate_recordset(NULL::work_items, p_items) i);
    v_n := cardinality(v_ids);
    IF EXISTS (SELECT 1 FROM work_items w WHERE w.id = ANY(v_ids)) THEN
        outcome := 'exists';
        RETURN NEXT;
        RETURN;
    END IF;
    depth := dispatch_admission(v_n, p_max);
    IF depth + v_n > p_max THEN
        outcome := 'full';
        RETURN NEXT;
        RETURN;
    END IF;
    shift := extract(epoch FROM clock_timestamp())::float8 - p_at;
    seqs := ARRAY(SELECT nextval(pg_get_serial_sequence('work_items', 'seq')) FROM generate_series(1, v_n));
    WITH items AS (
        INSERT INTO work_items (
            seq, id, tenant, session_id, session_ref, kind, agent_name, payload, priority, status,
            reason, attempts, max_attempts, dependencies, deadline_unix, created_at, ready_at,
            updated_at, lease_epoch
        )
        SELECT seqs[i.ordinality], i.id, i.tenant, i.session_id, i.session_ref, i.kind, i.agent_name, i.payload,
               i.priority, i.status, i.reason, i.attempts, i.max_attempts, i.dependencies, i.deadline_unix,
               i.created_at + shift, i.ready_at + shift, i.updated_at + shift, i.lease_epoch
        FROM json_populate_recordset(NULL::work_items, p_items) WITH ORDINALITY AS i
        RETURNING id, seq
    ), events AS (
        INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
        SELECT e.job_id, e.at + shift, e.event, e.status, e.attempt, e.epoch, e.detail
        FROM json_populate_recordset(NULL::work_events, p_events) AS e
    )
    INSERT INTO agent_dispatch_queue (
        job_id, item_seq, session_ref, tenant_ref, group_ref, priority, deadline_unix, envelope,
        enqueued_at, visible_at
    )
    SELECT q.job_id, items.seq, q.session_ref, q.tenant_ref, q.group_ref, q.priority, q.deadline_unix,
           jsonb_set(q.envelope::jsonb, '{enqueued_at}', ((q.enqueued_at + shift)::text)::jsonb)::text,
           q.enqueued_at + shift, q.visible_at + shift
    FROM json_populate_recordset(NULL::agent_dispatch_queue, p_queue) WITH ORDINALITY AS q
    JOIN items ON items.id = q.job_id
    ORDER BY q.ordinality;
    outcome := 'ok';
    RETURN NEXT;
END $$;

-- The fair claim of 004 keeps its body under a new name (once: re-applying
-- these migrations from an older version re-creates it in 004 first).
DO $$
BEGIN
    IF position('dispatch_claim_fair' IN (
        SELECT p.prosrc FROM pg_proc p
        WHERE p.oid = 'dispatch_claim(text, double precision, integer, boolean)'::regprocedure)) = 0 THEN
        DROP FUNCTION IF EXISTS dispatch_claim_fair(text, double precision, integer, boolean);
        ALTER FUNCTION dispatch_claim(text, double precision, integer, boolean) RENAME TO dispatch_claim_fair;
    END IF;
END $$;
-- The fair claim's statements run with their generic plans: the planner's
-- choice ("auto") re-planned its big statement at every call once the
-- fairness tables held many tenants (about 1.5 ms a claim on a small VM). The
-- plans are index scans either way (the index-scan test and the 1,000,000-row
-- benchmark print them).
ALTER FUNCTION dispatch_claim_fair(text, double precision, integer, boolean)
    SET plan_cache_mode = force_generic_plan;

-- An idle worker's claim on an empty queue returns at once: no fairness row
-- means no queue row (a writer adds its fairness rows in the transaction that
-- adds the queue rows; a pruner removes them only when no queue row is left).
CREATE OR REPLACE FUNCTION dispatch_claim(p_owner text, p_vis double precision, p_n integer, p_read boolean)
RETURNS TABLE (
    id bigint, envelope text, deliveries integer, claimed_at double precision, job_id text,
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The top priority, as the claim reads it (an index scan, whatever the table's size).
    IF (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1) IS NOT NULL THEN
        RETURN QUERY SELECT * FROM dispatch_claim_fair(p_owner, p_vis, p_n, p_read);
    END IF;
END $$;

-- Idle workers wake one waiter per notification; the queue_added trigger's
-- notification (payload '') says "a row came". A statement that adds several
-- rows also says how many, so as many idle waiters wake to claim them (no
-- woken waiter has to wake the next one on the chance of more).
CREATE OR REPLACE FUNCTION dispatch_queue_added_many() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    n bigint := (SELECT count(*) FROM added);
BEGIN
    IF n > 1 THEN
        PERFORM pg_notify('agent_dispatch_queue', n::text);
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS queue_added_many ON agent_dispatch_queue;
CREATE TRIGGER queue_added_many AFTER INSERT ON agent_dispatch_queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_added_many();
