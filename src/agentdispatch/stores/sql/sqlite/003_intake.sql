-- Durable intake (Slack, Telegram, Twilio): installations, agents, routes,
-- receipts under their unique source identity, conversation history, runs.
CREATE TABLE IF NOT EXISTS intake_installations (
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
CREATE INDEX IF NOT EXISTS intake_installations_route ON intake_installations (connector, route_key);

CREATE TABLE IF NOT EXISTS intake_agents (
    name       TEXT PRIMARY KEY,
    enabled    INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS intake_routes (
    installation_id TEXT NOT NULL,
    channel         TEXT NOT NULL,
    agent           TEXT NOT NULL,
    updated_at      REAL NOT NULL,
    PRIMARY KEY (installation_id, channel)
);

-- One row per source identity, kept as a tombstone after the 7-day scrub.
CREATE TABLE IF NOT EXISTS intake_receipts (
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
CREATE INDEX IF NOT EXISTS intake_receipts_conversation ON intake_receipts (installation_id, conversation, received_at);
CREATE INDEX IF NOT EXISTS intake_receipts_scrub ON intake_receipts (received_at) WHERE scrubbed_at IS NULL;

-- Duplicates whose bytes differ from the original's.
CREATE TABLE IF NOT EXISTS intake_mismatches (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    receipt_id  TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    at          REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS intake_history (
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
CREATE TABLE IF NOT EXISTS intake_runs (
    job_id          TEXT PRIMARY KEY,
    agent           TEXT NOT NULL,
    installation_id TEXT NOT NULL,
    conversation    TEXT NOT NULL,
    requester       TEXT NOT NULL,
    started_at      REAL NOT NULL,
    expires_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS intake_runs_agent ON intake_runs (agent, expires_at);
CREATE INDEX IF NOT EXISTS intake_runs_installation ON intake_runs (installation_id, expires_at);

-- The 256-per-agent backlog bound counts these inside the intake transaction.
CREATE INDEX IF NOT EXISTS work_items_intake_agent ON work_items (agent_name)
    WHERE kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running');
