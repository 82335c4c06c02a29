-- name: get
-- The claim order of PostgreSQL's fair claim: expired deadlines first, so the
-- worker cancels them promptly; then priority, least-recently-served tenant,
-- least-recently-served group (the session), deadline, enqueue order. Only
-- the head of each session is eligible, so turns of one session are handed
-- out one at a time, in order. The fairness rows and their marks are kept by
-- the triggers of migration 012. coalesce() evaluates its second subquery
-- only when the first finds nothing: one statement either way.
UPDATE agent_dispatch_queue
SET claimed_by = :owner, claimed_at = :now, visible_at = :now + :vis, deliveries = deliveries + 1
WHERE id = coalesce(
    (
        SELECT q.id FROM agent_dispatch_queue q INDEXED BY queue_deadline
        WHERE q.deadline_unix IS NOT NULL AND q.deadline_unix <= :now AND q.visible_at <= :now
        ORDER BY q.deadline_unix LIMIT 1
    ),
    (
        -- Tenants in order, each with its first eligible group head (NULL: none).
        SELECT (
            SELECT q.id FROM dispatch_fair_groups g INDEXED BY fair_groups_order
            JOIN agent_dispatch_queue q ON q.id = (
                SELECT h.id FROM agent_dispatch_queue h INDEXED BY queue_session
                WHERE h.session_ref = g.group_ref AND h.priority = g.priority
                ORDER BY h.item_seq, h.id LIMIT 1
            )
            WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority
              AND q.visible_at <= :now
              AND NOT EXISTS (
                  SELECT 1 FROM agent_dispatch_queue p INDEXED BY queue_session
                  WHERE p.session_ref = q.session_ref
                    AND (p.item_seq < q.item_seq OR (p.item_seq = q.item_seq AND p.id < q.id))
              )
            ORDER BY g.last_served, g.deadline_key, g.since
            LIMIT 1
        ) AS pick
        FROM dispatch_fair_tenants t INDEXED BY fair_tenants_order
        WHERE pick IS NOT NULL
        ORDER BY t.priority DESC, t.last_served, t.since
        LIMIT 1
    )
)
RETURNING id, envelope, deliveries

-- name: ack
DELETE FROM agent_dispatch_queue WHERE id = :id AND claimed_by = :owner AND claimed_at = :claimed_at

-- name: release
UPDATE agent_dispatch_queue SET visible_at = :now + :delay, claimed_by = NULL, claimed_at = NULL
WHERE id = :id AND claimed_by = :owner AND claimed_at = :claimed_at

-- name: depth
SELECT count(*) FROM agent_dispatch_queue WHERE claimed_by IS NULL OR visible_at <= :now
