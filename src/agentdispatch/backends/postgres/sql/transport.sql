-- name: get
-- The fair claim of up to %(n)s turns in one statement (dispatch_claim, in
-- schema.sql, holds the claim order and its reasons).
SELECT id, envelope, deliveries, claimed_at, job_id, now, item, leaf, blocker_status, blocker_expires_at
FROM dispatch_claim(%(owner)s, %(vis)s, %(n)s, %(read)s, %(listener)s, %(mark_s)s)

-- name: forget_marks
-- Marks long expired (a killed process's claimers), cleared by the listener's
-- probe of its connection. Never waits: a mark a claim is renewing stays.
DELETE FROM dispatch_waiting w
WHERE w.owner IN (
    SELECT m.owner FROM dispatch_waiting m WHERE m.until < now() - interval '1 minute'
    FOR UPDATE SKIP LOCKED)

-- name: ack
-- RETURNING: the answer is a row, which pipeline mode delivers on fetch. The
-- delete trigger prunes an emptied group without waiting for any lock.
DELETE FROM agent_dispatch_queue
WHERE id = %(id)s AND claimed_by = %(owner)s AND claimed_at = %(claimed_at)s
RETURNING id

-- name: ack_many
-- A batch's acknowledgements in one statement; each receipt is fenced as in ack.
DELETE FROM agent_dispatch_queue q
USING unnest(%(ids)b::bigint[], %(owners)b::text[], %(claimed_at)b::float8[]) AS r(id, owner, claimed_at)
WHERE q.id = r.id AND q.claimed_by = r.owner AND q.claimed_at = r.claimed_at
RETURNING q.id

-- name: release
-- A released head holds its group until its row is visible again, or not at
-- all without a delay (see 022_held_groups.sql); a row behind the head
-- leaves its group as it is. A group freed frees its tenant (023).
WITH r AS (
    UPDATE agent_dispatch_queue
    SET visible_at = extract(epoch FROM clock_timestamp())::float8 + %(delay)s, claimed_by = NULL, claimed_at = NULL
    WHERE id = %(id)s AND claimed_by = %(owner)s AND claimed_at = %(claimed_at)s
    RETURNING priority, group_ref, item_seq, id, visible_at
), g AS (
    UPDATE dispatch_fair_groups g SET held_until = CASE WHEN %(delay)s > 0 THEN r.visible_at ELSE 0 END
    FROM r
    WHERE g.priority = r.priority AND g.group_ref = r.group_ref
      AND NOT EXISTS (
          SELECT 1 FROM agent_dispatch_queue p
          WHERE p.group_ref = r.group_ref AND p.priority = r.priority AND (p.item_seq, p.id) < (r.item_seq, r.id))
    RETURNING g.priority, g.tenant_ref, g.held_until
)
SELECT dispatch_fair_unhold(array_agg(g.priority), array_agg(g.tenant_ref)) FROM g WHERE g.held_until = 0

-- name: depth
SELECT count(*) AS n FROM agent_dispatch_queue
WHERE claimed_by IS NULL OR visible_at <= extract(epoch FROM clock_timestamp())::float8

-- name: probe
SELECT 1 AS ok FROM agent_dispatch_queue WHERE false
