-- Seed 002's operator queries run verbatim on work_items: agent_id names the
-- agent (a virtual alias of agent_name, nothing stored), and the intake phase
-- acquisitions (capture, then turn) are mirrored from the receipt; other kinds
-- keep 0 there (their deliveries are counted in attempts).
ALTER TABLE work_items ADD COLUMN agent_id TEXT GENERATED ALWAYS AS (agent_name) VIRTUAL;
ALTER TABLE work_items ADD COLUMN intake_attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE work_items ADD COLUMN turn_attempts INTEGER NOT NULL DEFAULT 0;
