-- schema version: 17
-- agentdispatch schema, SQLite (one WAL file per host): the whole current
-- schema, applied to a fresh database. Later changes are the numbered
-- migrations beside this file (see agentdispatch.stores.schema).
CREATE TABLE dispatch_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- The one writable authority of every unit of work. Inspectable with plain SQL.
CREATE TABLE work_items (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    tenant           TEXT NOT NULL,
    session_id       TEXT NOT NULL,
    session_ref      TEXT NOT NULL,
    kind             TEXT NOT NULL,
    agent_name       TEXT NOT NULL DEFAULT '',
    payload          TEXT NOT NULL,
    priority         INTEGER NOT NULL DEFAULT 0,
    status           TEXT NOT NULL,
    reason           TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    dependencies     TEXT NOT NULL DEFAULT '[]',
    deadline_unix    REAL,
    created_at       REAL NOT NULL,
    ready_at         REAL NOT NULL,
    updated_at       REAL NOT NULL,
    completed_at     REAL,
    lease_owner      TEXT,
    lease_epoch      INTEGER NOT NULL DEFAULT 0,
    lease_token      TEXT,
    lease_expires_at REAL,
    result           TEXT,
    error            TEXT,
    run_id           TEXT,
    -- Seed 002's operator queries run verbatim on work_items: agent_id names
    -- the agent (a virtual alias of agent_name, nothing stored), and the
    -- intake phase acquisitions (capture, then turn) are mirrored from the
    -- receipt; other kinds keep 0 there (their deliveries are counted in
    -- attempts).
    agent_id         TEXT GENERATED ALWAYS AS (agent_name) VIRTUAL,
    intake_attempts  INTEGER NOT NULL DEFAULT 0,
    turn_attempts    INTEGER NOT NULL DEFAULT 0,
    -- A turn's saved progress (guard.checkpoint): JSON text, written only by
    -- the fenced checkpoint statement, read with the item by the next attempt.
    checkpoint       TEXT,
    -- A submission's own execution timeout (Submission.timeout_s): past it the
    -- worker cancels the turn and fails it retryably with reason "timeout".
    timeout_s        REAL
);
CREATE INDEX work_items_session_active ON work_items (session_ref, seq)
    WHERE status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX work_items_held ON work_items (lease_expires_at)
    WHERE status IN ('leased', 'running');
CREATE INDEX work_items_deadline ON work_items (deadline_unix)
    WHERE deadline_unix IS NOT NULL AND status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX work_items_ready ON work_items (ready_at) WHERE status = 'ready';
CREATE INDEX work_items_waiting ON work_items (seq) WHERE status = 'submitted';
-- Listing by tenant; the status filter rides along (a status index would be
-- rewritten on every transition, costing WAL pages on the hot path).
CREATE INDEX work_items_tenant_seq ON work_items (tenant, seq);
CREATE INDEX work_items_dead_letter ON work_items (tenant, seq) WHERE status = 'dead_letter';

CREATE TABLE work_dependencies (
    depends_on TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    PRIMARY KEY (depends_on, job_id)
);

-- Append-only provenance: every transition, attempt and outcome.
CREATE TABLE work_events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  TEXT NOT NULL,
    at      REAL NOT NULL,
    event   TEXT NOT NULL,
    status  TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    epoch   INTEGER NOT NULL,
    detail  TEXT
);
CREATE INDEX work_events_job ON work_events (job_id, id);
-- Workers poll for cancelled jobs they run (Store.cancelled_since), about
-- once a second: an index of the cancellation events alone keeps that read
-- small and leaves every other event insert as it was.
CREATE INDEX work_events_cancelled ON work_events (at) WHERE event = 'cancelled';

