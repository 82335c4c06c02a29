-- schema version: 18
-- agentdispatch schema, PostgreSQL (the shared state store of a fleet): the
-- whole current schema, applied to a fresh database. Later changes are the
-- numbered migrations beside this file (see agentdispatch.stores.schema).
-- Times are epoch seconds (double precision) read from the database clock, so
-- the columns compare directly with those of the SQLite store.
CREATE TABLE dispatch_meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);

-- The one writable authority of every unit of work. Inspectable with plain SQL.
CREATE TABLE work_items (
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
    run_id           text,
    -- Seed 002's operator queries run verbatim on work_items: agent_id names
    -- the agent (PostgreSQL 15 stores generated columns: a copy of
    -- agent_name), and the intake phase acquisitions (capture, then turn) are
    -- mirrored from the receipt; other kinds keep 0 there (their deliveries
    -- are counted in attempts).
    agent_id         text GENERATED ALWAYS AS (agent_name) STORED,
    intake_attempts  integer NOT NULL DEFAULT 0,
    turn_attempts    integer NOT NULL DEFAULT 0,
    -- A turn's saved progress (guard.checkpoint): JSON text, written only by
    -- the fenced checkpoint statement, read with the item by the next attempt.
    checkpoint       text,
    -- A submission's own execution timeout (Submission.timeout_s): past it the
    -- worker cancels the turn and fails it retryably with reason "timeout".
    timeout_s        double precision
);
CREATE INDEX work_items_session_active ON work_items (session_ref, seq)
    WHERE status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX work_items_held ON work_items (lease_expires_at)
    WHERE status IN ('leased', 'running');
CREATE INDEX work_items_deadline ON work_items (deadline_unix)
    WHERE deadline_unix IS NOT NULL AND status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX work_items_ready ON work_items (ready_at) WHERE status = 'ready';
CREATE INDEX work_items_tenant_status ON work_items (tenant, status, seq);
-- The per-agent intake backlog bound counts these inside the intake transaction.
CREATE INDEX work_items_intake_agent ON work_items (agent_name)
    WHERE kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running');


-- Admission depth: the number of non-terminal items, kept by triggers in the
-- same transaction as every transition. Sharded over 64 slots: a writer takes
-- the first slot no other open transaction holds (starting at its backend's
-- own), so terminal commits never queue on one another's counter row while
-- their COMMIT waits for the disk.
CREATE TABLE dispatch_depth (
    slot integer PRIMARY KEY,
    n    bigint NOT NULL DEFAULT 0
);
INSERT INTO dispatch_depth (slot, n) SELECT s, 0 FROM generate_series(0, 63) AS s;

-- The slot this transaction adds to (one it holds already, or a free one).
CREATE FUNCTION dispatch_depth_add(k bigint) RETURNS void
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

CREATE FUNCTION dispatch_is_active(status text) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status IN ('submitted', 'ready', 'leased', 'running') THEN 1 ELSE 0 END
$$;

CREATE FUNCTION dispatch_items_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add((SELECT coalesce(sum(dispatch_is_active(status)), 0) FROM added));
    RETURN NULL;
END $$;

CREATE FUNCTION dispatch_items_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add(dispatch_is_active(NEW.status) - dispatch_is_active(OLD.status));
    RETURN NULL;
END $$;

CREATE FUNCTION dispatch_items_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_depth_add(-(SELECT coalesce(sum(dispatch_is_active(status)), 0) FROM removed));
    RETURN NULL;
END $$;

CREATE TRIGGER work_items_inserted AFTER INSERT ON work_items
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_items_inserted();
CREATE TRIGGER work_items_status AFTER UPDATE OF status ON work_items FOR EACH ROW
    WHEN (dispatch_is_active(OLD.status) IS DISTINCT FROM dispatch_is_active(NEW.status))
    EXECUTE FUNCTION dispatch_items_status();
CREATE TRIGGER work_items_deleted AFTER DELETE ON work_items
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION dispatch_items_deleted();

