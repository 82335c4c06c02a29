-- Admission tokens (001 dispatch_admission, 003 dispatch_intake_backlog): far
-- from the bound, a caller that finds all 16 tokens taken now waits for one
-- of them instead of taking the path that holds every token. With more than
-- 16 concurrent submitters (a gateway runs 32 intake threads) that path was
-- taken at once by many callers: each waited for every token in turn and held
-- them all through its commit, so intakes ran one at a time and queued. One
-- token is held for one transaction, so waiting for it is short and keeps
-- the proof: at most 15 other holders are uncommitted. Near the bound the
-- exact path (every token) is unchanged.
CREATE OR REPLACE FUNCTION dispatch_admission(p_n integer, p_max bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    tokens CONSTANT integer := 16;
    per_token CONSTANT integer := 8;
    margin CONSTANT bigint := 16 * 8;
    space integer := hashtext('agentdispatch.admission:' || current_schema());
    first integer := mod(pg_backend_pid(), 16);
    depth bigint;
    held boolean := false;
BEGIN
    IF p_max IS NOT NULL THEN
        depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
        IF depth + p_n > p_max THEN
            RETURN depth;  -- refused on committed state (completions only lower it): no lock
        END IF;
        IF p_n <= per_token AND depth + 2 * margin <= p_max THEN
            FOR i IN 0 .. tokens - 1 LOOP
                held := pg_try_advisory_xact_lock(space, mod(first + i, tokens));
                EXIT WHEN held;
            END LOOP;
            IF NOT held THEN
                PERFORM pg_advisory_xact_lock(space, first);  -- one holder's transaction, not every token
            END IF;
            -- A fresh snapshot, taken while holding the token.
            depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
            IF depth + margin <= p_max THEN
                RETURN depth;
            END IF;
            RAISE EXCEPTION 'admission: the depth neared the bound; retry' USING ERRCODE = '40001';
        END IF;
    END IF;
    FOR i IN 0 .. tokens - 1 LOOP
        PERFORM pg_advisory_xact_lock(space, i);
    END LOOP;
    RETURN (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
END $$;

-- The per-agent intake backlog bound (256) without a wait. The 16 tokens of
-- 003 held every token near the bound, through the commit: the last 32
-- intakes before a full backlog, and every intake queued behind them (even
-- those refused in the end), committed one at a time. Now each admitted item
-- holds one of the agent's ``bound`` slot rows (its job id, written in the
-- intake transaction); a slot whose item is no longer active is free. An
-- intake locks a free slot with SKIP LOCKED, so concurrent intakes take
-- different slots and none waits for another; no free slot is a full backlog.
CREATE TABLE IF NOT EXISTS intake_backlog_slots (
    agent  text NOT NULL,
    slot   integer NOT NULL,
    job_id text,
    PRIMARY KEY (agent, slot)
);
-- Items admitted before this migration hold slots too.
INSERT INTO intake_backlog_slots (agent, slot, job_id)
SELECT agent_name, (row_number() OVER (PARTITION BY agent_name ORDER BY seq) - 1)::integer, id
FROM work_items
WHERE kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running')
ON CONFLICT DO NOTHING;

-- Returns the committed backlog when a slot was taken for p_job (below the
-- bound), else p_bound or more (refuse).
CREATE OR REPLACE FUNCTION dispatch_intake_backlog(p_agent text, p_bound integer, p_job text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n bigint;
    s record;
    after integer := -1;
BEGIN
    n := (SELECT count(*) FROM work_items
          WHERE agent_name = p_agent AND kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running'));
    IF n >= p_bound THEN
        RETURN n;  -- full on committed state (completions only lower it): no lock
    END IF;
    IF NOT EXISTS (SELECT 1 FROM intake_backlog_slots WHERE agent = p_agent AND slot = p_bound - 1) THEN
        INSERT INTO intake_backlog_slots (agent, slot)
        SELECT p_agent, g FROM generate_series(0, p_bound - 1) g ON CONFLICT DO NOTHING;
    END IF;
    LOOP
        -- Candidates by this statement's snapshot; the lock returns the
        -- slot's latest row, whose item is checked again below.
        SELECT b.slot, b.job_id INTO s FROM intake_backlog_slots b
        WHERE b.agent = p_agent AND b.slot > after AND b.slot < p_bound
          AND NOT EXISTS (SELECT 1 FROM work_items w WHERE w.id = b.job_id
                          AND w.status IN ('submitted', 'ready', 'leased', 'running'))
        ORDER BY b.slot LIMIT 1
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN greatest(n, p_bound);  -- every slot is held (or being taken)
        END IF;
        -- A fresh snapshot: an item admitted into this slot since the
        -- statement above began is seen now.
        IF NOT EXISTS (SELECT 1 FROM work_items w WHERE w.id = s.job_id
                       AND w.status IN ('submitted', 'ready', 'leased', 'running')) THEN
            UPDATE intake_backlog_slots SET job_id = p_job WHERE agent = p_agent AND slot = s.slot;
            RETURN n;
        END IF;
        after := s.slot;
    END LOOP;
END $$;

-- The token version (003): an older gateway fails on it loudly (503, the
-- provider retries) rather than bounding the backlog apart from the slots.
DROP FUNCTION IF EXISTS dispatch_intake_backlog(text, integer);
