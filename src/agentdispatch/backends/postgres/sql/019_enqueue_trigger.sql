-- An enqueue inserts only the fairness rows its snapshot does not show. It
-- inserted every key with ON CONFLICT DO NOTHING, and a conflicting insert
-- waits at the key for any open transaction that wrote the row, to learn
-- whether its version commits: every submission of a tenant waited for the
-- open claims that had just stamped that tenant served. A key that exists is
-- now skipped by an index probe (a scalar subquery: one probe per key, never
-- a join that could scan the table); the lock loop below still re-inserts
-- one a pruner deleted meanwhile (its next statement's snapshot lacks it).
--
-- One enqueue trigger instead of two: the notification that says how many
-- rows a statement added (for several) is sent by dispatch_queue_added,
-- after the one that says a row came, as the separate queue_added_many
-- trigger did. That trigger ran for every enqueue (a trigger call, a count
-- of the added rows and its own check for waiters) to notify only when some
-- claimer waited and the statement added more than one row.
CREATE OR REPLACE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    want bigint;
    got bigint;
    d record;
    n bigint;
BEGIN
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
        SELECT k.priority, k.group_ref, k.tenant_ref, k.deadline_key, k.since FROM (
            SELECT priority, group_ref, min(tenant_ref) AS tenant_ref,
                   coalesce(min(deadline_unix), 'Infinity'::double precision) AS deadline_key, min(id) AS since
            FROM added GROUP BY priority, group_ref
        ) k
        WHERE (SELECT 1 FROM dispatch_fair_groups g
               WHERE g.priority = k.priority AND g.group_ref = k.group_ref) IS NULL
        ORDER BY k.priority, k.group_ref
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

DROP TRIGGER queue_added_many ON agent_dispatch_queue;
DROP FUNCTION dispatch_queue_added_many();
