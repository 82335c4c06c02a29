-- The gateway's fleet-wide turn counters (docs/metrics.md). Each worker
-- writes its cumulative per-process counts into its heartbeat row (counters:
-- a JSON object, series key to value, zeros left out); the transaction that
-- deletes a worker's row adds its last counts into dispatch_fleet_counters.
-- The gateway serves the sum of both, read by one statement, so a row
-- leaving never makes a counter go down.
ALTER TABLE dispatch_workers ADD COLUMN counters TEXT NOT NULL DEFAULT '{}';

CREATE TABLE dispatch_fleet_counters (
    name  TEXT PRIMARY KEY,
    value REAL NOT NULL
);