-- The read half of a transition in one round trip: the clock, the item (locked),
-- whether any item waits on it and, for a claim (p_session), what blocks its
-- session. Each query of a VOLATILE function takes a fresh snapshot, so the
-- queries after a lock see the commit of whoever held it before.
CREATE FUNCTION dispatch_item_read(p_id text, p_session boolean)
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
-- far from the bound holds one token: a free one, else it waits for one (a
-- holder keeps it for one transaction only; taking every token instead would
-- make more than 16 concurrent submitters run one at a time). While it holds
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
CREATE FUNCTION dispatch_admission(p_n integer, p_max bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    tokens CONSTANT integer := 16;
    per_token CONSTANT integer := 8;
    margin CONSTANT bigint := 16 * 8;
    space integer := hashtext('agentdispatch.admission:' || current_schema());
    first integer := mod(pg_backend_pid(), 16);
    depth bigint;
    held boolean := false;
BEGIN
    IF p_max IS NOT NULL THEN
        depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
        IF depth + p_n > p_max THEN
            RETURN depth;  -- refused on committed state (completions only lower it): no lock
        END IF;
        IF p_n <= per_token AND depth + 2 * margin <= p_max THEN
            FOR i IN 0 .. tokens - 1 LOOP
                held := pg_try_advisory_xact_lock(space, mod(first + i, tokens));
                EXIT WHEN held;
            END LOOP;
            IF NOT held THEN
                PERFORM pg_advisory_xact_lock(space, first);  -- one holder's transaction, not every token
            END IF;
            -- A fresh snapshot, taken while holding the token.
            depth := (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
            IF depth + margin <= p_max THEN
                RETURN depth;
            END IF;
            RAISE EXCEPTION 'admission: the depth neared the bound; retry' USING ERRCODE = '40001';
        END IF;
    END IF;
    FOR i IN 0 .. tokens - 1 LOOP
        PERFORM pg_advisory_xact_lock(space, i);
    END LOOP;
    RETURN (SELECT coalesce(sum(d.n), 0)::bigint FROM dispatch_depth d);
END $$;

-- n item sequence numbers in one call, the sequence looked up once (a cast of
-- its name at every row would be a catalog lookup per item).
CREATE FUNCTION dispatch_next_seqs(p_n integer) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_seq regclass := pg_get_serial_sequence('work_items', 'seq')::regclass;
BEGIN
    RETURN ARRAY(SELECT nextval(v_seq) FROM generate_series(1, p_n));
END $$;

-- The read half of a submission in one round trip: admission (above), then,
-- in fresh snapshots, the clock, n item sequence numbers and the existing
-- items (locked).
CREATE FUNCTION dispatch_submit_read(p_ids text[], p_n integer, p_max bigint)
RETURNS TABLE (now double precision, depth bigint, seqs bigint[], items json)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    depth := dispatch_admission(p_n, p_max);
    now := extract(epoch FROM clock_timestamp())::float8;
    seqs := dispatch_next_seqs(p_n);
    items := (SELECT json_agg(row_to_json(w)) FROM (
        SELECT * FROM work_items WHERE id = ANY(p_ids) ORDER BY id FOR UPDATE) w);
    RETURN NEXT;
END $$;

-- A submission of new items in one statement: one round trip (autocommit)
-- before the caller has its handle, instead of a read, then a write with the
-- COMMIT. The engine plans the rows in the client without reading (every id
-- new, the client's clock p_at); here they are checked and written:
--   * any id that exists already: nothing is written, the answer is 'exists'
--     and the caller takes the general path (which answers with that item);
--   * compare-and-admit as the general path does (dispatch_admission): over
--     the bound, nothing is written and the answer is 'full' with the depth;
--   * else the rows are written with their times moved onto the database
--     clock (by the returned shift, which the caller applies to its copies)
--     and sequence numbers drawn in submission order (returned in that order).
-- The statement triggers (depth, fairness rows, NOTIFY) run as for any insert.
CREATE FUNCTION dispatch_submit_new(
    p_max bigint, p_at double precision, p_items json, p_events json, p_queue json
)
RETURNS TABLE (outcome text, depth bigint, shift double precision, seqs bigint[])
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ids text[];
    v_n integer;
BEGIN
    -- An accepted submission is durable before the caller hears of it, whatever
    -- the server's default.
    PERFORM set_config('synchronous_commit', 'on', true);
    v_ids := ARRAY(SELECT i.id FROM json_populate_recordset(NULL::work_items, p_items) i);
    v_n := cardinality(v_ids);
    IF EXISTS (SELECT 1 FROM work_items w WHERE w.id = ANY(v_ids)) THEN
        outcome := 'exists';
        RETURN NEXT;
        RETURN;
    END IF;
    depth := dispatch_admission(v_n, p_max);
    IF depth + v_n > p_max THEN
        outcome := 'full';
        RETURN NEXT;
        RETURN;
    END IF;
    shift := extract(epoch FROM clock_timestamp())::float8 - p_at;
    seqs := ARRAY(SELECT nextval(pg_get_serial_sequence('work_items', 'seq')) FROM generate_series(1, v_n));
    WITH items AS (
        INSERT INTO work_items (
            seq, id, tenant, session_id, session_ref, kind, agent_name, payload, priority, status,
            reason, attempts, max_attempts, dependencies, deadline_unix, created_at, ready_at,
            updated_at, lease_epoch
        )
        SELECT seqs[i.ordinality], i.id, i.tenant, i.session_id, i.session_ref, i.kind, i.agent_name, i.payload,
               i.priority, i.status, i.reason, i.attempts, i.max_attempts, i.dependencies, i.deadline_unix,
               i.created_at + shift, i.ready_at + shift, i.updated_at + shift, i.lease_epoch
        FROM json_populate_recordset(NULL::work_items, p_items) WITH ORDINALITY AS i
        RETURNING id, seq
    ), events AS (
        INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
        SELECT e.job_id, e.at + shift, e.event, e.status, e.attempt, e.epoch, e.detail
        FROM json_populate_recordset(NULL::work_events, p_events) AS e
    )
    INSERT INTO agent_dispatch_queue (
        job_id, item_seq, session_ref, tenant_ref, group_ref, priority, deadline_unix, envelope,
        enqueued_at, visible_at
    )
    SELECT q.job_id, items.seq, q.session_ref, q.tenant_ref, q.group_ref, q.priority, q.deadline_unix,
           jsonb_set(q.envelope::jsonb, '{enqueued_at}', ((q.enqueued_at + shift)::text)::jsonb)::text,
           q.enqueued_at + shift, q.visible_at + shift
    FROM json_populate_recordset(NULL::agent_dispatch_queue, p_queue) WITH ORDINALITY AS q
    JOIN items ON items.id = q.job_id
    ORDER BY q.ordinality;
    outcome := 'ok';
    RETURN NEXT;
END $$;

CREATE TABLE work_dependencies (
    depends_on text NOT NULL,
    job_id     text NOT NULL,
    PRIMARY KEY (depends_on, job_id)
);

-- Append-only provenance: every transition, attempt and outcome.
CREATE TABLE work_events (
    id      bigserial PRIMARY KEY,
    job_id  text NOT NULL,
    at      double precision NOT NULL,
    event   text NOT NULL,
    status  text NOT NULL,
    attempt integer NOT NULL,
    epoch   bigint NOT NULL,
    detail  text
);
CREATE INDEX work_events_job ON work_events (job_id, id);
-- Workers poll for cancelled jobs they run (Store.cancelled_since), about
-- once a second: an index of the cancellation events alone keeps that read
-- small and leaves every other event insert as it was.
CREATE INDEX work_events_cancelled ON work_events (at) WHERE event = 'cancelled';

-- The idempotency ledger behind guard.side_effect(key, fn).
CREATE TABLE side_effects (
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
CREATE INDEX side_effects_job ON side_effects (job_id);

-- Envelopes that failed validation, recorded once before their ack.
CREATE TABLE poison_envelopes (
    digest     text PRIMARY KEY,
    raw        text NOT NULL,
    reason     text NOT NULL,
    created_at double precision NOT NULL
);

CREATE TABLE dispatch_workers (
    worker_id       text PRIMARY KEY,
    host            text NOT NULL,
    capacity        integer NOT NULL,
    active_sessions text NOT NULL,
    queue_backend   text NOT NULL,
    started_at      double precision NOT NULL,
    last_heartbeat  double precision NOT NULL,
    -- Which process the worker is (pid namespace, pid, start time), so a peer
    -- on the same host can tell that it died and end its leases at once.
    process         text NOT NULL DEFAULT ''
);

-- The queue (and, under an external transport, the outbox). Scheduling columns
-- hold opaque keyed references, not names. The fairness group is the session.
CREATE TABLE agent_dispatch_queue (
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
CREATE INDEX queue_group_head ON agent_dispatch_queue (group_ref, priority, item_seq, id);
CREATE INDEX queue_session ON agent_dispatch_queue (session_ref, item_seq, id);
CREATE INDEX queue_deadline ON agent_dispatch_queue (deadline_unix)
    WHERE deadline_unix IS NOT NULL;
CREATE INDEX queue_job ON agent_dispatch_queue (job_id);

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
CREATE SEQUENCE dispatch_served_seq;
CREATE TABLE dispatch_fair_tenants (
    priority    integer NOT NULL,
    tenant_ref  text NOT NULL,
    since       bigint NOT NULL,
    last_served bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, tenant_ref)
);
CREATE INDEX fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since);
CREATE TABLE dispatch_fair_groups (
    priority     integer NOT NULL,
    group_ref    text NOT NULL,
    tenant_ref   text NOT NULL,
    deadline_key double precision NOT NULL,
    since        bigint NOT NULL,
    last_served  bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, group_ref)
);
CREATE INDEX fair_groups_order
    ON dispatch_fair_groups (tenant_ref, priority, last_served, deadline_key, since);

-- Claimers about to wait for news of new queue rows, one row each: the enqueue
-- triggers notify only while one is marked (each notifying commit takes a
-- database-wide lock, serializing the commits of concurrent enqueuers). A claim
-- that runs dry (finds fewer rows than asked for) marks its claimer until a
-- little past its next poll: an idle claimer's claims keep renewing it, and a
-- busy fleet's marks lapse, so a backlog's submitters notify nobody. A killed
-- process's marks only cost notifications until they expire; listeners clear
-- them later. UNLOGGED: after a crash nobody is marked, which costs a waiter
-- one poll.
CREATE UNLOGGED TABLE dispatch_waiting (
    owner    text PRIMARY KEY,
    listener integer NOT NULL,
    until    timestamptz NOT NULL
);

-- A writer adding queue rows: its fairness rows, then one notification per
-- transaction while some claimer waits (a plain read: enqueuers never wait on
-- each other for it). Every fairness row it checks, locks or moves is found by
-- an index probe per key (an "IN (SELECT ... FROM added)" check would be planned
-- as a scan of the whole table once a statement adds a few hundred rows).
-- Groups before tenants, keys in order; re-insert what a pruner deleted meanwhile.
CREATE FUNCTION dispatch_queue_added() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    want bigint;
    got bigint;
    d record;
BEGIN
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_groups (priority, group_ref, tenant_ref, deadline_key, since)
        SELECT priority, group_ref, min(tenant_ref), coalesce(min(deadline_unix), 'Infinity'::double precision), min(id)
        FROM added GROUP BY priority, group_ref ORDER BY priority, group_ref
        ON CONFLICT (priority, group_ref) DO NOTHING;
        got := (SELECT count(*) FROM (SELECT DISTINCT priority, group_ref FROM added ORDER BY 1, 2) k
                CROSS JOIN LATERAL (
                    SELECT 1 FROM dispatch_fair_groups g
                    WHERE g.priority = k.priority AND g.group_ref = k.group_ref
                    FOR KEY SHARE OF g) x);
        EXIT WHEN got >= want;  -- else a pruner deleted one meanwhile: insert it again
    END LOOP;
    -- An earlier deadline moves the group forward (its own row only, found by
    -- key: a join could scan the table, and a concurrent claim's update of the
    -- row is followed by key).
    FOR d IN SELECT priority, group_ref, min(deadline_unix) AS k FROM added
             WHERE deadline_unix IS NOT NULL GROUP BY priority, group_ref ORDER BY priority, group_ref LOOP
        UPDATE dispatch_fair_groups g SET deadline_key = d.k
        WHERE g.priority = d.priority AND g.group_ref = d.group_ref AND g.deadline_key > d.k;
    END LOOP;
    want := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added) k);
    LOOP
        INSERT INTO dispatch_fair_tenants (priority, tenant_ref, since)
        SELECT priority, tenant_ref, min(id)
        FROM added GROUP BY priority, tenant_ref ORDER BY priority, tenant_ref
        ON CONFLICT (priority, tenant_ref) DO NOTHING;
        got := (SELECT count(*) FROM (SELECT DISTINCT priority, tenant_ref FROM added ORDER BY 1, 2) k
                CROSS JOIN LATERAL (
                    SELECT 1 FROM dispatch_fair_tenants t
                    WHERE t.priority = k.priority AND t.tenant_ref = k.tenant_ref
                    FOR KEY SHARE OF t) x);
        EXIT WHEN got >= want;
    END LOOP;
    IF EXISTS (SELECT 1 FROM dispatch_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify('agent_dispatch_queue', '');
    END IF;
    RETURN NULL;
END $$;

-- Idle workers wake one waiter per notification; the queue_added trigger's
-- notification (payload '') says "a row came". A statement that adds several
-- rows also says how many, so as many idle waiters wake to claim them (no
-- woken waiter has to wake the next one on the chance of more).
CREATE FUNCTION dispatch_queue_added_many() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    n bigint := (SELECT count(*) FROM added);
BEGIN
    IF n > 1 AND EXISTS (SELECT 1 FROM dispatch_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify('agent_dispatch_queue', n::text);
    END IF;
    RETURN NULL;
END $$;

-- Prune the given groups (then their tenants) that have no queue row left,
-- never waiting for a lock (see the protocol above). Returns the groups
-- pruned. Its statements take arrays: generic plans keep the planner from
-- re-planning them at every call (the plans are index probes either way).
CREATE FUNCTION dispatch_fair_prune(p_prios integer[], p_groups text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
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

-- Acknowledgements come in batches (one DELETE per batch of turns): prune
-- the emptied groups (then tenants) once per statement, set-based, instead
-- of once per row. Same protocol: nothing waits for a fairness row.
CREATE FUNCTION dispatch_queue_removed_rows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_fair_prune(array_agg(k.priority), array_agg(k.group_ref))
    FROM (SELECT DISTINCT r.priority, r.group_ref FROM removed r) k;
    RETURN NULL;
END $$;

-- The reconciler's pass: the most recently served groups (a concurrent claim
-- may have kept one from being pruned) and tenants left without groups.
CREATE FUNCTION dispatch_fair_sweep(p_limit integer) RETURNS integer
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

-- The session head of each fairness group, the one row of it a claim may
-- take: the group's first queued row (skipping one another claim holds
-- locked) unless an earlier turn of its session is still queued. Both
-- passes of the fair claim pick among these; the view is flattened into
-- their statements, so each stays an index probe per group.
CREATE VIEW dispatch_fair_heads AS
SELECT g.tenant_ref, g.priority, g.last_served, g.deadline_key, g.since, q.id, q.visible_at
FROM dispatch_fair_groups g
CROSS JOIN LATERAL (
    SELECT q.id, q.visible_at, q.session_ref, q.item_seq FROM agent_dispatch_queue q
    WHERE q.group_ref = g.group_ref AND q.priority = g.priority
    ORDER BY q.item_seq, q.id
    LIMIT 1 FOR UPDATE OF q SKIP LOCKED
) q
WHERE NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue p
    WHERE p.session_ref = q.session_ref AND (p.item_seq, p.id) < (q.item_seq, q.id)
);

