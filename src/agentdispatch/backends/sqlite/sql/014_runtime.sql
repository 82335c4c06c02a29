-- Workers poll for cancelled jobs they run (Store.cancelled_since), about
-- once a second: an index of the cancellation events alone keeps that read
-- small and leaves every other event insert as it was.
CREATE INDEX IF NOT EXISTS work_events_cancelled ON work_events (at) WHERE event = 'cancelled';

-- A submission's own execution timeout (Submission.timeout_s): past it the
-- worker cancels the turn and fails it retryably with reason "timeout".
ALTER TABLE work_items ADD COLUMN timeout_s REAL;
