-- Seed 002's operator queries run verbatim on work_items: agent_id names the
-- agent (PostgreSQL 15 stores generated columns: a copy of agent_name), and the
-- intake phase acquisitions (capture, then turn) are mirrored from the
-- receipt; other kinds keep 0 there (their deliveries are counted in attempts).
ALTER TABLE work_items ADD COLUMN IF NOT EXISTS agent_id text GENERATED ALWAYS AS (agent_name) STORED;
ALTER TABLE work_items ADD COLUMN IF NOT EXISTS intake_attempts integer NOT NULL DEFAULT 0;
ALTER TABLE work_items ADD COLUMN IF NOT EXISTS turn_attempts integer NOT NULL DEFAULT 0;