-- The idempotency ledger behind guard.side_effect(key, fn).
CREATE TABLE side_effects (
    tenant     TEXT NOT NULL,
    key        TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    state      TEXT NOT NULL,
    epoch      INTEGER NOT NULL,
    result     TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX side_effects_job ON side_effects (job_id);

-- Envelopes that failed validation, recorded once before their ack.
CREATE TABLE poison_envelopes (
    digest     TEXT PRIMARY KEY,
    raw        TEXT NOT NULL,
    reason     TEXT NOT NULL,
    created_at REAL NOT NULL
);

CREATE TABLE dispatch_workers (
    worker_id       TEXT PRIMARY KEY,
    host            TEXT NOT NULL,
    capacity        INTEGER NOT NULL,
    active_sessions TEXT NOT NULL,
    queue_backend   TEXT NOT NULL,
    started_at      REAL NOT NULL,
    last_heartbeat  REAL NOT NULL,
    -- Which process the worker is (pid namespace, pid, start time), so a peer
    -- on the same host can tell that it died and end its leases at once.
    process         TEXT NOT NULL DEFAULT ''
);

-- The queue (and, under an external transport, the outbox). Scheduling columns
-- hold opaque keyed references, not names.
CREATE TABLE agent_dispatch_queue (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id        TEXT NOT NULL,
    item_seq      INTEGER NOT NULL,
    session_ref   TEXT NOT NULL,
    tenant_ref    TEXT NOT NULL,
    priority      INTEGER NOT NULL,
    deadline_unix REAL,
    envelope      TEXT NOT NULL,
    enqueued_at   REAL NOT NULL,
    visible_at    REAL NOT NULL,
    claimed_by    TEXT,
    claimed_at    REAL,
    deliveries    INTEGER NOT NULL DEFAULT 0,
    -- When the row's session was last served (0: never) on its head row, and
    -- +Inf on the rows behind the head (see the fair claims below).
    group_served  REAL NOT NULL DEFAULT 0
);
CREATE INDEX queue_session ON agent_dispatch_queue (session_ref, item_seq, id);
CREATE INDEX queue_deadline ON agent_dispatch_queue (deadline_unix)
    WHERE deadline_unix IS NOT NULL;
CREATE INDEX queue_job ON agent_dispatch_queue (job_id);

-- Fair claims, in PostgreSQL's order (its dispatch_claim_fair): expired
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
CREATE INDEX queue_fair
    ON agent_dispatch_queue (tenant_ref, priority, group_served, coalesce(deadline_unix, 9e999), item_seq, id);

-- last_served is the claim's time (one writer at a time on one host's clock:
-- no sequence to read and write on every claim).
CREATE TABLE dispatch_fair_tenants (
    priority    INTEGER NOT NULL,
    tenant_ref  TEXT NOT NULL,
    since       INTEGER NOT NULL,
    last_served REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (priority, tenant_ref)
) WITHOUT ROWID;
CREATE INDEX fair_tenants_order ON dispatch_fair_tenants (priority DESC, last_served, since);

CREATE TRIGGER queue_fair_added AFTER INSERT ON agent_dispatch_queue
BEGIN
    INSERT OR IGNORE INTO dispatch_fair_tenants (priority, tenant_ref, since)
    VALUES (NEW.priority, NEW.tenant_ref, NEW.id);
END;

-- A claim marks its tenant as served most recently (the claim stamps its row).
CREATE TRIGGER queue_fair_served AFTER UPDATE OF claimed_by ON agent_dispatch_queue
WHEN NEW.claimed_by IS NOT NULL
BEGIN
    UPDATE dispatch_fair_tenants SET last_served = NEW.claimed_at
    WHERE priority = NEW.priority AND tenant_ref = NEW.tenant_ref;
END;

-- A head leaving the queue hands its stamp to the next row of its session; the
-- last row of a tenant removes the tenant.
CREATE TRIGGER queue_fair_next AFTER DELETE ON agent_dispatch_queue
WHEN OLD.group_served < 9e999
BEGIN
    UPDATE agent_dispatch_queue SET group_served = OLD.group_served
    WHERE id = (
        SELECT n.id FROM agent_dispatch_queue n INDEXED BY queue_session
        WHERE n.session_ref = OLD.session_ref ORDER BY n.item_seq, n.id LIMIT 1
    ) AND group_served = 9e999;
END;
CREATE TRIGGER queue_fair_removed AFTER DELETE ON agent_dispatch_queue
WHEN NOT EXISTS (
    SELECT 1 FROM agent_dispatch_queue q INDEXED BY queue_fair
    WHERE q.tenant_ref = OLD.tenant_ref AND q.priority = OLD.priority
)
BEGIN
    DELETE FROM dispatch_fair_tenants WHERE priority = OLD.priority AND tenant_ref = OLD.tenant_ref;
END;

-- Bearer tokens of the gateway: stored hashed, each bound to one tenant.
CREATE TABLE api_tokens (
    token_id   TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    tenant     TEXT NOT NULL,
    label      TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    revoked_at REAL
);

-- Durable intake (Slack, Telegram, Twilio): installations, agents, routes,
-- receipts under their unique source identity, conversation history, runs.
CREATE TABLE intake_installations (
    id          TEXT PRIMARY KEY,
    connector   TEXT NOT NULL,
    external_id TEXT NOT NULL,
    route_key   TEXT NOT NULL,
    tenant      TEXT NOT NULL,
    status      TEXT NOT NULL DEFAULT 'active',
    credentials TEXT NOT NULL,
    bot_user_id TEXT NOT NULL DEFAULT '',
    api_base    TEXT NOT NULL DEFAULT '',
    public_url  TEXT NOT NULL DEFAULT '',
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    UNIQUE (connector, external_id)
);
CREATE INDEX intake_installations_route ON intake_installations (connector, route_key);

