-- Items by id are found by one index probe per id, and these functions keep
-- one generic plan per statement. Written as "id = ANY(ids)", a generic plan
-- guesses ten ids: it read the whole of work_items while the table held up
-- to some ten thousand rows, so PL/pgSQL, which compares it with plans made
-- for the actual ids, planned those statements again at every call (some
-- 200 us each, the read of a batch's items twice per commit). Each id is now
-- a keyed lateral probe, which no plan turns into a scan (a subquery that
-- locks or has a LIMIT is not flattened into a join), and the plans are
-- forced generic, as the fair claim's are. Locks are still taken in id
-- order; duplicate ids still give one row.
CREATE OR REPLACE FUNCTION dispatch_submit_read(p_ids text[], p_n integer, p_max bigint)
RETURNS TABLE (now double precision, depth bigint, seqs bigint[], items json)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    depth := dispatch_admission(p_n, p_max);
    now := extract(epoch FROM clock_timestamp())::float8;
    seqs := dispatch_next_seqs(p_n);
    items := (SELECT json_agg(row_to_json(w) ORDER BY w.id)
              FROM (SELECT DISTINCT k.id FROM unnest(p_ids) AS k(id) ORDER BY 1) k
              CROSS JOIN LATERAL (SELECT * FROM work_items w WHERE w.id = k.id FOR UPDATE) w);
    RETURN NEXT;
END $$;

CREATE OR REPLACE FUNCTION dispatch_submit_new(
    p_max bigint, p_at double precision, p_items json, p_events json, p_queue json
)
RETURNS TABLE (outcome text, depth bigint, shift double precision, seqs bigint[])
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_ids text[];
    v_n integer;
BEGIN
    -- An accepted submission is durable before the caller hears of it, whatever
    -- the server's default.
    PERFORM set_config('synchronous_commit', 'on', true);
    v_ids := ARRAY(SELECT i.id FROM json_populate_recordset(NULL::work_items, p_items) i);
    v_n := cardinality(v_ids);
    IF EXISTS (SELECT 1 FROM unnest(v_ids) AS k(id)
               CROSS JOIN LATERAL (SELECT 1 FROM work_items w WHERE w.id = k.id LIMIT 1) x) THEN
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

CREATE OR REPLACE FUNCTION dispatch_items_read(p_ids text[])
RETURNS TABLE (now double precision, item json, leaf boolean)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    PERFORM 1 FROM (SELECT DISTINCT k.id FROM unnest(p_ids) AS k(id) ORDER BY 1) k
    CROSS JOIN LATERAL (SELECT 1 FROM work_items w WHERE w.id = k.id FOR UPDATE) x;
    RETURN QUERY
    SELECT extract(epoch FROM clock_timestamp())::float8, row_to_json(w),
           NOT EXISTS (SELECT 1 FROM work_dependencies d WHERE d.depends_on = w.id)
    FROM (SELECT DISTINCT k.id FROM unnest(p_ids) AS k(id)) k
    CROSS JOIN LATERAL (SELECT * FROM work_items w WHERE w.id = k.id LIMIT 1) w;
END $$;
