-- name: hidden_due
SELECT 1 FROM agent_dispatch_queue INDEXED BY queue_hidden WHERE hidden = 1 AND visible_at <= ? LIMIT 1

-- name: unhide
-- Rows whose visibility ran out (a dead worker's claim, a release's delay, a
-- turn enqueued for later) are searched again: each claim runs this first
-- (when hidden_due finds such a row), at its own time, so the claim sees
-- every row visible by then (migration 018).
UPDATE agent_dispatch_queue INDEXED BY queue_hidden SET hidden = 0 WHERE hidden = 1 AND visible_at <= ?

-- name: get
-- The claim order of PostgreSQL's fair claim: expired deadlines first, so the
-- worker cancels them promptly; then priority, least-recently-served tenant,
-- least-recently-served session, deadline, enqueue order. Only the head of
-- each session is eligible, so turns of one session are handed out one at a
-- time, in order. The claim stamps its row's session as served; the tenant
-- rows and the stamps are kept by the triggers in schema.sql. coalesce()
-- evaluates its second subquery only when the first finds nothing, and the
-- tenants are read in order until one has an eligible head: one statement.
-- Each search reads only rows not hidden (see unhide) and, in a tenant, only
-- stamps below +Inf: the heads (the rows behind them have +Inf); the head
-- check reads its session's rows up to the head's item_seq, not those behind.
-- The tenants read are only those with a row to search (searchable, kept by
-- the triggers of migration 019): a tenant whose heads are all claimed costs
-- nothing.
UPDATE agent_dispatch_queue
SET claimed_by = :owner, claimed_at = :now, visible_at = :now + :vis, deliveries = deliveries + 1,
    group_served = :now, hidden = :vis > 0
WHERE id = coalesce(
    (
        SELECT q.id FROM agent_dispatch_queue q INDEXED BY queue_deadline
        WHERE q.hidden = 0 AND q.deadline_unix IS NOT NULL AND q.deadline_unix <= :now AND q.visible_at <= :now
        ORDER BY q.deadline_unix LIMIT 1
    ),
    (
        SELECT pick FROM (
            -- Tenants in order, each with its first eligible session head (NULL: none).
            SELECT (
                SELECT q.id FROM agent_dispatch_queue q INDEXED BY queue_fair
                WHERE q.tenant_ref = t.tenant_ref AND q.priority = t.priority AND q.hidden = 0
                  AND q.group_served < 9e999 AND q.visible_at <= :now
                  AND NOT EXISTS (
                      SELECT 1 FROM agent_dispatch_queue p INDEXED BY queue_session
                      WHERE p.session_ref = q.session_ref AND p.item_seq <= q.item_seq
                        AND (p.item_seq < q.item_seq OR p.id < q.id)
                  )
                ORDER BY q.group_served, coalesce(q.deadline_unix, 9e999), q.item_seq, q.id
                LIMIT 1
            ) AS pick
            FROM dispatch_fair_tenants t INDEXED BY fair_tenants_open
            WHERE t.searchable = 1
            ORDER BY t.priority DESC, t.last_served, t.since
            -- A limit keeps this a coroutine read in order (not flattened into
            -- the outer query, which would run the pick twice per tenant).
            LIMIT -1
        )
        WHERE pick IS NOT NULL
        LIMIT 1
    )
)
RETURNING id, envelope, deliveries

-- name: ack
DELETE FROM agent_dispatch_queue WHERE id = :id AND claimed_by = :owner AND claimed_at = :claimed_at

-- name: release
UPDATE agent_dispatch_queue SET visible_at = :now + :delay, claimed_by = NULL, claimed_at = NULL, hidden = :delay > 0
WHERE id = :id AND claimed_by = :owner AND claimed_at = :claimed_at

-- name: depth
SELECT count(*) FROM agent_dispatch_queue WHERE claimed_by IS NULL OR visible_at <= :now
