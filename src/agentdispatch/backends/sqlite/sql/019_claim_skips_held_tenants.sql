-- A fair claim's walk over the tenants reads only tenants it could serve.
-- Before, it read every tenant with a queued row, in order, and searched each
-- one's heads: a tenant whose every session head was claimed (one live
-- conversation, its turn in flight) cost a search that found nothing, so a
-- claim that came up short cost as much as the tenants with turns in flight,
-- while holding the one write lock.
--
-- searchable is 1 on a tenant (and priority) with a row that the claim's
-- search reads (migration 018): not hidden, stamped below +Inf. A tenant
-- without one has nothing claimable, and the walk's index (fair_tenants_open)
-- holds only the searchable tenants, in the same order as before, so the claim
-- order is the same. Triggers keep the flag on every insert, delete and change
-- of hidden or group_served, whichever statement makes it (a claim, an
-- acknowledgement, a release, a visibility that ran out, a new head after its
-- session's head left, a stamp taken back): a tenant is in the index again the
-- moment it has a row to search. The flag is written only when it changes; a
-- row that stops being searchable looks for another one (one index seek).
ALTER TABLE dispatch_fair_tenants ADD COLUMN searchable INTEGER NOT NULL DEFAULT 0;
UPDATE dispatch_fair_tenants SET searchable = EXISTS (
    SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
    WHERE q.tenant_ref = dispatch_fair_tenants.tenant_ref AND q.priority = dispatch_fair_tenants.priority
      AND q.hidden = 0 AND q.group_served < 9e999
);

DROP INDEX fair_tenants_order;
CREATE INDEX fair_tenants_open ON dispatch_fair_tenants (priority DESC, last_served, since, searchable)
    WHERE searchable = 1;

-- A new row makes its tenant searchable when the search will read it: a turn
-- enqueued for later is hidden by queue_hidden_added, whichever trigger runs
-- first.
DROP TRIGGER queue_fair_added;
CREATE TRIGGER queue_fair_added AFTER INSERT ON agent_dispatch_queue
BEGIN
    INSERT INTO dispatch_fair_tenants (priority, tenant_ref, since, searchable)
    VALUES (
        NEW.priority, NEW.tenant_ref, NEW.id,
        NEW.hidden = 0 AND NEW.visible_at <= NEW.enqueued_at AND NEW.group_served < 9e999
    )
    ON CONFLICT (priority, tenant_ref) DO UPDATE SET searchable = 1 WHERE excluded.searchable AND searchable = 0;
END;

-- A claim (the one statement that counts a delivery) marks its tenant served
-- and, in the same write, whether the tenant has a row left to search.
DROP TRIGGER queue_fair_served;
CREATE TRIGGER queue_fair_served AFTER UPDATE OF claimed_by ON agent_dispatch_queue
WHEN NEW.claimed_by IS NOT NULL
BEGIN
    UPDATE dispatch_fair_tenants SET last_served = NEW.claimed_at, searchable = EXISTS (
        SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
        WHERE q.tenant_ref = NEW.tenant_ref AND q.priority = NEW.priority AND q.hidden = 0 AND q.group_served < 9e999
    )
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref;
END;

-- Any other change: a row the search now reads makes its tenant searchable; a
-- row it no longer reads (or a deleted one) leaves the tenant searchable only
-- if another row is.
CREATE TRIGGER queue_fair_opened AFTER UPDATE OF hidden, group_served ON agent_dispatch_queue
WHEN NEW.hidden = 0 AND NEW.group_served < 9e999 AND NOT (OLD.hidden = 0 AND OLD.group_served < 9e999)
BEGIN
    UPDATE dispatch_fair_tenants SET searchable = 1
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref AND searchable = 0;
END;
CREATE TRIGGER queue_fair_closed AFTER UPDATE OF hidden, group_served ON agent_dispatch_queue
WHEN NEW.deliveries = OLD.deliveries AND OLD.hidden = 0 AND OLD.group_served < 9e999
 AND NOT (NEW.hidden = 0 AND NEW.group_served < 9e999)
BEGIN
    UPDATE dispatch_fair_tenants SET searchable = 0
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref AND searchable = 1 AND NOT EXISTS (
        SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
        WHERE q.tenant_ref = NEW.tenant_ref AND q.priority = NEW.priority AND q.hidden = 0 AND q.group_served < 9e999
    );
END;
CREATE TRIGGER queue_fair_gone AFTER DELETE ON agent_dispatch_queue
WHEN OLD.hidden = 0 AND OLD.group_served < 9e999
BEGIN
    UPDATE dispatch_fair_tenants SET searchable = 0
    WHERE priority = OLD.priority AND tenant_ref = OLD.tenant_ref AND searchable = 1 AND NOT EXISTS (
        SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
        WHERE q.tenant_ref = OLD.tenant_ref AND q.priority = OLD.priority AND q.hidden = 0 AND q.group_served < 9e999
    );
END;
