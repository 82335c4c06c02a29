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
