-- A turn's saved progress (guard.checkpoint): JSON text, written only by the
-- fenced checkpoint statement, read with the item by the next attempt.
ALTER TABLE work_items ADD COLUMN checkpoint TEXT;

-- Fair claims, in the order PostgreSQL claims (migration 004 there): expired
-- deadlines first; then priority, least-recently-served tenant, least-recently-
-- served group (the session), deadline, enqueue order. SQLite has one writer at
-- a time, so a claim sees every earlier claim's marks.
--
-- Tenants: one row per (priority, tenant) with queued rows, kept by triggers.
-- Sessions: marked on the queue rows themselves (no table to write per turn).
-- group_served is when the session was last served (0: never) on its head
-- row, and +Inf on the rows behind the head, so a tenant's eligible heads come
-- first in index order. A claim stamps the row it claims; when a head leaves
-- the queue, the next row of its session inherits the stamp.
ALTER TABLE agent_dispatch_queue ADD COLUMN group_served REAL NOT NULL DEFAULT 0;
UPDATE agent_dispatch_queue SET group_served = 9e999
WHERE EXISTS (
    SELECT 1 FROM agent_dispatch_queue p
    WHERE p.session_ref = agent_dispatch_queue.session_ref
      AND (p.item_seq < agent_dispatch_queue.item_seq
           OR (p.item_seq = agent_dispatch_queue.item_seq AND p.id < agent_dispatch_queue.id))
);
CREATE INDEX IF NOT EXISTS queue_fair
    ON agent_dispatch_queue (tenant_ref, priority, group_served, coalesce(deadline_unix, 9e999), item_seq, id);
DROP INDEX IF EXISTS queue_order;

-- last_served is the claim's time (one writer at a time on one host's clock:
-- no sequence to read and write on every claim).
CREATE TABLE IF NOT EXISTS dispatch_fair_tenants (
    priority    INTEGER NOT NULL,
    tenant_ref  TEXT NOT NULL,
    since       INTEGER NOT NULL,
    last_served REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, tenant_ref)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since);
INSERT OR IGNORE INTO dispatch_fair_tenants (priority, tenant_ref, since)
SELECT priority, tenant_ref, min(id) FROM agent_dispatch_queue GROUP BY priority, tenant_ref;

CREATE TRIGGER IF NOT EXISTS queue_fair_added AFTER INSERT ON agent_dispatch_queue
BEGIN
    INSERT OR IGNORE INTO dispatch_fair_tenants (priority, tenant_ref, since)
    VALUES (NEW.priority, NEW.tenant_ref, NEW.id);
END;

-- A claim marks its tenant as served most recently (the claim stamps its row).
CREATE TRIGGER IF NOT EXISTS queue_fair_served AFTER UPDATE OF claimed_by ON agent_dispatch_queue
WHEN NEW.claimed_by IS NOT NULL
BEGIN
    UPDATE dispatch_fair_tenants SET last_served = NEW.claimed_at
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref;
END;

-- A head leaving the queue hands its stamp to the next row of its session; the
-- last row of a tenant removes the tenant.
CREATE TRIGGER IF NOT EXISTS queue_fair_next AFTER DELETE ON agent_dispatch_queue
WHEN OLD.group_served < 9e999
BEGIN
    UPDATE agent_dispatch_queue SET group_served = OLD.group_served
    WHERE id = (
        SELECT n.id FROM agent_dispatch_queue n INDEXED BY queue_session
        WHERE n.session_ref = OLD.session_ref ORDER BY n.item_seq, n.id LIMIT 1
    ) AND group_served = 9e999;
END;
CREATE TRIGGER IF NOT EXISTS queue_fair_removed AFTER DELETE ON agent_dispatch_queue
WHEN NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
    WHERE q.tenant_ref = OLD.tenant_ref AND q.priority = OLD.priority
)
BEGIN
    DELETE FROM dispatch_fair_tenants WHERE priority = OLD.priority AND tenant_ref = OLD.tenant_ref;
END;
