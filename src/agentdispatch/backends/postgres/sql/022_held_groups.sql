-- A group whose head is claimed is held out of the claim's scan until its
-- row is visible again. A turn in flight keeps its queue row (and its group)
-- until it is acknowledged, and a claim looking for a tenant's next head
-- walked every such group, probing and locking its head row only to find it
-- claimed: a claim that came up short (arrivals trickling into a fleet with
-- thousands of turns in flight) cost time in proportion to the turns in
-- flight. held_until is the time the claimed head's row becomes visible
-- again (0: not held); the scan reads only groups not held, from an index
-- that holds only those. A hold ends when its row leaves the queue (the
-- delete trigger), is released (the release statements), or its time comes
-- (the claim puts back holds that ran out before it scans).
ALTER TABLE dispatch_fair_groups ADD COLUMN held_until double precision NOT NULL DEFAULT 0;
DROP INDEX fair_groups_order;
CREATE INDEX fair_groups_order
    ON dispatch_fair_groups (tenant_ref, priority, last_served, deadline_key, since) WHERE held_until = 0;
CREATE INDEX fair_groups_held ON dispatch_fair_groups (held_until) WHERE held_until > 0;

CREATE OR REPLACE VIEW dispatch_fair_heads AS
SELECT g.tenant_ref, g.priority, g.last_served, g.deadline_key, g.since, q.id, q.visible_at
FROM dispatch_fair_groups g
CROSS JOIN LATERAL (
    SELECT q.id, q.visible_at, q.session_ref, q.item_seq FROM agent_dispatch_queue q
    WHERE q.group_ref = g.group_ref AND q.priority = g.priority
    ORDER BY q.item_seq, q.id
    LIMIT 1 FOR UPDATE OF q SKIP LOCKED
) q
WHERE g.held_until = 0
  AND NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue p
    WHERE p.session_ref = q.session_ref AND (p.item_seq, p.id) < (q.item_seq, q.id)
);

-- Rows that leave the queue end their groups' holds (the next row of the
-- session is the head now). This waits for the group row, unlike the prune:
-- a hold left behind would keep a ready session waiting out the claim's
-- visibility. Only a claim of that group holds its row, and none can claim
-- it while this transaction deletes its head.
-- The groups are one pair of arrays: the update is then a primary-key probe
-- per group (joined as a row set, its plan could scan the table).
CREATE OR REPLACE FUNCTION dispatch_queue_removed_rows() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    gp integer[];
    gr text[];
BEGIN
    SELECT array_agg(k.priority), array_agg(k.group_ref) INTO gp, gr
    FROM (SELECT DISTINCT r.priority, r.group_ref FROM removed r ORDER BY 1, 2) k;
    PERFORM dispatch_fair_prune(gp, gr);
    UPDATE dispatch_fair_groups g SET held_until = 0
    FROM unnest(gp, gr) AS k(priority, group_ref)
    WHERE g.priority = k.priority AND g.group_ref = k.group_ref AND g.held_until <> 0;
    RETURN NULL;
END $$;

