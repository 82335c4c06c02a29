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
-- same transaction as every transition. Sharded over 16 slots (one per backend)
-- so terminal commits of different workers do not queue on one hot row.
CREATE TABLE IF NOT EXISTS dispatch_depth (
    slot integer PRIMARY KEY,
    n    bigint NOT NULL DEFAULT 0
);
INSERT INTO dispatch_depth (slot, n) SELECT s, 0 FROM generate_series(0, 15) AS s ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION dispatch_is_active(status text) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status IN ('submitted', 'ready', 'leased', 'running') THEN 1 ELSE 0 END
$$;

CREATE OR REPLACE FUNCTION dispatch_items_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE dispatch_depth SET n = n + d.k
    FROM (SELECT sum(dispatch_is_active(status)) AS k FROM added) d
    WHERE slot = mod(pg_backend_pid(), 16) AND d.k <> 0;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION dispatch_items_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE dispatch_depth SET n = n + dispatch_is_active(NEW.status) - dispatch_is_active(OLD.status)
    WHERE slot = mod(pg_backend_pid(), 16);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION dispatch_items_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE dispatch_depth SET n = n - d.k
    FROM (SELECT sum(dispatch_is_active(status)) AS k FROM removed) d
    WHERE slot = mod(pg_backend_pid(), 16) AND d.k <> 0;
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

-- The read half of a submission in one round trip: take the admission lock
-- (serializes compare-and-admit), then, in fresh snapshots, the clock, the
-- admitted depth, n item sequence numbers and the existing items (locked).
CREATE OR REPLACE FUNCTION dispatch_submit_read(p_ids text[], p_n integer)
RETURNS TABLE (now double precision, depth bigint, seqs bigint[], items json)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('agentdispatch.admission:' || current_schema(), 0));
    now := extract(epoch FROM clock_timestamp())::float8;
    depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
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
-- has queued rows, with a count kept by triggers so a row disappears (history
-- pruned) exactly when its last queue row goes. A claim walks tenants, then
-- groups, least recently served first: small tables, index scans only.
CREATE SEQUENCE IF NOT EXISTS dispatch_served_seq;
CREATE TABLE IF NOT EXISTS dispatch_fair_tenants (
    priority    integer NOT NULL,
    tenant_ref  text NOT NULL,
    queued      bigint NOT NULL,
    since       bigint NOT NULL,
    last_served bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, tenant_ref)
);
CREATE INDEX IF NOT EXISTS fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since);
CREATE TABLE IF NOT EXISTS dispatch_fair_groups (
    priority     integer NOT NULL,
    group_ref    text NOT NULL,
    tenant_ref   text NOT NULL,
    queued       bigint NOT NULL,
    deadline_key double precision NOT NULL,
    since        bigint NOT NULL,
    last_served  bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, group_ref)
);
CREATE INDEX IF NOT EXISTS fair_groups_order
    ON dispatch_fair_groups (tenant_ref, priority, last_served, deadline_key, since);

CREATE OR REPLACE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Groups before tenants, keys in order: every writer locks in the same order.
    INSERT INTO dispatch_fair_groups AS g (priority, group_ref, tenant_ref, queued, deadline_key, since)
    SELECT priority, group_ref, min(tenant_ref), count(*),
           coalesce(min(deadline_unix), 'Infinity'::double precision), min(id)
    FROM added GROUP BY priority, group_ref ORDER BY priority, group_ref
    ON CONFLICT (priority, group_ref) DO UPDATE
        SET queued = g.queued + excluded.queued, deadline_key = least(g.deadline_key, excluded.deadline_key);
    INSERT INTO dispatch_fair_tenants AS t (priority, tenant_ref, queued, since)
    SELECT priority, tenant_ref, count(*), min(id)
    FROM added GROUP BY priority, tenant_ref ORDER BY priority, tenant_ref
    ON CONFLICT (priority, tenant_ref) DO UPDATE SET queued = t.queued + excluded.queued;
    -- One notification per transaction (identical payloads coalesce): wakes idle workers.
    PERFORM pg_notify('agent_dispatch_queue', '');
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION dispatch_queue_removed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE dispatch_fair_groups g SET queued = g.queued - d.n
    FROM (SELECT priority, group_ref, count(*) AS n FROM removed GROUP BY priority, group_ref) d
    WHERE g.priority = d.priority AND g.group_ref = d.group_ref;
    DELETE FROM dispatch_fair_groups g USING (SELECT DISTINCT priority, group_ref FROM removed) d
    WHERE g.priority = d.priority AND g.group_ref = d.group_ref AND g.queued <= 0;
    UPDATE dispatch_fair_tenants t SET queued = t.queued - d.n
    FROM (SELECT priority, tenant_ref, count(*) AS n FROM removed GROUP BY priority, tenant_ref) d
    WHERE t.priority = d.priority AND t.tenant_ref = d.tenant_ref;
    DELETE FROM dispatch_fair_tenants t USING (SELECT DISTINCT priority, tenant_ref FROM removed) d
    WHERE t.priority = d.priority AND t.tenant_ref = d.tenant_ref AND t.queued <= 0;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS queue_added ON agent_dispatch_queue;
CREATE TRIGGER queue_added AFTER INSERT ON agent_dispatch_queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_added();
DROP TRIGGER IF EXISTS queue_removed ON agent_dispatch_queue;
CREATE TRIGGER queue_removed AFTER DELETE ON agent_dispatch_queue
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_removed();
