-- The acknowledgement's pruning of emptied fairness rows runs with generic
-- plans, as the fair claim does since 005: with "auto" the planner re-planned
-- its four statements (their arguments are arrays) at every call, which was
-- most of its cost (1.3 -> 0.5 ms a call on a small VM at light load, where
-- every acknowledgement empties its session's group). Its plans are index
-- probes either way.
ALTER FUNCTION dispatch_fair_prune(integer[], text[]) SET plan_cache_mode = force_generic_plan;

-- n item sequence numbers in one call. nextval() of the sequence's name cast
-- the text to the sequence at every row (a catalog lookup each: about 8 ms of
-- a 1,000-item submission's read on a small VM); the sequence is looked up once.
CREATE OR REPLACE FUNCTION dispatch_next_seqs(p_n integer) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_seq regclass := pg_get_serial_sequence('work_items', 'seq')::regclass;
BEGIN
    RETURN ARRAY(SELECT nextval(v_seq) FROM generate_series(1, p_n));
END $$;

-- The read half of a submission (001), drawing its sequence numbers as above.
CREATE OR REPLACE FUNCTION dispatch_submit_read(p_ids text[], p_n integer, p_max bigint)
RETURNS TABLE (now double precision, depth bigint, seqs bigint[], items json)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    depth := dispatch_admission(p_n, p_max);
    now := extract(epoch FROM clock_timestamp())::float8;
    seqs := dispatch_next_seqs(p_n);
    items := (SELECT json_agg(row_to_json(w)) FROM (
        SELECT * FROM work_items WHERE id = ANY(p_ids) ORDER BY id FOR UPDATE) w);
    RETURN NEXT;
END $$;

-- The enqueue trigger (001) with every fairness row it checks, locks or moves
-- found by an index probe per key. Its "IN (SELECT ... FROM added)" lock check
-- was planned as a hash join over a sequential scan of the whole fairness
-- table once a statement added a few hundred rows: every chunk of a bulk
-- submission read every queued session's row (quadratic in the backlog).
-- Same protocol: groups before tenants, keys in order, re-insert what a pruner
-- deleted meanwhile; one notification per transaction.
CREATE OR REPLACE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    want bigint;
    got bigint;
    d record;
BEGIN
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
        SELECT priority, group_ref, min(tenant_ref), coalesce(min(deadline_unix), 'Infinity'::double precision), min(id)
        FROM added GROUP BY priority, group_ref ORDER BY priority, group_ref
        ON CONFLICT (priority, group_ref) DO NOTHING;
        got := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added ORDER BY 1, 2) k
                CROSS JOIN LATERAL (
                    SELECT 1 FROM dispatch_fair_groups g
                    WHERE g.priority = k.priority AND g.group_ref = k.group_ref
                    FOR KEY SHARE OF g) x);
        EXIT WHEN got >= want;  -- else a pruner deleted one meanwhile: insert it again
    END LOOP;
    -- An earlier deadline moves the group forward (its own row only, found by
    -- key: a join could scan the table, and a concurrent claim's update of the
    -- row is followed by key).
    FOR d IN SELECT priority, group_ref, min(deadline_unix) AS k FROM added
             WHERE deadline_unix IS NOT NULL GROUP BY priority, group_ref ORDER BY priority, group_ref LOOP
        UPDATE dispatch_fair_groups g SET deadline_key = d.k
        WHERE g.priority = d.priority AND g.group_ref = d.group_ref AND g.deadline_key > d.k;
    END LOOP;
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_tenants (priority, tenant_ref, since)
        SELECT priority, tenant_ref, min(id)
        FROM added GROUP BY priority, tenant_ref ORDER BY priority, tenant_ref
        ON CONFLICT (priority, tenant_ref) DO NOTHING;
        got := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added ORDER BY 1, 2) k
                CROSS JOIN LATERAL (
                    SELECT 1 FROM dispatch_fair_tenants t
                    WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
                    FOR KEY SHARE OF t) x);
        EXIT WHEN got >= want;
    END LOOP;
    PERFORM pg_notify('agent_dispatch_queue', '');
    RETURN NULL;
END $$;
