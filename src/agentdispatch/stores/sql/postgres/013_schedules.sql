-- Periodic schedules: each row fires one job per cron tick. next_at is the
-- next tick to fire (unix time); firers advance it with a compare-and-set,
-- and the job id derives from the schedule and its tick, so two firers of
-- one tick make the same job.
CREATE TABLE IF NOT EXISTS dispatch_schedules (
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
CREATE INDEX IF NOT EXISTS dispatch_schedules_due ON dispatch_schedules (next_at) WHERE NOT paused;