CREATE TABLE intake_agents (
    name       TEXT PRIMARY KEY,
    enabled    INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);

CREATE TABLE intake_routes (
    installation_id TEXT NOT NULL,
    channel         TEXT NOT NULL,
    agent           TEXT NOT NULL,
    updated_at      REAL NOT NULL,
    PRIMARY KEY (installation_id, channel)
);

-- One row per source identity, kept as a tombstone after the 7-day scrub.
CREATE TABLE intake_receipts (
    id              TEXT PRIMARY KEY,
    connector       TEXT NOT NULL,
    source_id       TEXT NOT NULL,
    installation_id TEXT NOT NULL DEFAULT '',
    tenant          TEXT NOT NULL DEFAULT '',
    state           TEXT NOT NULL,
    reason          TEXT,
    job_id          TEXT,
    agent           TEXT NOT NULL DEFAULT '',
    conversation    TEXT NOT NULL DEFAULT '',
    sender          TEXT NOT NULL DEFAULT '',
    message_key     TEXT NOT NULL DEFAULT '',
    body_sha256     TEXT NOT NULL,
    body_size       INTEGER NOT NULL,
    envelope        TEXT,
    raw             TEXT,
    answer_status   INTEGER NOT NULL,
    answer_type     TEXT NOT NULL,
    answer_body     TEXT NOT NULL,
    retry_num       INTEGER NOT NULL DEFAULT 0,
    retry_reason    TEXT,
    mismatches      INTEGER NOT NULL DEFAULT 0,
    captured        INTEGER NOT NULL DEFAULT 0,
    engaged         INTEGER,
    intake_attempts INTEGER NOT NULL DEFAULT 0,
    turn_attempts   INTEGER NOT NULL DEFAULT 0,
    steered_into    TEXT,
    reply           TEXT,
    received_at     REAL NOT NULL,
    finished_at     REAL,
    scrubbed_at     REAL,
    UNIQUE (connector, source_id)
);
CREATE INDEX intake_receipts_conversation ON intake_receipts (installation_id, conversation, received_at);
CREATE INDEX intake_receipts_scrub ON intake_receipts (received_at) WHERE scrubbed_at IS NULL;

-- Duplicates whose bytes differ from the original's.
CREATE TABLE intake_mismatches (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    receipt_id  TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    at          REAL NOT NULL
);

CREATE TABLE intake_history (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    installation_id TEXT NOT NULL,
    conversation    TEXT NOT NULL,
    message_key     TEXT NOT NULL,
    receipt_id      TEXT,
    role            TEXT NOT NULL,
    sender          TEXT NOT NULL DEFAULT '',
    text            TEXT NOT NULL DEFAULT '',
    at              REAL NOT NULL,
    UNIQUE (installation_id, conversation, message_key)
);

-- Active turns (capacity slots); a slot whose expiry passed is free again.
CREATE TABLE intake_runs (
    job_id          TEXT PRIMARY KEY,
    agent           TEXT NOT NULL,
    installation_id TEXT NOT NULL,
    conversation    TEXT NOT NULL,
    requester       TEXT NOT NULL,
    started_at      REAL NOT NULL,
    expires_at      REAL NOT NULL
);
CREATE INDEX intake_runs_agent ON intake_runs (agent, expires_at);
CREATE INDEX intake_runs_installation ON intake_runs (installation_id, expires_at);

-- The 256-per-agent backlog bound counts these inside the intake transaction.
CREATE INDEX work_items_intake_agent ON work_items (agent_name)
    WHERE kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running');

-- Periodic schedules: each row fires one job per cron tick. next_at is the
-- next tick to fire (unix time); firers advance it with a compare-and-set,
-- and the job id derives from the schedule and its tick, so two firers of
-- one tick make the same job.
CREATE TABLE dispatch_schedules (
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    cron        TEXT NOT NULL,
    tz          TEXT NOT NULL,
    kind        TEXT NOT NULL,
    payload     TEXT NOT NULL,
    session_id  TEXT,
    priority    INTEGER NOT NULL DEFAULT 0,
    agent_name  TEXT NOT NULL DEFAULT '',
    paused      INTEGER NOT NULL DEFAULT 0,
    next_at     REAL NOT NULL,
    last_tick   REAL,
    last_job_id TEXT,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE INDEX dispatch_schedules_due ON dispatch_schedules (next_at) WHERE paused = 0;
