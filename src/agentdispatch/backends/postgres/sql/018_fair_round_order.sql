-- The fair claim stamps the tenants and sessions of one round as served in
-- the order the round picked them; it stamped them in queue-row order, so the
-- tenant with the oldest rows led every round and got more than its share.
CREATE OR REPLACE FUNCTION dispatch_claim_fair(p_owner text, p_vis double precision, p_n integer, p_read boolean)
RETURNS TABLE (
    id bigint, envelope text, deliveries integer, claimed_at double precision, job_id text,
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    got integer := 0;
    rec record;
    -- Tenants this call served in its current round, at priority v_prio: each
    -- is served once a round. Other claims' marks are not visible (their
    -- transactions are open) and the marks of tenant rows they hold are
    -- skipped, so without rounds one batch would serve one tenant many times.
    -- A round never steps below v_prio: priority comes before fairness.
    v_prio integer;
    v_served text[] := '{}';
    v_tenants bigint;
    v_counted integer;  -- the priority v_tenants counts
    v_k integer;  -- how many this pass may claim
    v_before integer;
BEGIN
    WHILE got < p_n LOOP
        v_k := p_n - got;
        v_before := got;
        FOR rec IN
        WITH clock AS MATERIALIZED (
            SELECT extract(epoch FROM clock_timestamp())::float8 AS now
        ), expired AS MATERIALIZED (
            SELECT e.id FROM agent_dispatch_queue e
             WHERE e.deadline_unix IS NOT NULL AND e.deadline_unix <= (SELECT now FROM clock)
               AND e.visible_at <= (SELECT now FROM clock)
             ORDER BY e.deadline_unix
             LIMIT 1 FOR UPDATE OF e SKIP LOCKED
        ), round AS MATERIALIZED (
            -- Else up to v_k tenants of the top priority that no other claim is
            -- serving right now (their row is locked by it until it commits; its
            -- snapshot of last_served is not ours yet), least recently served
            -- first, one session head each: one tenant is not served many times
            -- in a row while a claim stalls. Priority order is kept: only the top
            -- priority, and the walk below covers everything else.
            SELECT h.id FROM dispatch_fair_tenants t
             CROSS JOIN LATERAL (
                 SELECT x.tenant_ref, x.priority FROM dispatch_fair_tenants x
                 WHERE x.priority = t.priority AND x.tenant_ref = t.tenant_ref
                 FOR NO KEY UPDATE SKIP LOCKED
             ) tl
             CROSS JOIN LATERAL (
                 SELECT h.id FROM dispatch_fair_heads h
                 WHERE h.tenant_ref = tl.tenant_ref AND h.priority = tl.priority
                   AND h.visible_at <= (SELECT now FROM clock)
                 ORDER BY h.last_served, h.deadline_key, h.since
                 LIMIT 1
             ) h
             WHERE NOT EXISTS (SELECT 1 FROM expired)
               AND t.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
               AND (t.priority IS DISTINCT FROM v_prio OR NOT (t.tenant_ref = ANY(v_served)))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT v_k
        ), walk AS MATERIALIZED (
            -- Else one turn, walking every priority and tenant in order.
            SELECT h.id FROM dispatch_fair_tenants t
             CROSS JOIN LATERAL (
                 SELECT h.id FROM dispatch_fair_heads h
                 WHERE h.tenant_ref = t.tenant_ref AND h.priority = t.priority
                   AND h.visible_at <= (SELECT now FROM clock)
                 ORDER BY h.last_served, h.deadline_key, h.since
                 LIMIT 1
             ) h
             WHERE NOT EXISTS (SELECT 1 FROM expired) AND NOT EXISTS (SELECT 1 FROM round)
               AND (v_prio IS NULL OR t.priority > v_prio
                    OR (t.priority = v_prio AND NOT (t.tenant_ref = ANY(v_served))))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT 1
        ), pick AS MATERIALIZED (
            -- The picked ids as one array, in claim order: the update below is
            -- then a primary-key probe per id. Joined as a row set, the generic
            -- plan (which guesses LIMIT v_k at a tenth of the tenants) hashed
            -- the whole queue once the fairness tables held many tenants.
            SELECT ARRAY(SELECT id FROM expired UNION ALL SELECT id FROM round UNION ALL SELECT id FROM walk) AS ids
        ), claimed AS (
            UPDATE agent_dispatch_queue q
            SET claimed_by = p_owner, claimed_at = clock.now, visible_at = clock.now + p_vis,
                deliveries = q.deliveries + 1
            FROM clock
            WHERE q.id = ANY((SELECT p.ids FROM pick p)::bigint[])
            RETURNING q.id, q.job_id, q.envelope, q.deliveries, q.claimed_at, q.priority, q.group_ref, q.tenant_ref
        ), mark AS MATERIALIZED (
            -- Least recently served is approximate by design: a row another claim is
            -- marking right now is skipped (that claim marks it as recent), so no claim
            -- ever waits for a fairness row.
            -- Stamped in the order the round picked them (the update returns its
            -- rows in id order): the next round serves them in the same order,
            -- not the tenant with the oldest rows first again.
            SELECT c.priority, c.group_ref, c.tenant_ref, nextval('dispatch_served_seq') AS n
            FROM (
                SELECT * FROM claimed c
                ORDER BY array_position((SELECT p.ids FROM pick p), c.id)
                OFFSET 0
            ) c
        ), lock_group AS MATERIALIZED (
            -- One index probe per claimed row (a join could become a scan).
            SELECT x.priority, x.group_ref FROM mark m
            CROSS JOIN LATERAL (
                SELECT x.priority, x.group_ref FROM dispatch_fair_groups x
                WHERE x.priority = m.priority AND x.group_ref = m.group_ref
                FOR NO KEY UPDATE SKIP LOCKED
            ) x
        ), served_group AS (
            UPDATE dispatch_fair_groups g SET last_served = m.n
            FROM lock_group l, mark m
            WHERE g.priority = l.priority AND g.group_ref = l.group_ref
              AND m.priority = l.priority AND m.group_ref = l.group_ref
        ), lock_tenant AS MATERIALIZED (
            SELECT x.priority, x.tenant_ref FROM mark m
            CROSS JOIN LATERAL (
                SELECT x.priority, x.tenant_ref FROM dispatch_fair_tenants x
                WHERE x.priority = m.priority AND x.tenant_ref = m.tenant_ref
                FOR NO KEY UPDATE SKIP LOCKED
            ) x
        ), served_tenant AS (
            UPDATE dispatch_fair_tenants t SET last_served = m.n
            FROM lock_tenant l, mark m
            WHERE t.priority = l.priority AND t.tenant_ref = l.tenant_ref
              AND m.priority = l.priority AND m.tenant_ref = l.tenant_ref
        )
        SELECT c.id, c.envelope, c.deliveries, c.claimed_at, c.job_id,
               r.now, r.item, r.leaf, r.blocker_status, r.blocker_expires_at, c.tenant_ref, c.priority
        FROM claimed c
        LEFT JOIN LATERAL (
            SELECT * FROM dispatch_item_read(c.job_id, true) WHERE p_read
        ) r ON true
        ORDER BY array_position((SELECT p.ids FROM pick p), c.id)
        LOOP
            id := rec.id; envelope := rec.envelope; deliveries := rec.deliveries; claimed_at := rec.claimed_at;
            job_id := rec.job_id; now := rec.now; item := rec.item; leaf := rec.leaf;
            blocker_status := rec.blocker_status; blocker_expires_at := rec.blocker_expires_at;
            RETURN NEXT;
            got := got + 1;
            IF rec.priority IS DISTINCT FROM v_prio THEN
                v_prio := rec.priority;
                v_served := '{}';
            END IF;
            v_served := v_served || rec.tenant_ref;
        END LOOP;
        IF got = v_before THEN
            EXIT WHEN v_prio IS NULL;
            v_prio := NULL;  -- the rest of the round is taken or locked: a new round
            v_served := '{}';
            CONTINUE;
        END IF;
        EXIT WHEN got >= p_n;  -- the batch is full (a single get ends here)
        IF v_counted IS DISTINCT FROM v_prio THEN
            v_counted := v_prio;
            v_tenants := (SELECT count(*) FROM (
                SELECT 1 FROM dispatch_fair_tenants x WHERE x.priority = v_prio
                ORDER BY x.priority DESC, x.last_served, x.since LIMIT p_n + 1) n);
        END IF;
        IF cardinality(v_served) >= v_tenants THEN
            v_prio := NULL;  -- every tenant of this priority served once: a new round
            v_served := '{}';
        END IF;
    END LOOP;
END $$;
