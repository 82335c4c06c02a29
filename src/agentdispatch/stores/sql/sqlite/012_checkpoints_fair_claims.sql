-- A turn's saved progress (guard.checkpoint): JSON text, written only by the
-- fenced checkpoint statement, read with the item by the next attempt.
ALTER TABLE work_items ADD COLUMN checkpoint TEXT;

-- Fair claims, in the order PostgreSQL claims (migration 004 there): expired
-- deadlines first; then priority, least-recently-served tenant, least-recently-
-- served group (the session), deadline, enqueue order. One row per (priority,
-- tenant) and per (priority, session) with queued rows, kept by the triggers
-- below on every path that adds, claims or removes a queue row. SQLite has one
-- writer at a time, so a claim sees every earlier claim's marks.
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
CREATE TABLE IF NOT EXISTS dispatch_fair_groups (
    priority     INTEGER NOT NULL,
    group_ref    TEXT NOT NULL,
    tenant_ref   TEXT NOT NULL,
    deadline_key REAL NOT NULL,
    since        INTEGER NOT NULL,
    last_served  REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, group_ref)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS fair_groups_order
    ON dispatch_fair_groups (tenant_ref, priority, last_served, deadline_key, since);

INSERT OR IGNORE INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
SELECT priority, session_ref, min(tenant_ref), coalesce(min(deadline_unix), 9e999), min(id)
FROM agent_dispatch_queue GROUP BY priority, session_ref;
INSERT OR IGNORE INTO dispatch_fair_tenants (priority, tenant_ref, since)
SELECT priority, tenant_ref, min(id) FROM agent_dispatch_queue GROUP BY priority, tenant_ref;

CREATE TRIGGER IF NOT EXISTS queue_fair_added AFTER INSERT ON agent_dispatch_queue
BEGIN
    INSERT OR IGNORE INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
    VALUES (NEW.priority, NEW.session_ref, NEW.tenant_ref, coalesce(NEW.deadline_unix, 9e999), NEW.id);
    -- An earlier deadline moves the group forward.
    UPDATE dispatch_fair_groups SET deadline_key = NEW.deadline_unix
    WHERE NEW.deadline_unix IS NOT NULL AND priority = NEW.priority AND group_ref = NEW.session_ref
      AND deadline_key > NEW.deadline_unix;
    INSERT OR IGNORE INTO dispatch_fair_tenants (priority, tenant_ref, since)
    VALUES (NEW.priority, NEW.tenant_ref, NEW.id);
END;

-- A claim marks its tenant and its group as served most recently.
CREATE TRIGGER IF NOT EXISTS queue_fair_served AFTER UPDATE OF claimed_by ON agent_dispatch_queue
WHEN NEW.claimed_by IS NOT NULL
BEGIN
    UPDATE dispatch_fair_tenants SET last_served = NEW.claimed_at
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref;
    UPDATE dispatch_fair_groups SET last_served = NEW.claimed_at
    WHERE priority = NEW.priority AND group_ref = NEW.session_ref;
END;

-- The last queue row of a group removes the group, and the last group its tenant.
CREATE TRIGGER IF NOT EXISTS queue_fair_removed AFTER DELETE ON agent_dispatch_queue
WHEN NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_session
    WHERE q.session_ref = OLD.session_ref AND q.priority = OLD.priority
)
BEGIN
    DELETE FROM dispatch_fair_groups WHERE priority = OLD.priority AND group_ref = OLD.session_ref;
    DELETE FROM dispatch_fair_tenants
    WHERE priority = OLD.priority AND tenant_ref = OLD.tenant_ref
      AND NOT EXISTS (
          SELECT 1 FROM dispatch_fair_groups g
          WHERE g.tenant_ref = OLD.tenant_ref AND g.priority = OLD.priority
      );
END;
