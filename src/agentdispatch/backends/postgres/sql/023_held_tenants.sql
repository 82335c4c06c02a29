-- A tenant whose every group is held is held out of the claim's scan, as
-- 022 holds groups. One tenant per customer, each with a turn in flight:
-- a claim that came up short (arrivals trickling into a fleet whose
-- concurrency is above its load) visited and locked every such tenant, only
-- to find its groups held, and so cost time in proportion to the tenants
-- with turns in flight. held is set by the claim that holds a tenant's last
-- free group, on the tenant row its round locked. Whatever frees a group
-- (a new group, an acknowledgement, a release, a hold that ran out) clears
-- it through dispatch_fair_unhold, which never waits: a tenant row another
-- transaction holds (a claim that may be marking it held) gets a wake, and
-- the next claim clears that tenant once the row is free. The scan reads
-- only tenants not held, from an index that holds only those.
ALTER TABLE dispatch_fair_tenants ADD COLUMN held boolean NOT NULL DEFAULT false;
DROP INDEX fair_tenants_order;
CREATE INDEX fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since) WHERE NOT held;

CREATE TABLE dispatch_fair_wakes (
    id         bigserial PRIMARY KEY,
    priority   integer NOT NULL,
    tenant_ref text NOT NULL
);

-- Clear held on the tenants of these keys that no other transaction holds
-- (locked first, then read by a statement that sees their latest version);
-- lp/lt: the ones locked. Key by key: a join could scan the table.
CREATE FUNCTION dispatch_fair_clear(p_prios integer[], p_tenants text[], OUT lp integer[], OUT lt text[])
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    hp integer[];
    ht text[];
BEGIN
    SELECT array_agg(x.priority), array_agg(x.tenant_ref) INTO lp, lt FROM (
        SELECT DISTINCT k.priority, k.tenant_ref FROM unnest(p_prios, p_tenants) AS k(priority, tenant_ref)
        ORDER BY 1, 2) k
    CROSS JOIN LATERAL (
        SELECT x.priority, x.tenant_ref FROM dispatch_fair_tenants x
        WHERE x.priority = k.priority AND x.tenant_ref = k.tenant_ref
        FOR NO KEY UPDATE SKIP LOCKED
    ) x;
    SELECT array_agg(k.priority), array_agg(k.tenant_ref) INTO hp, ht
    FROM unnest(lp, lt) AS k(priority, tenant_ref)
    CROSS JOIN LATERAL (
        SELECT 1 FROM dispatch_fair_tenants x
        WHERE x.priority = k.priority AND x.tenant_ref = k.tenant_ref AND x.held LIMIT 1
    ) x;
    FOR i IN 1..coalesce(cardinality(hp), 0) LOOP
        UPDATE dispatch_fair_tenants t SET held = false WHERE t.priority = hp[i] AND t.tenant_ref = ht[i];
    END LOOP;
END $$;

-- The tenants of groups just freed are in the scan again: cleared where no
-- other transaction holds the tenant row, and a wake for the rest (one may
-- be a claim marking it held). Tenants without a row need nothing.
CREATE FUNCTION dispatch_fair_unhold(p_prios integer[], p_tenants text[]) RETURNS void
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    lp integer[];
    lt text[];
BEGIN
    IF p_tenants IS NULL OR cardinality(p_tenants) = 0 THEN
        RETURN;
    END IF;
    SELECT c.lp, c.lt INTO lp, lt FROM dispatch_fair_clear(p_prios, p_tenants) c;
    IF coalesce(cardinality(lp), 0) < cardinality(p_tenants) THEN
        INSERT INTO dispatch_fair_wakes (priority, tenant_ref)
        SELECT k.priority, k.tenant_ref FROM (
            SELECT DISTINCT k.priority, k.tenant_ref FROM unnest(p_prios, p_tenants) AS k(priority, tenant_ref)) k
        WHERE NOT EXISTS (
                SELECT 1 FROM unnest(lp, lt) AS l(priority, tenant_ref)
                WHERE l.priority = k.priority AND l.tenant_ref = k.tenant_ref)
          AND EXISTS (
                SELECT 1 FROM dispatch_fair_tenants t
                WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref);
    END IF;
END $$;

-- The wakes whose tenant rows are free now: those tenants are cleared and
-- their wakes go (with the wakes of tenants gone). A wake whose tenant row
-- another transaction still holds stays for the next claim.
CREATE FUNCTION dispatch_fair_wake() RETURNS void
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    wi bigint[];
    wp integer[];
    wt text[];
    lp integer[];
    lt text[];
BEGIN
    SELECT array_agg(w.id), array_agg(w.priority), array_agg(w.tenant_ref) INTO wi, wp, wt FROM (
        SELECT w.id, w.priority, w.tenant_ref FROM dispatch_fair_wakes w
        ORDER BY w.id LIMIT 1000
        FOR UPDATE SKIP LOCKED) w;
    IF wi IS NULL THEN
        RETURN;
    END IF;
    SELECT c.lp, c.lt INTO lp, lt FROM dispatch_fair_clear(wp, wt) c;
    DELETE FROM dispatch_fair_wakes w
    USING unnest(wi, wp, wt) AS k(id, priority, tenant_ref)
    WHERE w.id = k.id
      AND (EXISTS (SELECT 1 FROM unnest(lp, lt) AS l(priority, tenant_ref)
                   WHERE l.priority = k.priority AND l.tenant_ref = k.tenant_ref)
           OR NOT EXISTS (SELECT 1 FROM dispatch_fair_tenants t
                          WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref));
