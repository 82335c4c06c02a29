-- The backlog slot of an intake without a join against work_items. The
-- earlier search (an anti-join of the agent's slots with the active items)
-- was planned while work_items looked empty, and PL/pgSQL keeps that plan:
-- on a new database it scanned the whole table once per held slot, tens of
-- milliseconds an intake after a few thousand items. Now the agent's active
-- item ids are read once (the partial index work_items_intake_agent), a slot
-- is free when its item is not among them, and the search starts at a random
-- slot, so it skips about bound / free held slots rather than all of them.
--
-- Returns the committed backlog when a slot was taken for p_job (below the
-- bound), else p_bound or more (refuse).
CREATE OR REPLACE FUNCTION dispatch_intake_backlog(p_agent text, p_bound integer, p_job text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_active text[];
    n bigint;
    s record;
    v_start integer;
    v_after integer;
    v_below integer;
BEGIN
    v_active := ARRAY(SELECT w.id FROM work_items w
                      WHERE w.agent_name = p_agent AND w.kind = 'intake_turn'
                        AND w.status IN ('submitted', 'ready', 'leased', 'running'));
    n := cardinality(v_active);
    IF n >= p_bound THEN
        RETURN n;  -- full on committed state (completions only lower it): no lock
    END IF;
    IF NOT EXISTS (SELECT 1 FROM intake_backlog_slots WHERE agent = p_agent AND slot = p_bound - 1) THEN
        INSERT INTO intake_backlog_slots (agent, slot)
        SELECT p_agent, g FROM generate_series(0, p_bound - 1) g ON CONFLICT DO NOTHING;
    END IF;
    v_start := floor(random() * p_bound)::integer;
    -- Two passes: [v_start, p_bound), then [0, v_start).
    FOR pass IN 0..1 LOOP
        v_after := CASE WHEN pass = 0 THEN v_start - 1 ELSE -1 END;
        v_below := CASE WHEN pass = 0 THEN p_bound ELSE v_start END;
        LOOP
            -- Candidates by this statement's snapshot; the lock returns the
            -- slot's latest row, whose item is checked again below.
            SELECT b.slot, b.job_id INTO s FROM intake_backlog_slots b
            WHERE b.agent = p_agent AND b.slot > v_after AND b.slot < v_below
              AND (b.job_id IS NULL OR b.job_id <> ALL (v_active))
            ORDER BY b.slot LIMIT 1
            FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            -- A fresh snapshot: an item admitted into this slot since the
            -- active ids were read is seen now.
            IF s.job_id IS NULL OR NOT EXISTS (SELECT 1 FROM work_items w WHERE w.id = s.job_id
                                               AND w.status IN ('submitted', 'ready', 'leased', 'running')) THEN
                UPDATE intake_backlog_slots SET job_id = p_job WHERE agent = p_agent AND slot = s.slot;
                RETURN n;
            END IF;
            v_after := s.slot;
        END LOOP;
    END LOOP;
    RETURN greatest(n, p_bound);  -- every slot is held (or being taken)
END $$;
