-- agentdispatch schema, SQLite (one WAL file per host).
CREATE TABLE IF NOT EXISTS dispatch_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- The one writable authority of every unit of work. Inspectable with plain SQL.
CREATE TABLE IF NOT EXISTS work_items (
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
    run_id           TEXT
);
CREATE INDEX IF NOT EXISTS work_items_session_active ON work_items (session_ref, seq)
    WHERE status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_held ON work_items (lease_expires_at)
    WHERE status IN ('leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_deadline ON work_items (deadline_unix)
    WHERE deadline_unix IS NOT NULL AND status IN ('submitted', 'ready', 'leased', 'running');
CREATE INDEX IF NOT EXISTS work_items_ready ON work_items (ready_at) WHERE status = 'ready';
CREATE INDEX IF NOT EXISTS work_items_waiting ON work_items (seq) WHERE status = 'submitted';
-- Listing by tenant; the status filter rides along (a status index would be
-- rewritten on every transition, costing WAL pages on the hot path).
CREATE INDEX IF NOT EXISTS work_items_tenant_seq ON work_items (tenant, seq);
CREATE INDEX IF NOT EXISTS work_items_dead_letter ON work_items (tenant, seq) WHERE status = 'dead_letter';

CREATE TABLE IF NOT EXISTS work_dependencies (
    depends_on TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    PRIMARY KEY (depends_on, job_id)
);

-- Append-only provenance: every transition, attempt and outcome.
CREATE TABLE IF NOT EXISTS work_events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  TEXT NOT NULL,
    at      REAL NOT NULL,
    event   TEXT NOT NULL,
    status  TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    epoch   INTEGER NOT NULL,
    detail  TEXT
);
CREATE INDEX IF NOT EXISTS work_events_job ON work_events (job_id, id);

-- The idempotency ledger behind guard.side_effect(key, fn).
CREATE TABLE IF NOT EXISTS side_effects (
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
CREATE INDEX IF NOT EXISTS side_effects_job ON side_effects (job_id);

-- Envelopes that failed validation, recorded once before their ack.
CREATE TABLE IF NOT EXISTS poison_envelopes (
    digest     TEXT PRIMARY KEY,
    raw        TEXT NOT NULL,
    reason     TEXT NOT NULL,
    created_at REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS dispatch_workers (
    worker_id       TEXT PRIMARY KEY,
    host            TEXT NOT NULL,
    capacity        INTEGER NOT NULL,
    active_sessions TEXT NOT NULL,
    queue_backend   TEXT NOT NULL,
    started_at      REAL NOT NULL,
    last_heartbeat  REAL NOT NULL
);

-- The queue (and, under an external transport, the outbox). Scheduling columns
-- hold opaque keyed references, not names.
CREATE TABLE IF NOT EXISTS agent_dispatch_queue (
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
    deliveries    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue_order ON agent_dispatch_queue (priority DESC, item_seq, id);
CREATE INDEX IF NOT EXISTS queue_session ON agent_dispatch_queue (session_ref, item_seq, id);
CREATE INDEX IF NOT EXISTS queue_deadline ON agent_dispatch_queue (deadline_unix)
    WHERE deadline_unix IS NOT NULL;
CREATE INDEX IF NOT EXISTS queue_job ON agent_dispatch_queue (job_id);
