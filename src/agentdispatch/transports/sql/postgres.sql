-- name: get
-- One statement, one round trip. Expired deadlines first (the worker cancels
-- them promptly); then priority, least-recently-served tenant, least-recently-
-- served group (the session), deadline, enqueue order. Only the head row of a
-- session is eligible, so one session's turns are handed out one at a time, in
-- order. Every step is an index scan over a small fairness table or the queue.
-- With read = true (inside a transaction that goes on to claim the item), the
-- same round trip also reads the item for that claim: dispatch_item_read,
-- locking the item and its session until the transaction ends.
WITH clock AS MATERIALIZED (
    SELECT extract(epoch FROM clock_timestamp())::float8 AS now
), pick AS MATERIALIZED (
    SELECT coalesce(
        (SELECT e.id FROM agent_dispatch_queue e
         WHERE e.deadline_unix IS NOT NULL AND e.deadline_unix <= (SELECT now FROM clock)
           AND e.visible_at <= (SELECT now FROM clock)
         ORDER BY e.deadline_unix
         LIMIT 1 FOR UPDATE OF e SKIP LOCKED),
        -- First, tenants of the top priority that no other claim is serving
        -- right now (their row is locked by it until it commits; its snapshot
        -- of last_served is not ours yet): one tenant is not served many
        -- times in a row while a claim stalls. Priority order is kept: only
        -- the top priority, and the walk below covers everything else.
        (SELECT h.id FROM dispatch_fair_tenants t
         CROSS JOIN LATERAL (
             SELECT x.tenant_ref, x.priority FROM dispatch_fair_tenants x
             WHERE x.priority = t.priority AND x.tenant_ref = t.tenant_ref
             FOR NO KEY UPDATE SKIP LOCKED
         ) tl
         CROSS JOIN LATERAL (
             SELECT q.id FROM dispatch_fair_groups g
             CROSS JOIN LATERAL (
                 SELECT q.id, q.visible_at, q.session_ref, q.item_seq FROM agent_dispatch_queue q
                 WHERE q.group_ref = g.group_ref AND q.priority = g.priority
                 ORDER BY q.item_seq, q.id
                 LIMIT 1 FOR UPDATE OF q SKIP LOCKED
             ) q
             WHERE g.tenant_ref = tl.tenant_ref AND g.priority = tl.priority
               AND q.visible_at <= (SELECT now FROM clock)
               AND NOT EXISTS (
                   SELECT 1 FROM agent_dispatch_queue p
                   WHERE p.session_ref = q.session_ref AND (p.item_seq, p.id) < (q.item_seq, q.id)
               )
             ORDER BY g.last_served, g.deadline_key, g.since
             LIMIT 1
         ) h
         WHERE t.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
         ORDER BY t.priority DESC, t.last_served, t.since
         LIMIT 1),
        (SELECT h.id FROM dispatch_fair_tenants t
         CROSS JOIN LATERAL (
             SELECT q.id FROM dispatch_fair_groups g
             CROSS JOIN LATERAL (
                 SELECT q.id, q.visible_at, q.session_ref, q.item_seq FROM agent_dispatch_queue q
                 WHERE q.group_ref = g.group_ref AND q.priority = g.priority
                 ORDER BY q.item_seq, q.id
                 LIMIT 1 FOR UPDATE OF q SKIP LOCKED
             ) q
             WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority
               AND q.visible_at <= (SELECT now FROM clock)
               AND NOT EXISTS (
                   SELECT 1 FROM agent_dispatch_queue p
                   WHERE p.session_ref = q.session_ref AND (p.item_seq, p.id) < (q.item_seq, q.id)
               )
             ORDER BY g.last_served, g.deadline_key, g.since
             LIMIT 1
         ) h
         ORDER BY t.priority DESC, t.last_served, t.since
         LIMIT 1)
    ) AS id
), claimed AS (
    UPDATE agent_dispatch_queue q
    SET claimed_by = %(owner)s, claimed_at = clock.now, visible_at = clock.now + %(vis)s,
        deliveries = q.deliveries + 1
    FROM pick, clock
    WHERE q.id = pick.id
    RETURNING q.id, q.job_id, q.envelope, q.deliveries, q.claimed_at, q.priority, q.group_ref, q.tenant_ref
), mark AS MATERIALIZED (
    -- Least recently served is approximate by design: a row another claim is
    -- marking right now is skipped (that claim marks it as recent), so no claim
    -- ever waits for a fairness row.
    SELECT c.priority, c.group_ref, c.tenant_ref, nextval('dispatch_served_seq') AS n FROM claimed c
), lock_group AS MATERIALIZED (
    SELECT x.priority, x.group_ref FROM dispatch_fair_groups x
    JOIN mark m ON x.priority = m.priority AND x.group_ref = m.group_ref
    FOR NO KEY UPDATE OF x SKIP LOCKED
), served_group AS (
    UPDATE dispatch_fair_groups g SET last_served = m.n
    FROM lock_group l, mark m
    WHERE g.priority = l.priority AND g.group_ref = l.group_ref
), lock_tenant AS MATERIALIZED (
    SELECT x.priority, x.tenant_ref FROM dispatch_fair_tenants x
    JOIN mark m ON x.priority = m.priority AND x.tenant_ref = m.tenant_ref
    FOR NO KEY UPDATE OF x SKIP LOCKED
), served_tenant AS (
    UPDATE dispatch_fair_tenants t SET last_served = m.n
    FROM lock_tenant l, mark m
    WHERE t.priority = l.priority AND t.tenant_ref = l.tenant_ref
)
SELECT c.id, c.envelope, c.deliveries, c.claimed_at, c.job_id,
       r.now, r.item, r.leaf, r.blocker_status, r.blocker_expires_at
FROM claimed c
LEFT JOIN LATERAL (
    SELECT * FROM dispatch_item_read(c.job_id, true) WHERE %(read)s::boolean
) r ON true

-- name: ack
-- RETURNING: the answer is a row, which pipeline mode delivers on fetch. The
-- delete trigger prunes an emptied group without waiting for any lock.
DELETE FROM agent_dispatch_queue
WHERE id = %(id)s AND claimed_by = %(owner)s AND claimed_at = %(claimed_at)s
RETURNING id

-- name: release
UPDATE agent_dispatch_queue
SET visible_at = extract(epoch FROM clock_timestamp())::float8 + %(delay)s, claimed_by = NULL, claimed_at = NULL
WHERE id = %(id)s AND claimed_by = %(owner)s AND claimed_at = %(claimed_at)s

-- name: depth
SELECT count(*) AS n FROM agent_dispatch_queue
WHERE claimed_by IS NULL OR visible_at <= extract(epoch FROM clock_timestamp())::float8

-- name: probe
SELECT 1 AS ok FROM agent_dispatch_queue WHERE false
