-- agentdispatch schema, PostgreSQL (the shared state store of a fleet).
-- Times are epoch seconds (double precision) read from the database clock, so
-- the columns compare directly with those of the SQLite store.
CREATE TABLE IF NOT EXISTS dispatch_meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);

-- The one writable authority of every unit of work. Inspectable with plain SQL.
CREATE TABLE IF NOT EXISTS work_items (
    seq              bigserial PRIMARY KEY,
    id               text NOT NULL UNIQUE,
    tenant           text NOT NULL,
    session_id       text NOT NULL,
    session_ref      text NOT NULL,
    kind             text NOT NULL,
    agent_name       text NOT NULL DEFAULT '',
    payload          text NOT NULL,
    priority         integer NOT NULL DEFAULT 0,
    status           text NOT NULL CHECK (status IN (
        'submitted', 'ready', 'leased', 'running', 'succeeded', 'failed', 'cancelled', 'dead_letter')),
    reason           text,
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL,
    dependencies     text NOT NULL DEFAULT '[]',
    deadline_unix    double precision,
    created_at       double precision NOT NULL,
    ready_at         double precision NOT NULL,
    updated_at       double precision NOT NULL,
    completed_at     double precision,
    lease_owner      text,
    lease_epoch      bigint NOT NULL DEFAULT 0,
    lease_token      text,
    lease_expires_at double precision,
    result           text,
    error            text,
    run_id           text
);
CREATE INDEX IF NOT EXISTS work_items_session_active ON work_items (session_ref, seq)
    WHERE status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_held ON work_items (lease_expires_at)
    WHERE status IN ('leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_deadline ON work_items (deadline_unix)
    WHERE deadline_unix IS NOT NULL AND status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_ready ON work_items (ready_at) WHERE status = 'ready';
CREATE INDEX IF NOT EXISTS work_items_tenant_status ON work_items (tenant, status, seq);

-- Admission depth: the number of non-terminal items, kept by triggers in the
-- same transaction as every transition. Sharded over 64 slots: a writer takes
-- the first slot no other open transaction holds (starting at its backend's
-- own), so terminal commits never queue on one another's counter row while
-- their COMMIT waits for the disk.
CREATE TABLE IF NOT EXISTS dispatch_depth (
    slot integer PRIMARY KEY,
    n    bigint NOT NULL DEFAULT 0
);
INSERT INTO dispatch_depth (slot, n) SELECT s, 0 FROM generate_series(0, 63) AS s ON CONFLICT DO NOTHING;

-- The slot this transaction adds to (one it holds already, or a free one).
CREATE OR REPLACE FUNCTION dispatch_depth_add(k bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    mine integer := mod(pg_backend_pid(), 64);
BEGIN
    IF k = 0 THEN
        RETURN;
    END IF;
    PERFORM 1 FROM dispatch_depth WHERE slot = mine FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        mine := coalesce((SELECT d.slot FROM dispatch_depth d
                          ORDER BY mod(d.slot - mine + 64, 64) LIMIT 1 FOR UPDATE SKIP LOCKED), mine);
    END IF;
    UPDATE dispatch_depth SET n = n + k WHERE slot = mine;
END $$;

CREATE OR REPLACE FUNCTION dispatch_is_active(status text) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status IN ('submitted', 'ready', 'leased', 'running') THEN 1 ELSE 0 END
$$;

CREATE OR REPLACE FUNCTION dispatch_items_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add((SELECT coalesce(sum(dispatch_is_active(status)), 0) FROM added));
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION dispatch_items_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add(dispatch_is_active(NEW.status) - dispatch_is_active(OLD.status));
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION dispatch_items_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add(-(SELECT coalesce(sum(dispatch_is_active(status)), 0) FROM removed));
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS work_items_inserted ON work_items;
CREATE TRIGGER work_items_inserted AFTER INSERT ON work_items
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_items_inserted();
DROP TRIGGER IF EXISTS work_items_status ON work_items;
CREATE TRIGGER work_items_status AFTER UPDATE OF status ON work_items FOR EACH ROW
    WHEN (dispatch_is_active(OLD.status) IS DISTINCT FROM dispatch_is_active(NEW.status))
    EXECUTE FUNCTION dispatch_items_status();
DROP TRIGGER IF EXISTS work_items_deleted ON work_items;
CREATE TRIGGER work_items_deleted AFTER DELETE ON work_items
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION dispatch_items_deleted();

-- The read half of a transition in one round trip: the clock, the item (locked),
-- whether any item waits on it and, for a claim (p_session), what blocks its
-- session. Each query of a VOLATILE function takes a fresh snapshot, so the
-- queries after a lock see the commit of whoever held it before.
CREATE OR REPLACE FUNCTION dispatch_item_read(p_id text, p_session boolean)
RETURNS TABLE (
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w work_items;
BEGIN
    now := extract(epoch FROM clock_timestamp())::float8;
    SELECT * INTO w FROM work_items WHERE id = p_id FOR UPDATE;
    IF FOUND THEN
        item := row_to_json(w);
        leaf := NOT EXISTS (SELECT 1 FROM work_dependencies d WHERE d.depends_on = p_id);
        IF p_session THEN
            -- Fleet-wide per-session exclusion, held to the end of the claim.
            PERFORM pg_advisory_xact_lock(hashtextextended('agentdispatch.session:' || w.session_ref, 0));
            SELECT b.status, b.lease_expires_at INTO blocker_status, blocker_expires_at
            FROM work_items b
            WHERE b.session_ref = w.session_ref
              AND b.status IN ('submitted', 'ready', 'leased', 'running')
              AND b.id <> w.id
              AND (b.seq < w.seq OR b.status IN ('leased', 'running'))
            LIMIT 1;
        END IF;
    END IF;
    RETURN NEXT;
END $$;

-- Compare-and-admit, exact under any number of concurrent submitters, without
-- one global lock while the depth is far from the bound. There are 16 admission
-- tokens (transaction-level advisory locks). A small submission (<= 8 items)
-- far from the bound holds one token, taken without waiting: while it holds
-- it, at most 15 other small submissions (<= 8 items each) are uncommitted, so
-- "committed depth + 16 x 8 <= bound", read after taking the token, proves
-- that every one of them fits. Any other submission takes all 16 tokens in
-- order (waiting for the small ones in flight, and none can start meanwhile):
-- then the committed depth is the exact depth. A submission that does not fit
-- the committed depth is refused without a lock. Only submissions increase the
-- depth (a replay re-admits what was admitted before). Returns that depth; a
-- small submission that saw the depth cross the margin while taking its token
-- (rare: the hint before it leaves a second margin) fails with a serialization
-- failure, which the store retries (then on the exact path).
CREATE OR REPLACE FUNCTION dispatch_admission(p_n integer, p_max bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    tokens CONSTANT integer := 16;
    per_token CONSTANT integer := 8;
    margin CONSTANT bigint := 16 * 8;
    space integer := hashtext('agentdispatch.admission:' || current_schema());
    first integer := mod(pg_backend_pid(), 16);
    depth bigint;
BEGIN
    IF p_max IS NOT NULL THEN
        depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
        IF depth + p_n > p_max THEN
            RETURN depth;  -- refused on committed state (completions only lower it): no lock
        END IF;
        IF p_n <= per_token AND depth + 2 * margin <= p_max THEN
            FOR i IN 0 .. tokens - 1 LOOP
                IF pg_try_advisory_xact_lock(space, mod(first + i, tokens)) THEN
                    -- A fresh snapshot, taken while holding the token.
                    depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
                    IF depth + margin <= p_max THEN
                        RETURN depth;
                    END IF;
                    RAISE EXCEPTION 'admission: the depth neared the bound; retry' USING ERRCODE = '40001';
                END IF;
            END LOOP;
        END IF;
    END IF;
    FOR i IN 0 .. tokens - 1 LOOP
        PERFORM pg_advisory_xact_lock(space, i);
    END LOOP;
    RETURN (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
END $$;

-- The read half of a submission in one round trip: admission (above), then,
-- in fresh snapshots, the clock, n item sequence numbers and the existing
-- items (locked).
CREATE OR REPLACE FUNCTION dispatch_submit_read(p_ids text[], p_n integer, p_max bigint)
RETURNS TABLE (now double precision, depth bigint, seqs bigint[], items json)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    depth := dispatch_admission(p_n, p_max);
    now := extract(epoch FROM clock_timestamp())::float8;
    seqs := ARRAY(SELECT nextval(pg_get_serial_sequence('work_items', 'seq')) FROM generate_series(1, p_n));
    items := (SELECT json_agg(row_to_json(w)) FROM (
        SELECT * FROM work_items WHERE id = ANY(p_ids) ORDER BY id FOR UPDATE) w);
    RETURN NEXT;
END $$;

CREATE TABLE IF NOT EXISTS work_dependencies (
    depends_on text NOT NULL,
    job_id     text NOT NULL,
    PRIMARY KEY (depends_on, job_id)
);

-- Append-only provenance: every transition, attempt and outcome.
CREATE TABLE IF NOT EXISTS work_events (
    id      bigserial PRIMARY KEY,
    job_id  text NOT NULL,
    at      double precision NOT NULL,
    event   text NOT NULL,
    status  text NOT NULL,
    attempt integer NOT NULL,
    epoch   bigint NOT NULL,
    detail  text
);
CREATE INDEX IF NOT EXISTS work_events_job ON work_events (job_id, id);

-- The idempotency ledger behind guard.side_effect(key, fn).
CREATE TABLE IF NOT EXISTS side_effects (
    tenant     text NOT NULL,
    key        text NOT NULL,
    job_id     text NOT NULL,
    state      text NOT NULL,
    epoch      bigint NOT NULL,
    result     text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS side_effects_job ON side_effects (job_id);

-- Envelopes that failed validation, recorded once before their ack.
CREATE TABLE IF NOT EXISTS poison_envelopes (
    digest     text PRIMARY KEY,
    raw        text NOT NULL,
    reason     text NOT NULL,
    created_at double precision NOT NULL
);

CREATE TABLE IF NOT EXISTS dispatch_workers (
    worker_id       text PRIMARY KEY,
    host            text NOT NULL,
    capacity        integer NOT NULL,
    active_sessions text NOT NULL,
    queue_backend   text NOT NULL,
    started_at      double precision NOT NULL,
    last_heartbeat  double precision NOT NULL
);

-- The queue (and, under an external transport, the outbox). Scheduling columns
-- hold opaque keyed references, not names. The fairness group is the session.
CREATE TABLE IF NOT EXISTS agent_dispatch_queue (
    id            bigserial PRIMARY KEY,
    job_id        text NOT NULL,
    item_seq      bigint NOT NULL,
    session_ref   text NOT NULL,
    tenant_ref    text NOT NULL,
    group_ref     text NOT NULL,
    priority      integer NOT NULL,
    deadline_unix double precision,
    envelope      text NOT NULL,
    enqueued_at   double precision NOT NULL,
    visible_at    double precision NOT NULL,
    claimed_by    text,
    claimed_at    double precision,
    deliveries    integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue_group_head ON agent_dispatch_queue (group_ref, priority, item_seq, id);
CREATE INDEX IF NOT EXISTS queue_session ON agent_dispatch_queue (session_ref, item_seq, id);
CREATE INDEX IF NOT EXISTS queue_deadline ON agent_dispatch_queue (deadline_unix)
    WHERE deadline_unix IS NOT NULL;
CREATE INDEX IF NOT EXISTS queue_job ON agent_dispatch_queue (job_id);

-- Fairness state: one row per (priority, tenant) and per (priority, group) that
-- has queued rows. A claim walks tenants, then groups, least recently served
-- first (small tables, index scans only) and marks what it served, skipping a
-- row another claim is marking at that moment (that claim marks it as recent).
-- Nothing on the acknowledgement's path waits for these rows: an emptied group
-- (then tenant) is pruned without waiting, and the reconciler prunes any that a
-- concurrent writer kept from being pruned.
--
-- Lock protocol (no row is ever pruned under a queue row being added):
--   * a writer adding queue rows inserts the missing group and tenant rows and
--     share-locks them (FOR KEY SHARE) to its COMMIT;
--   * a pruner locks candidate rows FOR UPDATE SKIP LOCKED, then, in a later
--     statement (a snapshot taken while it holds the locks), deletes only those
--     it locked that are still empty. A writer that added a row before the lock
--     has committed (visible then); one after it waits, finds the row gone and
--     inserts it again;
--   * a claim marks rows served FOR NO KEY UPDATE SKIP LOCKED: it never waits.
CREATE SEQUENCE IF NOT EXISTS dispatch_served_seq;
CREATE TABLE IF NOT EXISTS dispatch_fair_tenants (
    priority    integer NOT NULL,
    tenant_ref  text NOT NULL,
    since       bigint NOT NULL,
    last_served bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, tenant_ref)
);
CREATE INDEX IF NOT EXISTS fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since);
CREATE TABLE IF NOT EXISTS dispatch_fair_groups (
    priority     integer NOT NULL,
    group_ref    text NOT NULL,
    tenant_ref   text NOT NULL,
    deadline_key double precision NOT NULL,
    since        bigint NOT NULL,
    last_served  bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, group_ref)
);
CREATE INDEX IF NOT EXISTS fair_groups_order
    ON dispatch_fair_groups (tenant_ref, priority, last_served, deadline_key, since);

CREATE OR REPLACE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    want bigint;
    got bigint;
BEGIN
    -- Groups before tenants, keys in order: every writer locks in the same order.
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
        SELECT priority, group_ref, min(tenant_ref), coalesce(min(deadline_unix), 'Infinity'::double precision), min(id)
        FROM added GROUP BY priority, group_ref ORDER BY priority, group_ref
        ON CONFLICT (priority, group_ref) DO NOTHING;
        got := (SELECT count(*) FROM (
            SELECT 1 FROM dispatch_fair_groups g
            WHERE (g.priority, g.group_ref) IN (SELECT priority, group_ref FROM added)
            ORDER BY g.priority, g.group_ref
            FOR KEY SHARE OF g) k);
        EXIT WHEN got >= want;  -- else a pruner deleted one meanwhile: insert it again
    END LOOP;
    -- An earlier deadline moves the group forward (its own row only).
    UPDATE dispatch_fair_groups g SET deadline_key = d.k
    FROM (SELECT priority, group_ref, min(deadline_unix) AS k FROM added
          WHERE deadline_unix IS NOT NULL GROUP BY priority, group_ref) d
    WHERE g.priority = d.priority AND g.group_ref = d.group_ref AND g.deadline_key > d.k;
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_tenants (priority, tenant_ref, since)
        SELECT priority, tenant_ref, min(id)
        FROM added GROUP BY priority, tenant_ref ORDER BY priority, tenant_ref
        ON CONFLICT (priority, tenant_ref) DO NOTHING;
        got := (SELECT count(*) FROM (
            SELECT 1 FROM dispatch_fair_tenants t
            WHERE (t.priority, t.tenant_ref) IN (SELECT priority, tenant_ref FROM added)
            ORDER BY t.priority, t.tenant_ref
            FOR KEY SHARE OF t) k);
        EXIT WHEN got >= want;
    END LOOP;
    -- One notification per transaction (identical payloads coalesce): wakes idle workers.
    PERFORM pg_notify('agent_dispatch_queue', '');
    RETURN NULL;
END $$;

-- Prune the given groups (then their tenants) that have no queue row left,
-- never waiting for a lock (see the protocol above). Returns the groups pruned.
CREATE OR REPLACE FUNCTION dispatch_fair_prune(p_prios integer[], p_groups text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    gp integer[];
    gr text[];
    tp integer[];
    tr text[];
    pruned integer;
BEGIN
    SELECT array_agg(c.priority), array_agg(c.group_ref) INTO gp, gr FROM (
        SELECT g.priority, g.group_ref FROM dispatch_fair_groups g
        JOIN unnest(p_prios, p_groups) AS k(priority, group_ref)
          ON g.priority = k.priority AND g.group_ref = k.group_ref
        WHERE NOT EXISTS (
            SELECT 1 FROM agent_dispatch_queue q WHERE q.group_ref = g.group_ref AND q.priority = g.priority)
        FOR UPDATE OF g SKIP LOCKED) c;
    IF gp IS NULL THEN
        RETURN 0;
    END IF;
    -- A fresh snapshot, under the locks: delete those still empty.
    WITH gone AS (
        DELETE FROM dispatch_fair_groups g USING unnest(gp, gr) AS k(priority, group_ref)
        WHERE g.priority = k.priority AND g.group_ref = k.group_ref
          AND NOT EXISTS (
              SELECT 1 FROM agent_dispatch_queue q WHERE q.group_ref = g.group_ref AND q.priority = g.priority)
        RETURNING g.priority, g.tenant_ref
    )
    SELECT count(*), array_agg(priority), array_agg(tenant_ref) INTO pruned, tp, tr FROM gone;
    IF pruned = 0 THEN
        RETURN 0;
    END IF;
    SELECT array_agg(c.priority), array_agg(c.tenant_ref) INTO tp, tr FROM (
        SELECT t.priority, t.tenant_ref FROM dispatch_fair_tenants t
        WHERE (t.priority, t.tenant_ref) IN (SELECT * FROM unnest(tp, tr))
          AND NOT EXISTS (
              SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority)
        FOR UPDATE OF t SKIP LOCKED) c;
    IF tp IS NOT NULL THEN
        DELETE FROM dispatch_fair_tenants t USING unnest(tp, tr) AS k(priority, tenant_ref)
        WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
          AND NOT EXISTS (
              SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority);
    END IF;
    RETURN pruned;
END $$;

-- Row by row (simple statements with cached plans; the usual delete is one
-- acknowledged row): prune the row's group, then its tenant, when emptied.
CREATE OR REPLACE FUNCTION dispatch_queue_removed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM agent_dispatch_queue q
               WHERE q.group_ref = OLD.group_ref AND q.priority = OLD.priority) THEN
        RETURN NULL;  -- the usual case when a group holds more than one turn
    END IF;
    PERFORM 1 FROM dispatch_fair_groups g
    WHERE g.priority = OLD.priority AND g.group_ref = OLD.group_ref FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;  -- gone already, or a writer holds it (then it is not empty for long)
    END IF;
    -- A fresh snapshot, under the lock.
    DELETE FROM dispatch_fair_groups g
    WHERE g.priority = OLD.priority AND g.group_ref = OLD.group_ref
      AND NOT EXISTS (SELECT 1 FROM agent_dispatch_queue q
                      WHERE q.group_ref = OLD.group_ref AND q.priority = OLD.priority);
    IF NOT FOUND OR EXISTS (SELECT 1 FROM dispatch_fair_groups g
                            WHERE g.tenant_ref = OLD.tenant_ref AND g.priority = OLD.priority) THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM dispatch_fair_tenants t
    WHERE t.priority = OLD.priority AND t.tenant_ref = OLD.tenant_ref FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        DELETE FROM dispatch_fair_tenants t
        WHERE t.priority = OLD.priority AND t.tenant_ref = OLD.tenant_ref
          AND NOT EXISTS (SELECT 1 FROM dispatch_fair_groups g
                          WHERE g.tenant_ref = OLD.tenant_ref AND g.priority = OLD.priority);
    END IF;
    RETURN NULL;
END $$;

-- The reconciler's pass: the most recently served groups (a concurrent claim
-- may have kept one from being pruned) and tenants left without groups.
CREATE OR REPLACE FUNCTION dispatch_fair_sweep(p_limit integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    pruned integer;
    tp integer[];
    tr text[];
BEGIN
    pruned := (SELECT dispatch_fair_prune(array_agg(r.priority), array_agg(r.group_ref)) FROM (
        SELECT g.priority, g.group_ref FROM dispatch_fair_groups g
        ORDER BY g.last_served DESC LIMIT p_limit) r);
    SELECT array_agg(c.priority), array_agg(c.tenant_ref) INTO tp, tr FROM (
        SELECT t.priority, t.tenant_ref FROM dispatch_fair_tenants t
        WHERE NOT EXISTS (
            SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED) c;
    IF tp IS NOT NULL THEN
        DELETE FROM dispatch_fair_tenants t USING unnest(tp, tr) AS k(priority, tenant_ref)
        WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
          AND NOT EXISTS (
              SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority);
    END IF;
    RETURN coalesce(pruned, 0);
END $$;

DROP TRIGGER IF EXISTS queue_added ON agent_dispatch_queue;
CREATE TRIGGER queue_added AFTER INSERT ON agent_dispatch_queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_added();
DROP TRIGGER IF EXISTS queue_removed ON agent_dispatch_queue;
CREATE TRIGGER queue_removed AFTER DELETE ON agent_dispatch_queue
    FOR EACH ROW EXECUTE FUNCTION dispatch_queue_removed();
