-- Periodic schedules: each row fires one job per cron tick. next_at is the
-- next tick to fire (unix time); firers advance it with a compare-and-set,
-- and the job id derives from the schedule and its tick, so two firers of
-- one tick make the same job.
CREATE TABLE IF NOT EXISTS dispatch_schedules (
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
CREATE INDEX IF NOT EXISTS dispatch_schedules_due ON dispatch_schedules (next_at) WHERE paused = 0;