END $$;

-- The reconciler's pass also clears held tenants that have a free group (a
-- safety net: every path that frees a group clears its tenant already).
CREATE OR REPLACE FUNCTION dispatch_fair_sweep(p_limit integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    pruned integer;
    tp integer[];
    tr text[];
BEGIN
    pruned := (SELECT dispatch_fair_prune(array_agg(r.priority), array_agg(r.group_ref)) FROM (
        SELECT g.priority, g.group_ref FROM dispatch_fair_groups g
        ORDER BY g.last_served DESC LIMIT p_limit) r);
    SELECT array_agg(c.priority), array_agg(c.tenant_ref) INTO tp, tr FROM (
        SELECT t.priority, t.tenant_ref FROM dispatch_fair_tenants t
        WHERE NOT EXISTS (
            SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED) c;
    IF tp IS NOT NULL THEN
        DELETE FROM dispatch_fair_tenants t USING unnest(tp, tr) AS k(priority, tenant_ref)
        WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
          AND NOT EXISTS (
              SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority);
    END IF;
    PERFORM dispatch_fair_unhold(array_agg(t.priority), array_agg(t.tenant_ref)) FROM (
        SELECT t.priority, t.tenant_ref FROM dispatch_fair_tenants t
        WHERE t.held AND EXISTS (
            SELECT 1 FROM dispatch_fair_groups g
            WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority AND g.held_until = 0)
        LIMIT p_limit) t;
    RETURN coalesce(pruned, 0);
END $$;

-- Groups freed by a removed row free their tenants (022's trigger, plus that).
CREATE OR REPLACE FUNCTION dispatch_queue_removed_rows() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    gp integer[];
    gr text[];
    tp integer[];
    tr text[];
BEGIN
    SELECT array_agg(k.priority), array_agg(k.group_ref) INTO gp, gr
    FROM (SELECT DISTINCT r.priority, r.group_ref FROM removed r ORDER BY 1, 2) k;
    PERFORM dispatch_fair_prune(gp, gr);
    WITH freed AS (
        UPDATE dispatch_fair_groups g SET held_until = 0
        FROM unnest(gp, gr) AS k(priority, group_ref)
        WHERE g.priority = k.priority AND g.group_ref = k.group_ref AND g.held_until <> 0
        RETURNING g.priority, g.tenant_ref
    )
    SELECT array_agg(f.priority), array_agg(f.tenant_ref) INTO tp, tr FROM freed f;
    PERFORM dispatch_fair_unhold(tp, tr);
    RETURN NULL;
END $$;

-- A new group frees its tenant (019's trigger, plus that).
CREATE OR REPLACE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    want bigint;
    got bigint;
    d record;
    n bigint;
    np integer[] := '{}';  -- tenants of the groups this statement created
    nt text[] := '{}';
    ip integer[];
    it text[];
BEGIN
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added) k);
    LOOP
        WITH made AS (
            INSERT INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
            SELECT k.priority, k.group_ref, k.tenant_ref, k.deadline_key, k.since FROM (
                SELECT priority, group_ref, min(tenant_ref) AS tenant_ref,
                       coalesce(min(deadline_unix), 'Infinity'::double precision) AS deadline_key, min(id) AS since
                FROM added GROUP BY priority, group_ref
            ) k
            WHERE (SELECT 1 FROM dispatch_fair_groups g
                   WHERE g.priority = k.priority AND g.group_ref = k.group_ref) IS NULL
            ORDER BY k.priority, k.group_ref
            ON CONFLICT (priority, group_ref) DO NOTHING
            RETURNING priority, tenant_ref
        )
        SELECT array_agg(m.priority), array_agg(m.tenant_ref) INTO ip, it FROM made m;
        np := np || coalesce(ip, '{}');
        nt := nt || coalesce(it, '{}');
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
        SELECT k.priority, k.tenant_ref, k.since FROM (
            SELECT priority, tenant_ref, min(id) AS since FROM added GROUP BY priority, tenant_ref
        ) k
        WHERE (SELECT 1 FROM dispatch_fair_tenants t
               WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref) IS NULL
        ORDER BY k.priority, k.tenant_ref
        ON CONFLICT (priority, tenant_ref) DO NOTHING;
        got := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added ORDER BY 1, 2) k
                CROSS JOIN LATERAL (
                    SELECT 1 FROM dispatch_fair_tenants t
                    WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
                    FOR KEY SHARE OF t) x);
        EXIT WHEN got >= want;
    END LOOP;
    -- A new group is free: its tenant (whose row exists now) is in the scan again.
    IF cardinality(nt) > 0 THEN
        PERFORM dispatch_fair_unhold(np, nt);
    END IF;
    IF EXISTS (SELECT 1 FROM dispatch_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify('agent_dispatch_queue', '');
        -- A statement that adds several rows also says how many, so as many
        -- idle waiters wake to claim them.
        n := (SELECT count(*) FROM added);
        IF n > 1 THEN
            PERFORM pg_notify('agent_dispatch_queue', n::text);
        END IF;
    END IF;
    RETURN NULL;
END $$;

-- The fair claim of 022: it skips held tenants, holds the tenants whose last
-- free group its round took, and first frees the tenants of holds that ran out
-- and those of waiting wakes.
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
    v_free_t text[];
    v_round boolean;  -- the pass's picks came from the round (whose tenants it locked)
    v_hold_p integer[] := '{}';  -- tenants served by a round, to hold if every group of theirs is held
    v_hold_t text[] := '{}';
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
        WITH freed AS (
            UPDATE dispatch_fair_groups g SET held_until = 0
            FROM unnest(v_free_p, v_free_g) AS k(priority, group_ref)
            WHERE g.priority = k.priority AND g.group_ref = k.group_ref
            RETURNING g.priority, g.tenant_ref
        )
        SELECT array_agg(f.priority), array_agg(f.tenant_ref) INTO v_free_p, v_free_t FROM freed f;
        PERFORM dispatch_fair_unhold(v_free_p, v_free_t);
    END IF;
    -- Tenants whose holds ended while another claim held their rows.
    -- (The table holds only the few wakes of contended holds: read whole, it is a page or two.)
    IF (SELECT 1 FROM dispatch_fair_wakes w LIMIT 1) IS NOT NULL THEN
        PERFORM dispatch_fair_wake();
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
                WHERE NOT x.held AND x.priority = (SELECT m.priority FROM dispatch_fair_tenants m WHERE NOT m.held ORDER BY m.priority DESC LIMIT 1)
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
               AND NOT t.held
               AND t.priority = (SELECT m.priority FROM dispatch_fair_tenants m WHERE NOT m.held ORDER BY m.priority DESC LIMIT 1)
               AND (t.priority IS DISTINCT FROM v_prio OR NOT (t.tenant_ref = ANY(v_served)))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT v_k
        )
        SELECT ARRAY(SELECT id FROM expired UNION ALL SELECT id FROM round),
               EXISTS (SELECT 1 FROM expired)
        INTO v_ids, v_exp;
        v_round := NOT v_exp;
        IF cardinality(v_ids) = 0 THEN
            v_round := false;
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
                 WHERE NOT t.held
                   AND (v_prio IS NULL OR t.priority > v_prio
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
                  AND w.priority = (SELECT m.priority FROM dispatch_fair_tenants m WHERE NOT m.held ORDER BY m.priority DESC LIMIT 1)
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
            IF v_round THEN
                v_hold_p := v_hold_p || rec.priority;
                v_hold_t := v_hold_t || rec.tenant_ref;
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
            EXIT WHEN (SELECT count(*) FROM (SELECT 1 FROM dispatch_fair_tenants x WHERE NOT x.held LIMIT 2) n) <= 1;
        END IF;
        IF v_counted IS DISTINCT FROM v_prio THEN
            v_counted := v_prio;
            v_tenants := (SELECT count(*) FROM (
                SELECT 1 FROM dispatch_fair_tenants x WHERE x.priority = v_prio AND NOT x.held
                ORDER BY x.priority DESC, x.last_served, x.since LIMIT p_n + 1) n);
        END IF;
        IF cardinality(v_served) >= v_tenants THEN
            v_prio := NULL;  -- every tenant of this priority served once: a new round
            v_served := '{}';
        END IF;
    END LOOP;
    -- A tenant a round served whose every group is now held leaves the scan.
    -- The round locked its row, so a transaction that frees one of its groups
    -- meanwhile could not lock it and left a wake (dispatch_fair_unhold); one
    -- that freed a group before the lock committed first, and this statement's
    -- snapshot sees the group free.
    IF cardinality(v_hold_t) > 0 THEN
        SELECT array_agg(k.priority), array_agg(k.tenant_ref) INTO v_hold_p, v_hold_t FROM (
            SELECT DISTINCT k.priority, k.tenant_ref FROM unnest(v_hold_p, v_hold_t) AS k(priority, tenant_ref)) k
        CROSS JOIN LATERAL (
            SELECT 1 FROM dispatch_fair_tenants x
            WHERE x.priority = k.priority AND x.tenant_ref = k.tenant_ref AND NOT x.held LIMIT 1
        ) x
        WHERE NOT EXISTS (
            SELECT 1 FROM dispatch_fair_groups g
            WHERE g.tenant_ref = k.tenant_ref AND g.priority = k.priority AND g.held_until = 0);
        FOR i IN 1..coalesce(cardinality(v_hold_t), 0) LOOP
            UPDATE dispatch_fair_tenants t SET held = true
            WHERE t.priority = v_hold_p[i] AND t.tenant_ref = v_hold_t[i];
        END LOOP;
    END IF;
END $$;
