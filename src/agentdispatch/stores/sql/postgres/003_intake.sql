-- Durable intake (Slack, Telegram, Twilio): installations, agents, routes,
-- receipts under their unique source identity, conversation history, runs.
CREATE TABLE IF NOT EXISTS intake_installations (
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
CREATE INDEX IF NOT EXISTS intake_installations_route ON intake_installations (connector, route_key);

CREATE TABLE IF NOT EXISTS intake_agents (
    name       text PRIMARY KEY,
    enabled    integer NOT NULL DEFAULT 1,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);

CREATE TABLE IF NOT EXISTS intake_routes (
    installation_id text NOT NULL,
    channel         text NOT NULL,
    agent           text NOT NULL,
    updated_at      double precision NOT NULL,
    PRIMARY KEY (installation_id, channel)
);

-- One row per source identity, kept as a tombstone after the 7-day scrub.
CREATE TABLE IF NOT EXISTS intake_receipts (
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
CREATE INDEX IF NOT EXISTS intake_receipts_conversation ON intake_receipts (installation_id, conversation, received_at);
CREATE INDEX IF NOT EXISTS intake_receipts_scrub ON intake_receipts (received_at) WHERE scrubbed_at IS NULL;

-- Duplicates whose bytes differ from the original's.
CREATE TABLE IF NOT EXISTS intake_mismatches (
    id          bigserial PRIMARY KEY,
    receipt_id  text NOT NULL,
    body_sha256 text NOT NULL,
    at          double precision NOT NULL
);

CREATE TABLE IF NOT EXISTS intake_history (
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
CREATE TABLE IF NOT EXISTS intake_runs (
    job_id          text PRIMARY KEY,
    agent           text NOT NULL,
    installation_id text NOT NULL,
    conversation    text NOT NULL,
    requester       text NOT NULL,
    started_at      double precision NOT NULL,
    expires_at      double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS intake_runs_agent ON intake_runs (agent, expires_at);
CREATE INDEX IF NOT EXISTS intake_runs_installation ON intake_runs (installation_id, expires_at);

-- The 256-per-agent backlog bound counts these inside the intake transaction.
CREATE INDEX IF NOT EXISTS work_items_intake_agent ON work_items (agent_name)
    WHERE kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running');

-- The per-agent backlog bound, exact under concurrent intakes without one
-- lock per agent while far from it (the scheme of dispatch_admission, with 16
-- tokens per agent and one item per intake): a full backlog is answered from
-- the committed count with no lock (completions only lower it); far from the
-- bound an intake holds one token, so at most 15 others are uncommitted;
-- near it, every token. Returns the count to compare with the bound.
CREATE OR REPLACE FUNCTION dispatch_intake_backlog(p_agent text, p_bound integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    tokens CONSTANT integer := 16;
    space integer := hashtext('agentdispatch.intake:' || current_schema() || ':' || p_agent);
    first integer := mod(pg_backend_pid(), 16);
    n bigint;
BEGIN
    n := (SELECT count(*) FROM work_items
          WHERE agent_name = p_agent AND kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running'));
    IF n >= p_bound THEN
        RETURN n;
    END IF;
    IF n + 2 * tokens <= p_bound THEN
        FOR i IN 0 .. tokens - 1 LOOP
            IF pg_try_advisory_xact_lock(space, mod(first + i, tokens)) THEN
                n := (SELECT count(*) FROM work_items
                      WHERE agent_name = p_agent AND kind = 'intake_turn'
                        AND status IN ('submitted', 'ready', 'leased', 'running'));
                IF n + tokens <= p_bound THEN
                    RETURN n;
                END IF;
                RAISE EXCEPTION 'intake backlog: the count neared the bound; retry' USING ERRCODE = '40001';
            END IF;
        END LOOP;
    END IF;
    FOR i IN 0 .. tokens - 1 LOOP
        PERFORM pg_advisory_xact_lock(space, i);
    END LOOP;
    RETURN (SELECT count(*) FROM work_items
            WHERE agent_name = p_agent AND kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running'));
END $$;