-- The fair claim, p_n times in one statement: expired deadlines first; then
-- priority, least-recently-served tenant, least-recently-served group (the
-- session), deadline, enqueue order. Only the head row of a session is
-- eligible, so one session's turns are handed out one at a time, in order.
-- Every step is an index scan over a small fairness table or the queue. Each
-- pass is its own statement inside the function, so it sees the claims and
-- fairness marks of the passes before it; within a batch, tenants are served
-- in rounds (below), so one tenant's turns interleave with the others' within
-- a batch as across batches. With p_read (inside a transaction that goes on
-- to claim the items), each row also carries the item read for that claim
-- (dispatch_item_read), which locks the item and its session until the
-- transaction ends.
-- Its statements run with their generic plans: the planner's own choice
-- re-planned the big statement at every call once the fairness tables held
-- many tenants (the plans are index scans either way; the index-scan test
-- and the 1,000,000-row benchmark print them).
CREATE FUNCTION dispatch_claim_fair(p_owner text, p_vis double precision, p_n integer, p_read boolean)
RETURNS TABLE (
    id bigint, envelope text, deliveries integer, claimed_at double precision, job_id text,
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    got integer := 0;
    rec record;
    -- Tenants this call served in its current round, at priority v_prio: each
    -- is served once a round. Other claims' marks are not visible (their
    -- transactions are open) and the marks of tenant rows they hold are
    -- skipped, so without rounds one batch would serve one tenant many times.
    -- A round never steps below v_prio: priority comes before fairness.
    v_prio integer;
    v_served text[] := '{}';
    v_tenants bigint;
    v_counted integer;  -- the priority v_tenants counts
    v_k integer;  -- how many this pass may claim
    v_m integer;  -- sessions of one tenant this pass may claim (v_k: a lone tenant's new round)
    v_tops bigint;  -- tenants at the top priority, counted up to 2
    v_expired boolean;  -- this pass claimed an expired row
    v_before integer;
BEGIN
    WHILE got < p_n LOOP
        v_k := p_n - got;
        v_before := got;
        -- A new round of the top priority's only tenant takes the whole batch
        -- in one pass, as that many rounds would (a fleet of one tenant and many
        -- sessions would otherwise pay a pass per turn). With several tenants a
        -- pass serves each once: other claims hold some tenants' rows, and a
        -- pass taking several rounds of the rest would serve those more.
        v_m := 1;
        v_expired := false;
        IF v_k > 1 AND cardinality(v_served) = 0 THEN
            v_tops := (SELECT count(*) FROM (
                SELECT 1 FROM dispatch_fair_tenants x
                WHERE x.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
                LIMIT 2) n);
            IF v_tops = 1 THEN
                v_m := v_k;
            END IF;
        END IF;
        FOR rec IN
        WITH clock AS MATERIALIZED (
            SELECT extract(epoch FROM clock_timestamp())::float8 AS now
        ), expired AS MATERIALIZED (
            SELECT e.id FROM agent_dispatch_queue e
             WHERE e.deadline_unix IS NOT NULL AND e.deadline_unix <= (SELECT now FROM clock)
               AND e.visible_at <= (SELECT now FROM clock)
             ORDER BY e.deadline_unix
             LIMIT 1 FOR UPDATE OF e SKIP LOCKED
        ), round AS MATERIALIZED (
            -- Else up to v_k tenants of the top priority that no other claim is
            -- serving right now (their row is locked by it until it commits; its
            -- snapshot of last_served is not ours yet), least recently served
            -- first, one session head each: one tenant is not served many times
            -- in a row while a claim stalls. Priority order is kept: only the top
            -- priority, and the walk below covers everything else.
            -- A lone tenant (v_m > 1) gives up to v_m sessions, in order.
            SELECT h.id FROM dispatch_fair_tenants t
             CROSS JOIN LATERAL (
                 SELECT x.tenant_ref, x.priority FROM dispatch_fair_tenants x
                 WHERE x.priority = t.priority AND x.tenant_ref = t.tenant_ref
                 FOR NO KEY UPDATE SKIP LOCKED
             ) tl
             CROSS JOIN LATERAL (
                 SELECT h.id FROM dispatch_fair_heads h
                 WHERE h.tenant_ref = tl.tenant_ref AND h.priority = tl.priority
                   AND h.visible_at <= (SELECT now FROM clock)
                 ORDER BY h.last_served, h.deadline_key, h.since
                 LIMIT v_m
             ) h
             WHERE NOT EXISTS (SELECT 1 FROM expired)
               AND t.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
               AND (t.priority IS DISTINCT FROM v_prio OR NOT (t.tenant_ref = ANY(v_served)))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT v_k
        ), walk AS MATERIALIZED (
            -- Else one turn, walking every priority and tenant in order.
            SELECT h.id, t.priority, t.tenant_ref FROM dispatch_fair_tenants t
             CROSS JOIN LATERAL (
                 SELECT h.id FROM dispatch_fair_heads h
                 WHERE h.tenant_ref = t.tenant_ref AND h.priority = t.priority
                   AND h.visible_at <= (SELECT now FROM clock)
                 ORDER BY h.last_served, h.deadline_key, h.since
                 LIMIT 1
             ) h
             WHERE NOT EXISTS (SELECT 1 FROM expired) AND NOT EXISTS (SELECT 1 FROM round)
               AND (v_prio IS NULL OR t.priority > v_prio
                    OR (t.priority = v_prio AND NOT (t.tenant_ref = ANY(v_served))))
             ORDER BY t.priority DESC, t.last_served, t.since
             LIMIT 1
        ), walk_more AS MATERIALIZED (
            -- And the rest of a new round (v_m) when that turn's tenant is the
            -- top priority's only one (another claim holds its row right now):
            -- with several, one turn a pass keeps them taking turns, as rounds do.
            SELECT h.id FROM walk w
            CROSS JOIN LATERAL (
                SELECT h.id FROM dispatch_fair_heads h
                WHERE h.tenant_ref = w.tenant_ref AND h.priority = w.priority
                  AND h.visible_at <= (SELECT now FROM clock) AND h.id <> w.id
                ORDER BY h.last_served, h.deadline_key, h.since
                LIMIT v_m - 1
            ) h
            WHERE v_m > 1
              AND w.priority = (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1)
        ), pick AS MATERIALIZED (
            -- The picked ids as one array, in claim order: the update below is
            -- then a primary-key probe per id. Joined as a row set, the generic
            -- plan (which guesses LIMIT v_k at a tenth of the tenants) hashed
            -- the whole queue once the fairness tables held many tenants.
            SELECT ARRAY(
                SELECT id FROM expired UNION ALL SELECT id FROM round
                UNION ALL SELECT id FROM walk UNION ALL SELECT id FROM walk_more
            ) AS ids
        ), claimed AS (
            UPDATE agent_dispatch_queue q
            SET claimed_by = p_owner, claimed_at = clock.now, visible_at = clock.now + p_vis,
                deliveries = q.deliveries + 1
            FROM clock
            WHERE q.id = ANY((SELECT p.ids FROM pick p)::bigint[])
            RETURNING q.id, q.job_id, q.envelope, q.deliveries, q.claimed_at, q.priority, q.group_ref, q.tenant_ref
        ), mark AS MATERIALIZED (
            -- Least recently served is approximate by design: a row another claim is
            -- marking right now is skipped (that claim marks it as recent), so no claim
            -- ever waits for a fairness row.
            -- Stamped in the order the round picked them (the update returns its
            -- rows in id order): the next round serves them in the same order,
            -- not the tenant with the oldest rows first again.
            SELECT c.priority, c.group_ref, c.tenant_ref, nextval('dispatch_served_seq') AS n
            FROM (
                SELECT * FROM claimed c
                ORDER BY array_position((SELECT p.ids FROM pick p), c.id)
                OFFSET 0
            ) c
        ), lock_group AS MATERIALIZED (
            -- One index probe per claimed row (a join could become a scan).
            SELECT x.priority, x.group_ref FROM mark m
            CROSS JOIN LATERAL (
                SELECT x.priority, x.group_ref FROM dispatch_fair_groups x
                WHERE x.priority = m.priority AND x.group_ref = m.group_ref
                FOR NO KEY UPDATE SKIP LOCKED
            ) x
        ), served_group AS (
            UPDATE dispatch_fair_groups g SET last_served = m.n
            FROM lock_group l, mark m
            WHERE g.priority = l.priority AND g.group_ref = l.group_ref
              AND m.priority = l.priority AND m.group_ref = l.group_ref
        ), lock_tenant AS MATERIALIZED (
            -- A tenant served several times in the pass is stamped once, with its last mark.
            -- The top priority's only tenant (v_m > 1) is not stamped: there is no
            -- other to order it against, and a tenant added later starts at 0, before
            -- it, whatever its stamp. Each stamp is a row version, and while a long
            -- transaction holds vacuum back every claim steps over all of them. (An
            -- expired turn may be of any tenant: that pass stamps.)
            SELECT x.priority, x.tenant_ref, m.n FROM (
                SELECT m.priority, m.tenant_ref, max(m.n) AS n FROM mark m
                WHERE v_m = 1 OR EXISTS (SELECT 1 FROM expired)
                GROUP BY m.priority, m.tenant_ref
            ) m
            CROSS JOIN LATERAL (
                SELECT x.priority, x.tenant_ref FROM dispatch_fair_tenants x
                WHERE x.priority = m.priority AND x.tenant_ref = m.tenant_ref
                FOR NO KEY UPDATE SKIP LOCKED
            ) x
        ), served_tenant AS (
            UPDATE dispatch_fair_tenants t SET last_served = l.n
            FROM lock_tenant l
            WHERE t.priority = l.priority AND t.tenant_ref = l.tenant_ref
        )
        SELECT c.id, c.envelope, c.deliveries, c.claimed_at, c.job_id,
               r.now, r.item, r.leaf, r.blocker_status, r.blocker_expires_at, c.tenant_ref, c.priority,
               c.id IN (SELECT e.id FROM expired e) AS was_expired
        FROM claimed c
        LEFT JOIN LATERAL (
            SELECT * FROM dispatch_item_read(c.job_id, true) WHERE p_read
        ) r ON true
        ORDER BY array_position((SELECT p.ids FROM pick p), c.id)
        LOOP
            id := rec.id; envelope := rec.envelope; deliveries := rec.deliveries; claimed_at := rec.claimed_at;
            job_id := rec.job_id; now := rec.now; item := rec.item; leaf := rec.leaf;
            blocker_status := rec.blocker_status; blocker_expires_at := rec.blocker_expires_at;
            RETURN NEXT;
            got := got + 1;
            v_expired := v_expired OR rec.was_expired;
            IF rec.priority IS DISTINCT FROM v_prio THEN
                v_prio := rec.priority;
                v_served := '{}';
            END IF;
            IF NOT rec.tenant_ref = ANY(v_served) THEN
                v_served := v_served || rec.tenant_ref;
            END IF;
        END LOOP;
        IF got = v_before THEN
            EXIT WHEN v_prio IS NULL;
            v_prio := NULL;  -- the rest of the round is taken or locked: a new round
            v_served := '{}';
            CONTINUE;
        END IF;
        EXIT WHEN got >= p_n;  -- the batch is full (a single get ends here)
        -- A lone tenant's new round that came short took every session head it
        -- could: with no other tenant left (read after the pass: one added
        -- meanwhile gets its pass), another pass would find nothing.
        -- (The count is a statement of its own: in the IF's condition every pass
        -- would run it through the executor.)
        IF v_m > 1 AND NOT v_expired AND got - v_before < v_m THEN
            EXIT WHEN (SELECT count(*) FROM (SELECT 1 FROM dispatch_fair_tenants x LIMIT 2) n) <= 1;
        END IF;
        IF v_counted IS DISTINCT FROM v_prio THEN
            v_counted := v_prio;
            v_tenants := (SELECT count(*) FROM (
                SELECT 1 FROM dispatch_fair_tenants x WHERE x.priority = v_prio
                ORDER BY x.priority DESC, x.last_served, x.since LIMIT p_n + 1) n);
        END IF;
        IF cardinality(v_served) >= v_tenants THEN
            v_prio := NULL;  -- every tenant of this priority served once: a new round
            v_served := '{}';
        END IF;
    END LOOP;
END $$;

-- An idle worker's claim on an empty queue returns at once: no fairness row
-- means no queue row (a writer adds its fairness rows in the transaction that
-- adds the queue rows; a pruner removes them only when no queue row is left).
-- With p_listener (the backend pid of the claimer's LISTEN connection), a
-- claim that runs dry (finds fewer than p_n: its claimer waits for news next)
-- marks its claimer waiting in the same transaction, for p_mark_s: from its
-- commit on, enqueuers notify.
CREATE FUNCTION dispatch_claim(
    p_owner text, p_vis double precision, p_n integer, p_read boolean,
    p_listener integer DEFAULT NULL, p_mark_s double precision DEFAULT 0
)
RETURNS TABLE (
    id bigint, envelope text, deliveries integer, claimed_at double precision, job_id text,
    now double precision, item json, leaf boolean, blocker_status text, blocker_expires_at double precision
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    got bigint := 0;
BEGIN
    -- The top priority, as the claim reads it (an index scan, whatever the table's size).
    IF (SELECT m.priority FROM dispatch_fair_tenants m ORDER BY m.priority DESC LIMIT 1) IS NOT NULL THEN
        RETURN QUERY SELECT * FROM dispatch_claim_fair(p_owner, p_vis, p_n, p_read);
        GET DIAGNOSTICS got = ROW_COUNT;
    END IF;
    IF p_listener IS NOT NULL AND got < p_n THEN
        INSERT INTO dispatch_waiting AS w (owner, listener, until)
        VALUES (p_owner, p_listener, now() + make_interval(secs => p_mark_s))
        ON CONFLICT (owner) DO UPDATE SET listener = excluded.listener, until = excluded.until;
    END IF;
END $$;

-- The read half of a batch's commits: lock the items in id order (two batches
-- never wait on each other in a cycle), then read them in a snapshot taken
-- after the locks, with whether anything depends on each (a child submitted
-- while this waited is seen, and released by the commit).
CREATE FUNCTION dispatch_items_read(p_ids text[])
RETURNS TABLE (now double precision, item json, leaf boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM 1 FROM work_items w WHERE w.id = ANY(p_ids) ORDER BY w.id FOR UPDATE;
    RETURN QUERY
    SELECT extract(epoch FROM clock_timestamp())::float8, row_to_json(w),
           NOT EXISTS (SELECT 1 FROM work_dependencies d WHERE d.depends_on = w.id)
    FROM work_items w WHERE w.id = ANY(p_ids);
END $$;

CREATE TRIGGER queue_added AFTER INSERT ON agent_dispatch_queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_added();
CREATE TRIGGER queue_added_many AFTER INSERT ON agent_dispatch_queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_added_many();
CREATE TRIGGER queue_removed AFTER DELETE ON agent_dispatch_queue
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION dispatch_queue_removed_rows();

-- Bearer tokens of the gateway: stored hashed, each bound to one tenant.
CREATE TABLE api_tokens (
    token_id   text PRIMARY KEY,
    token_hash text NOT NULL UNIQUE,
    tenant     text NOT NULL,
    label      text NOT NULL DEFAULT '',
    created_at double precision NOT NULL,
    revoked_at double precision
);

-- Durable intake (Slack, Telegram, Twilio): installations, agents, routes,
-- receipts under their unique source identity, conversation history, runs.
CREATE TABLE intake_installations (
    id          text PRIMARY KEY,
    connector   text NOT NULL,
    external_id text NOT NULL,
    route_key   text NOT NULL,
    tenant      text NOT NULL,
    status      text NOT NULL DEFAULT 'active',
    credentials text NOT NULL,
    bot_user_id text NOT NULL DEFAULT '',
    api_base    text NOT NULL DEFAULT '',
    public_url  text NOT NULL DEFAULT '',
    created_at  double precision NOT NULL,
    updated_at  double precision NOT NULL,
    UNIQUE (connector, external_id)
);
CREATE INDEX intake_installations_route ON intake_installations (connector, route_key);

CREATE TABLE intake_agents (
    name       text PRIMARY KEY,
    enabled    integer NOT NULL DEFAULT 1,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);

CREATE TABLE intake_routes (
    installation_id text NOT NULL,
    channel         text NOT NULL,
    agent           text NOT NULL,
    updated_at      double precision NOT NULL,
    PRIMARY KEY (installation_id, channel)
);

-- One row per source identity, kept as a tombstone after the 7-day scrub.
CREATE TABLE intake_receipts (
    id              text PRIMARY KEY,
    connector       text NOT NULL,
    source_id       text NOT NULL,
    installation_id text NOT NULL DEFAULT '',
    tenant          text NOT NULL DEFAULT '',
    state           text NOT NULL,
    reason          text,
    job_id          text,
    agent           text NOT NULL DEFAULT '',
    conversation    text NOT NULL DEFAULT '',
    sender          text NOT NULL DEFAULT '',
    message_key     text NOT NULL DEFAULT '',
    body_sha256     text NOT NULL,
    body_size       integer NOT NULL,
    envelope        text,
    raw             text,
    answer_status   integer NOT NULL,
    answer_type     text NOT NULL,
    answer_body     text NOT NULL,
    retry_num       integer NOT NULL DEFAULT 0,
    retry_reason    text,
    mismatches      integer NOT NULL DEFAULT 0,
    captured        integer NOT NULL DEFAULT 0,
    engaged         integer,
    intake_attempts integer NOT NULL DEFAULT 0,
    turn_attempts   integer NOT NULL DEFAULT 0,
    steered_into    text,
    reply           text,
    received_at     double precision NOT NULL,
    finished_at     double precision,
    scrubbed_at     double precision,
    UNIQUE (connector, source_id)
);
CREATE INDEX intake_receipts_conversation ON intake_receipts (installation_id, conversation, received_at);
CREATE INDEX intake_receipts_scrub ON intake_receipts (received_at) WHERE scrubbed_at IS NULL;

-- Duplicates whose bytes differ from the original's.
CREATE TABLE intake_mismatches (
    id          bigserial PRIMARY KEY,
    receipt_id  text NOT NULL,
    body_sha256 text NOT NULL,
    at          double precision NOT NULL
);

CREATE TABLE intake_history (
    id              bigserial PRIMARY KEY,
    installation_id text NOT NULL,
    conversation    text NOT NULL,
    message_key     text NOT NULL,
    receipt_id      text,
    role            text NOT NULL,
    sender          text NOT NULL DEFAULT '',
    text            text NOT NULL DEFAULT '',
    at              double precision NOT NULL,
    UNIQUE (installation_id, conversation, message_key)
);

-- Active turns (capacity slots); a slot whose expiry passed is free again.
CREATE TABLE intake_runs (
    job_id          text PRIMARY KEY,
    agent           text NOT NULL,
    installation_id text NOT NULL,
    conversation    text NOT NULL,
    requester       text NOT NULL,
    started_at      double precision NOT NULL,
    expires_at      double precision NOT NULL
);
CREATE INDEX intake_runs_agent ON intake_runs (agent, expires_at);
CREATE INDEX intake_runs_installation ON intake_runs (installation_id, expires_at);

-- The per-agent intake backlog bound (256) without a wait: each admitted item
-- holds one of the agent's ``bound`` slot rows (its job id, written in the
-- intake transaction); a slot whose item is no longer active is free. An
-- intake locks a free slot with SKIP LOCKED, so concurrent intakes take
-- different slots and none waits for another; no free slot is a full backlog.
CREATE TABLE intake_backlog_slots (
    agent  text NOT NULL,
    slot   integer NOT NULL,
    job_id text,
    PRIMARY KEY (agent, slot)
);

-- The backlog slot of an intake without a join against work_items. The
-- earlier search (an anti-join of the agent's slots with the active items)
-- was planned while work_items looked empty, and PL/pgSQL keeps that plan:
-- on a new database it scanned the whole table once per held slot, tens of
-- milliseconds an intake after a few thousand items. Now the agent's active
-- item ids are read once (the partial index work_items_intake_agent), a slot
-- is free when its item is not among them, and the search starts at a random
-- slot, so it skips about bound / free held slots rather than all of them.
--
-- Returns the committed backlog when a slot was taken for p_job (below the
-- bound), else p_bound or more (refuse).
CREATE FUNCTION dispatch_intake_backlog(p_agent text, p_bound integer, p_job text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_active text[];
    n bigint;
    s record;
    v_start integer;
    v_after integer;
    v_below integer;
BEGIN
    v_active := ARRAY(SELECT w.id FROM work_items w
                      WHERE w.agent_name = p_agent AND w.kind = 'intake_turn'
                        AND w.status IN ('submitted', 'ready', 'leased', 'running'));
    n := cardinality(v_active);
    IF n >= p_bound THEN
        RETURN n;  -- full on committed state (completions only lower it): no lock
    END IF;
    IF NOT EXISTS (SELECT 1 FROM intake_backlog_slots WHERE agent = p_agent AND slot = p_bound - 1) THEN
        INSERT INTO intake_backlog_slots (agent, slot)
        SELECT p_agent, g FROM generate_series(0, p_bound - 1) g ON CONFLICT DO NOTHING;
    END IF;
    v_start := floor(random() * p_bound)::integer;
    -- Two passes: [v_start, p_bound), then [0, v_start).
    FOR pass IN 0..1 LOOP
        v_after := CASE WHEN pass = 0 THEN v_start - 1 ELSE -1 END;
        v_below := CASE WHEN pass = 0 THEN p_bound ELSE v_start END;
        LOOP
            -- Candidates by this statement's snapshot; the lock returns the
            -- slot's latest row, whose item is checked again below.
            SELECT b.slot, b.job_id INTO s FROM intake_backlog_slots b
            WHERE b.agent = p_agent AND b.slot > v_after AND b.slot < v_below
              AND (b.job_id IS NULL OR b.job_id <> ALL (v_active))
            ORDER BY b.slot LIMIT 1
            FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            -- A fresh snapshot: an item admitted into this slot since the
            -- active ids were read is seen now.
            IF s.job_id IS NULL OR NOT EXISTS (SELECT 1 FROM work_items w WHERE w.id = s.job_id
                                               AND w.status IN ('submitted', 'ready', 'leased', 'running')) THEN
                UPDATE intake_backlog_slots SET job_id = p_job WHERE agent = p_agent AND slot = s.slot;
                RETURN n;
            END IF;
            v_after := s.slot;
        END LOOP;
    END LOOP;
    RETURN greatest(n, p_bound);  -- every slot is held (or being taken)
END $$;

-- The intake request path in one statement (one round trip, autocommit):
-- the receipt under its unique source identity, the agent's backlog slot and
-- the WorkItem (dispatch_submit_new), or the original answer of a duplicate.
-- Run as some ten statements from a gateway thread each, intakes spent most
-- of their time in round trips, idle in transaction, behind the gateway's
-- other threads.
--
-- The commit is asynchronous: a commit that notifies (the new queue row wakes
-- workers) holds a database-wide lock until it ends, so flushing here made
-- intakes take turns at the disk. The caller answers 200 only after a flush
-- of the WAL that began after this commit (one flush shared by the gateway's
-- concurrent intakes), so an update answered 200 is on disk.
--
-- p_receipt: the receipt's columns (received_at is set here, on the database
-- clock, and copied into the envelope); p_channel: the channel whose route
-- names the agent (NULL: no agent); p_accept: create the WorkItem planned in
-- p_items/p_events/p_queue, its agent_name set here from the route.
-- outcome: accepted | duplicate | backlog_full | queue_full | exists (a
-- WorkItem has the id but no receipt does: nothing written, the caller takes
-- the general path).
CREATE FUNCTION dispatch_intake_admit(
    p_receipt json, p_channel text, p_accept boolean, p_bound integer,
    p_max bigint, p_at double precision, p_items json, p_events json, p_queue json
)
RETURNS TABLE (outcome text, agent text, answer_status integer, answer_type text, answer_body text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r intake_receipts;
    old intake_receipts;
    v_now double precision := extract(epoch FROM clock_timestamp())::float8;
    v_sub record;
BEGIN
    r := json_populate_record(NULL::intake_receipts, p_receipt);
    SELECT * INTO old FROM intake_receipts i WHERE i.connector = r.connector AND i.source_id = r.source_id;
    IF NOT FOUND THEN
        r.agent := '';
        IF p_channel IS NOT NULL THEN
            r.agent := coalesce((SELECT t.agent FROM intake_routes t
                                 WHERE t.installation_id = r.installation_id AND t.channel IN (p_channel, '*')
                                 ORDER BY CASE WHEN t.channel = '*' THEN 1 ELSE 0 END LIMIT 1), '');
        END IF;
        r.received_at := v_now;
        IF r.envelope IS NOT NULL THEN
            r.envelope := jsonb_set(r.envelope::jsonb, '{received_at}', to_jsonb(v_now))::text;
        END IF;
        -- The receipt first: a concurrent copy of the same update waits here
        -- for the first to end, and then answers as its duplicate.
        INSERT INTO intake_receipts
            (id, connector, source_id, installation_id, tenant, state, reason, job_id, agent, conversation, sender,
             message_key, body_sha256, body_size, envelope, raw, answer_status, answer_type, answer_body, retry_num,
             retry_reason, received_at)
        VALUES (r.id, r.connector, r.source_id, r.installation_id, r.tenant, r.state, r.reason, r.job_id, r.agent,
                r.conversation, r.sender, r.message_key, r.body_sha256, r.body_size, r.envelope, r.raw,
                r.answer_status, r.answer_type, r.answer_body, r.retry_num, r.retry_reason, r.received_at)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            IF p_accept THEN
                IF dispatch_intake_backlog(r.agent, p_bound, r.job_id) >= p_bound THEN
                    DELETE FROM intake_receipts i WHERE i.id = r.id;
                    RETURN QUERY SELECT 'backlog_full'::text, r.agent, 0, ''::text, ''::text;
                    RETURN;
                END IF;
                SELECT * INTO v_sub FROM dispatch_submit_new(
                    p_max, p_at,
                    (SELECT json_agg(jsonb_set(x::jsonb, '{agent_name}', to_jsonb(r.agent))) FROM json_array_elements(p_items) x),
                    p_events, p_queue);
                IF v_sub.outcome <> 'ok' THEN
                    -- Nothing of the WorkItem was written; the slot taken
                    -- above names no active item, so it is free again.
                    DELETE FROM intake_receipts i WHERE i.id = r.id;
                    RETURN QUERY SELECT (CASE WHEN v_sub.outcome = 'full' THEN 'queue_full' ELSE v_sub.outcome END),
                                        r.agent, 0, ''::text, ''::text;
                    RETURN;
                END IF;
                -- dispatch_submit_new asked for a synchronous commit: the caller flushes instead.
                PERFORM set_config('synchronous_commit', 'off', true);
            END IF;
            RETURN QUERY SELECT 'accepted'::text, r.agent, r.answer_status, r.answer_type, r.answer_body;
            RETURN;
        END IF;
        SELECT * INTO old FROM intake_receipts i WHERE i.connector = r.connector AND i.source_id = r.source_id;
        IF NOT FOUND THEN
            -- The colliding row holds the same receipt id under another source
            -- identity (a hash collision of ids): the general path reports it.
            RETURN QUERY SELECT 'exists'::text, ''::text, 0, ''::text, ''::text;
            RETURN;
        END IF;
    END IF;
    IF old.body_sha256 <> r.body_sha256 THEN
        INSERT INTO intake_mismatches (receipt_id, body_sha256, at) VALUES (old.id, r.body_sha256, v_now);
        UPDATE intake_receipts i SET mismatches = i.mismatches + 1 WHERE i.id = old.id;
    END IF;
    RETURN QUERY SELECT 'duplicate'::text, old.agent, old.answer_status, old.answer_type, old.answer_body;
END $$;

-- Periodic schedules: each row fires one job per cron tick. next_at is the
-- next tick to fire (unix time); firers advance it with a compare-and-set,
-- and the job id derives from the schedule and its tick, so two firers of
-- one tick make the same job.
CREATE TABLE dispatch_schedules (
    tenant      text NOT NULL,
    name        text NOT NULL,
    cron        text NOT NULL,
    tz          text NOT NULL,
    kind        text NOT NULL,
    payload     text NOT NULL,
    session_id  text,
    priority    integer NOT NULL DEFAULT 0,
    agent_name  text NOT NULL DEFAULT '',
    paused      boolean NOT NULL DEFAULT false,
    next_at     double precision NOT NULL,
    last_tick   double precision,
    last_job_id text,
    created_at  double precision NOT NULL,
    updated_at  double precision NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE INDEX dispatch_schedules_due ON dispatch_schedules (next_at) WHERE NOT paused;
