-- A fair claim's search reads only rows it could take. Before, each tenant's
-- search walked its queue_fair range past every claimed head (still stamped
-- and indexed among the eligible ones until its visibility ran out) and every
-- row behind a head, rejecting them one by one: a claim that came up short
-- cost as much as the turns in flight and the backlog behind the heads, while
-- holding the one write lock.
--
-- hidden is 1 on a row written with its visible_at in the future (a claim, a
-- release with a delay, a turn enqueued for later). Each claim first clears it
-- on the rows whose visible_at has passed (queue_hidden holds only the hidden
-- rows), so a row is searched again from the moment it is visible, as before.
-- queue_fair and queue_deadline lead with it, so a search reads the rows
-- not hidden only.
--
-- The rows behind a head keep the stamp +Inf (9e999), and the search stops
-- below it. A head enqueued in front of its session's rows (a turn whose
-- dependency settled after a later turn of its session was queued, or one
-- queued again) got +Inf too and sorted after every other head of its tenant;
-- it now gets 1e308 instead, which sorts in the same place (after every real
-- stamp) but below the bound. The other statements and the trigger that read
-- the stamps treat 1e308 as they treated +Inf on a head, so the claim order
-- is the same.
ALTER TABLE agent_dispatch_queue ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0;
UPDATE agent_dispatch_queue SET hidden = 1 WHERE visible_at > (julianday('now') - 2440587.5) * 86400.0;
UPDATE agent_dispatch_queue SET group_served = 1e308
WHERE group_served = 9e999 AND NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue p
    WHERE p.session_ref = agent_dispatch_queue.session_ref
      AND (p.item_seq < agent_dispatch_queue.item_seq
           OR (p.item_seq = agent_dispatch_queue.item_seq AND p.id < agent_dispatch_queue.id))
);

DROP INDEX queue_fair;
CREATE INDEX queue_fair ON agent_dispatch_queue (
    tenant_ref, priority, hidden, group_served, coalesce(deadline_unix, 9e999), item_seq, id
);
DROP INDEX queue_deadline;
CREATE INDEX queue_deadline ON agent_dispatch_queue (hidden, deadline_unix)
    WHERE deadline_unix IS NOT NULL;
CREATE INDEX queue_hidden ON agent_dispatch_queue (visible_at) WHERE hidden = 1;

-- A turn enqueued for later (a retry's backoff) is hidden until it is due.
CREATE TRIGGER queue_hidden_added AFTER INSERT ON agent_dispatch_queue
WHEN NEW.visible_at > NEW.enqueued_at
BEGIN
    UPDATE agent_dispatch_queue SET hidden = 1 WHERE id = NEW.id;
END;

-- A head leaving the queue hands its stamp to the new head of its session when
-- that row has none of its own (+Inf, or 1e308: a head enqueued in front).
DROP TRIGGER queue_fair_next;
CREATE TRIGGER queue_fair_next AFTER DELETE ON agent_dispatch_queue
WHEN OLD.group_served < 9e999
BEGIN
    UPDATE agent_dispatch_queue SET group_served = OLD.group_served
    WHERE id = (
        SELECT n.id FROM agent_dispatch_queue n INDEXED BY queue_session
        WHERE n.session_ref = OLD.session_ref ORDER BY n.item_seq, n.id LIMIT 1
    ) AND group_served >= 1e308;
END;