-- The fair claim of 021, which also holds the groups whose heads it claims
-- and first puts back the holds that ran out.
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
    v_m integer;  -- sessions of one tenant this pass may claim (v_k: a lone tenant's new round)
    v_tops bigint;  -- tenants at the top priority, counted up to 2
    v_expired boolean;  -- this pass claimed an expired row
    v_before integer;
    v_now double precision;  -- the pass's clock: every statement of the pass reads it
    v_ids bigint[];  -- the pass's picks, in claim order
    v_exp boolean;  -- the pick is an expired row
    v_free_p integer[];  -- groups whose hold ran out, to put back in the scan
    v_free_g text[];
BEGIN
    -- Holds that ran out (a claim whose visibility lapsed: its worker died, or
    -- its turn outlived the claim's visibility) go back into the scan first, so
    -- the head is claimable again the moment its row is. Never waits: a group
    -- another transaction holds is put back by the next call.
    v_now := extract(epoch FROM clock_timestamp())::float8;
    SELECT array_agg(h.priority), array_agg(h.group_ref) INTO v_free_p, v_free_g FROM (
        SELECT h.priority, h.group_ref FROM dispatch_fair_groups h
        WHERE h.held_until > 0 AND h.held_until <= v_now
        ORDER BY h.held_until LIMIT 1000
        FOR NO KEY UPDATE SKIP LOCKED) h;
    IF v_free_p IS NOT NULL THEN
        UPDATE dispatch_fair_groups g SET held_until = 0
        FROM unnest(v_free_p, v_free_g) AS k(priority, group_ref)
        WHERE g.priority = k.priority AND g.group_ref = k.group_ref;
    END IF;
    WHILE got < p_n LOOP
        v_k := p_n - got;
        v_before := got;
        -- A new round of the top priority's only tenant takes the whole batch
        -- in one pass, as that many rounds would (a fleet of one tenant and many
        -- sessions would otherwise pay a pass per turn). With several tenants a
        -- pass serves each once: other claims hold some tenants' rows, and a
        -- pass taking several rounds of the rest would serve those more.
        v_m := 1;
        v_expired := false;
        IF v_k > 1 AND cardinality(v_served) = 0 THEN
            v_tops := (SELECT count(*) FROM (
                SELECT 1 FROM dispatch_fair_tenants x
                WHERE x.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
                LIMIT 2) n);
            IF v_tops = 1 THEN
                v_m := v_k;
            END IF;
        END IF;
        -- The pass reads the clock once; its statements share it. The common pass
        -- picks (expired row, else a round) in one statement and claims in
        -- another; the walk below, and the claim when nothing was picked, run
        -- only when needed, so the common pass starts a much smaller plan (the
        -- executor start-up of the one statement that held every branch cost
        -- about as much as running it).
        v_now := extract(epoch FROM clock_timestamp())::float8;
        WITH expired AS MATERIALIZED (
            SELECT e.id FROM agent_dispatch_queue e
             WHERE e.deadline_unix IS NOT NULL AND e.deadline_unix <= v_now
               AND e.visible_at <= v_now
             ORDER BY e.deadline_unix
             LIMIT 1 FOR UPDATE OF e SKIP LOCKED
        ), round AS MATERIALIZED (
            -- Else up to v_k tenants of the top priority that no other claim is
            -- serving right now (their row is locked by it until it commits; its
            -- snapshot of last_served is not ours yet), least recently served
            -- first, one session head each: one tenant is not served many times
            -- in a row while a claim stalls. Priority order is kept: only the top
            -- priority, and the walk below covers everything else.
            -- A lone tenant (v_m > 1) gives up to v_m sessions, in order.
            SELECT h.id FROM dispatch_fair_tenants t
             CROSS JOIN LATERAL (
                 SELECT x.tenant_ref, x.priority FROM dispatch_fair_tenants x
                 WHERE x.priority = t.priority AND x.tenant_ref = t.tenant_ref
                 FOR NO KEY UPDATE SKIP LOCKED
             ) tl
             CROSS JOIN LATERAL (
                 SELECT h.id FROM dispatch_fair_heads h
                 WHERE h.tenant_ref = tl.tenant_ref AND h.priority = tl.priority
                   AND h.visible_at <= v_now
                 ORDER BY h.last_served, h.deadline_key, h.since
                 LIMIT v_m
             ) h
             WHERE NOT EXISTS (SELECT 1 FROM expired)
               AND t.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
               AND (t.priority IS DISTINCT FROM v_prio OR NOT (t.tenant_ref = ANY(v_served)))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT v_k
        )
        SELECT ARRAY(SELECT id FROM expired UNION ALL SELECT id FROM round),
               EXISTS (SELECT 1 FROM expired)
        INTO v_ids, v_exp;
        IF cardinality(v_ids) = 0 THEN
            WITH walk AS MATERIALIZED (
                -- Else one turn, walking every priority and tenant in order.
                SELECT h.id, t.priority, t.tenant_ref FROM dispatch_fair_tenants t
                 CROSS JOIN LATERAL (
                     SELECT h.id FROM dispatch_fair_heads h
                     WHERE h.tenant_ref = t.tenant_ref AND h.priority = t.priority
                       AND h.visible_at <= v_now
                     ORDER BY h.last_served, h.deadline_key, h.since
                     LIMIT 1
                 ) h
                 WHERE (v_prio IS NULL OR t.priority > v_prio
                        OR (t.priority = v_prio AND NOT (t.tenant_ref = ANY(v_served))))
                 ORDER BY t.priority DESC, t.last_served, t.since
                 LIMIT 1
            ), walk_more AS MATERIALIZED (
                -- And the rest of a new round (v_m) when that turn's tenant is the
                -- top priority's only one (another claim holds its row right now):
                -- with several, one turn a pass keeps them taking turns, as rounds do.
                SELECT h.id FROM walk w
                CROSS JOIN LATERAL (
                    SELECT h.id FROM dispatch_fair_heads h
                    WHERE h.tenant_ref = w.tenant_ref AND h.priority = w.priority
                      AND h.visible_at <= v_now AND h.id <> w.id
                    ORDER BY h.last_served, h.deadline_key, h.since
                    LIMIT v_m - 1
                ) h
                WHERE v_m > 1
                  AND w.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
            )
            SELECT ARRAY(SELECT id FROM walk UNION ALL SELECT id FROM walk_more) INTO v_ids;
        END IF;
        IF cardinality(v_ids) = 0 THEN
            -- Nothing to claim (the claim statement is not run).
            EXIT WHEN v_prio IS NULL;
            v_prio := NULL;  -- the rest of the round is taken or locked: a new round
            v_served := '{}';
            CONTINUE;
        END IF;
        -- The picked ids are one array, in claim order: the update below is
        -- then a primary-key probe per id. Joined as a row set, the generic
        -- plan (which guesses LIMIT v_k at a tenth of the tenants) hashed
        -- the whole queue once the fairness tables held many tenants.
        FOR rec IN
        WITH claimed AS (
            UPDATE agent_dispatch_queue q
            SET claimed_by = p_owner, claimed_at = v_now, visible_at = v_now + p_vis,
                deliveries = q.deliveries + 1
            WHERE q.id = ANY(v_ids)
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
                ORDER BY array_position(v_ids, c.id)
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
            -- A claimed head holds its group out of the scan until its row is
            -- visible again (an expired row need not be its group's head).
            UPDATE dispatch_fair_groups g
            SET last_served = m.n, held_until = CASE WHEN v_exp THEN g.held_until ELSE v_now + p_vis END
            FROM lock_group l, mark m
            WHERE g.priority = l.priority AND g.group_ref = l.group_ref
              AND m.priority = l.priority AND m.group_ref = l.group_ref
        ), lock_tenant AS MATERIALIZED (
            -- A tenant served several times in the pass is stamped once, with its last mark.
            -- The top priority's only tenant (v_m > 1) is not stamped: there is no
            -- other to order it against, and a tenant added later starts at 0, before
            -- it, whatever its stamp. Each stamp is a row version, and while a long
            -- transaction holds vacuum back every claim steps over all of them. (An
            -- expired turn may be of any tenant: that pass stamps.)
            SELECT x.priority, x.tenant_ref, m.n FROM (
                SELECT m.priority, m.tenant_ref, max(m.n) AS n FROM mark m
                WHERE v_m = 1 OR v_exp
                GROUP BY m.priority, m.tenant_ref
            ) m
            CROSS JOIN LATERAL (
                SELECT x.priority, x.tenant_ref FROM dispatch_fair_tenants x
                WHERE x.priority = m.priority AND x.tenant_ref = m.tenant_ref
                FOR NO KEY UPDATE SKIP LOCKED
            ) x
        ), served_tenant AS (
            UPDATE dispatch_fair_tenants t SET last_served = l.n
            FROM lock_tenant l
            WHERE t.priority = l.priority AND t.tenant_ref = l.tenant_ref
        )
        SELECT c.id, c.envelope, c.deliveries, c.claimed_at, c.job_id,
               r.now, r.item, r.leaf, r.blocker_status, r.blocker_expires_at, c.tenant_ref, c.priority,
               v_exp AS was_expired
        FROM claimed c
        LEFT JOIN LATERAL (
            SELECT * FROM dispatch_item_read(c.job_id, true) WHERE p_read
        ) r ON true
        ORDER BY array_position(v_ids, c.id)
        LOOP
            id := rec.id; envelope := rec.envelope; deliveries := rec.deliveries; claimed_at := rec.claimed_at;
            job_id := rec.job_id; now := rec.now; item := rec.item; leaf := rec.leaf;
            blocker_status := rec.blocker_status; blocker_expires_at := rec.blocker_expires_at;
            RETURN NEXT;
            got := got + 1;
            v_expired := v_expired OR rec.was_expired;
            IF rec.priority IS DISTINCT FROM v_prio THEN
                v_prio := rec.priority;
                v_served := '{}';
            END IF;
            IF NOT rec.tenant_ref = ANY(v_served) THEN
                v_served := v_served || rec.tenant_ref;
            END IF;
        END LOOP;
        IF got = v_before THEN
            EXIT WHEN v_prio IS NULL;
            v_prio := NULL;  -- the rest of the round is taken or locked: a new round
            v_served := '{}';
            CONTINUE;
        END IF;
        EXIT WHEN got >= p_n;  -- the batch is full (a single get ends here)
        -- Every group is held (this call's among them): no pass could find a
        -- head. An idle worker's claim after news of one turn asks for two and
        -- ends here, instead of running both kinds of pass twice more.
        EXIT WHEN (SELECT 1 FROM dispatch_fair_groups g WHERE g.held_until = 0 LIMIT 1) IS NULL;
        -- A lone tenant's new round that came short took every session head it
        -- could: with no other tenant left (read after the pass: one added
        -- meanwhile gets its pass), another pass would find nothing.
        -- (The count is a statement of its own: in the IF's condition every pass
        -- would run it through the executor.)
        IF v_m > 1 AND NOT v_expired AND got - v_before < v_m THEN
            EXIT WHEN (SELECT count(*) FROM (SELECT 1 FROM dispatch_fair_tenants x LIMIT 2) n) <= 1;
        END IF;
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
