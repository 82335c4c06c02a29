-- name: get
-- Expired deadlines first, so the worker cancels them promptly; then priority
-- and submission order, where only the head of each session is eligible, so
-- turns of one session are handed out one at a time, in order. coalesce()
-- evaluates its second subquery only when the first finds nothing: one
-- statement either way.
UPDATE agent_dispatch_queue
SET claimed_by = :owner, claimed_at = :now, visible_at = :now + :vis, deliveries = deliveries + 1
WHERE id = coalesce(
    (
        SELECT q.id FROM agent_dispatch_queue q INDEXED BY queue_deadline
        WHERE q.deadline_unix IS NOT NULL AND q.deadline_unix <= :now AND q.visible_at <= :now
        ORDER BY q.deadline_unix LIMIT 1
    ),
    (
        SELECT q.id FROM agent_dispatch_queue q INDEXED BY queue_order
        WHERE q.visible_at <= :now
          AND NOT EXISTS (
              SELECT 1 FROM agent_dispatch_queue p INDEXED BY queue_session
              WHERE p.session_ref = q.session_ref
                AND (p.item_seq < q.item_seq OR (p.item_seq = q.item_seq AND p.id < q.id))
          )
        ORDER BY q.priority DESC, q.item_seq, q.id
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
