-- name: load
SELECT * FROM work_items WHERE id = ?

-- name: item_read
-- The read half of a claim, renewal or commit in one statement: the item,
-- whether anything depends on it, and (with :session) the first item that
-- blocks its session, as session_blocker would find it.
SELECT w.*,
       NOT EXISTS (SELECT 1 FROM work_dependencies d WHERE d.depends_on = w.id) AS leaf,
       b.status AS blocker_status, b.lease_expires_at AS blocker_expires_at
FROM work_items w
LEFT JOIN work_items b INDEXED BY work_items_session_active
       ON :session
      AND b.session_ref = w.session_ref
      AND b.status IN ('submitted', 'ready', 'leased', 'running')
      AND b.id != w.id
      AND (b.seq < w.seq OR b.status IN ('leased', 'running'))
WHERE w.id = :id
LIMIT 1

-- name: load_many
SELECT * FROM work_items WHERE id IN (SELECT value FROM json_each(?))

-- name: insert
-- A NULL :seq takes the next AUTOINCREMENT number (the cursor's lastrowid); a
-- bulk submit assigns its own, read from last_seq under the write lock.
INSERT INTO work_items (
    seq, id, tenant, session_id, session_ref, kind, agent_name, payload, priority, status,
    reason, attempts, max_attempts, dependencies, deadline_unix, created_at, ready_at,
    updated_at, lease_epoch
) VALUES (
    :seq, :id, :tenant, :session_id, :session_ref, :kind, :agent_name, :payload, :priority, :status,
    :reason, :attempts, :max_attempts, :dependencies, :deadline_unix, :created_at, :ready_at,
    :updated_at, :lease_epoch
)

-- name: last_seq
-- The last item sequence number handed out (AUTOINCREMENT's own record, or a
-- larger rowid if that record was ever behind).
SELECT max(
    coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'work_items'), 0),
    coalesce((SELECT max(seq) FROM work_items), 0)
)

-- name: save
UPDATE work_items SET
    status = :status, reason = :reason, attempts = :attempts, max_attempts = :max_attempts,
    ready_at = :ready_at, updated_at = :updated_at, completed_at = :completed_at,
    lease_owner = :lease_owner, lease_epoch = :lease_epoch, lease_token = :lease_token,
    lease_expires_at = :lease_expires_at, result = :result, error = :error
WHERE id = :id

-- name: event
INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
VALUES (?, ?, ?, ?, ?, ?, ?)

-- name: enqueue
-- A row behind a queued row of its session is not its session's head: its
-- fairness stamp (+Inf) sorts it last, out of the claim's search (see the fair
-- claims in schema.sql). A head enqueued in front of its session's rows gets
-- 1e308: after every served session, as +Inf placed it (migration 018).
INSERT INTO agent_dispatch_queue (
    job_id, item_seq, session_ref, tenant_ref, priority, deadline_unix, envelope,
    enqueued_at, visible_at, group_served
) VALUES (
    ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9,
    CASE
        WHEN EXISTS (
            SELECT 1 FROM agent_dispatch_queue s INDEXED BY queue_session
            WHERE s.session_ref = ?3 AND s.item_seq <= ?2
        ) THEN 9e999
        WHEN EXISTS (
            SELECT 1 FROM agent_dispatch_queue s INDEXED BY queue_session WHERE s.session_ref = ?3
        ) THEN 1e308
        ELSE 0
    END
)

-- name: has_envelope
SELECT 1 FROM agent_dispatch_queue WHERE job_id = ? LIMIT 1

-- name: add_dependency
INSERT OR IGNORE INTO work_dependencies (depends_on, job_id) VALUES (?, ?)

-- name: dependants
SELECT job_id FROM work_dependencies WHERE depends_on = ?

-- name: active_count
SELECT count(*) FROM work_items INDEXED BY work_items_session_active
WHERE status IN ('submitted', 'ready', 'leased', 'running')

-- name: session_blocker
SELECT status, lease_expires_at, ready_at FROM work_items INDEXED BY work_items_session_active
WHERE session_ref = :session_ref
  AND status IN ('submitted', 'ready', 'leased', 'running')
  AND id != :id
  AND (seq < :seq OR status IN ('leased', 'running'))
LIMIT 1

-- name: effect_get
SELECT * FROM side_effects WHERE tenant = ? AND key = ?

-- name: effects_read
-- The rows of a list of [tenant, key] pairs.
SELECT s.* FROM json_each(?) AS k
JOIN side_effects AS s ON s.tenant = json_extract(k.value, '$[0]') AND s.key = json_extract(k.value, '$[1]')

-- name: effect_put
INSERT INTO side_effects (tenant, key, job_id, state, epoch, result, created_at, updated_at)
VALUES (:tenant, :key, :job_id, :state, :epoch, :result, :now, :now)
ON CONFLICT (tenant, key) DO UPDATE SET
    job_id = excluded.job_id, state = excluded.state, epoch = excluded.epoch, result = excluded.result,
    updated_at = excluded.updated_at

-- name: effect_settle
-- Fenced by the epoch on the row: only the attempt whose mark is still
-- "intended" settles it (a stale attempt's late answer changes nothing).
UPDATE side_effects SET state = :state, result = :result, updated_at = :now
WHERE tenant = :tenant AND key = :key AND job_id = :job_id AND epoch = :epoch AND state = 'intended'

-- name: effects_of
SELECT * FROM side_effects WHERE job_id = ? ORDER BY created_at

-- name: expired_leases
SELECT * FROM work_items INDEXED BY work_items_held
WHERE status IN ('leased', 'running') AND lease_expires_at <= ?
ORDER BY lease_expires_at LIMIT ?

-- name: unserve
-- The head row of a turn whose lease expired: its claim's served stamp goes
-- (a row behind its session's head keeps +Inf, a head enqueued in front its 1e308).
UPDATE agent_dispatch_queue SET group_served = 0 WHERE job_id = ? AND group_served < 1e308

-- name: held_by
SELECT * FROM work_items INDEXED BY work_items_held
WHERE status IN ('leased', 'running') AND substr(lease_owner, 1, length(:prefix)) = :prefix
LIMIT :limit

-- name: release_claims
UPDATE agent_dispatch_queue SET visible_at = :now, claimed_by = NULL, claimed_at = NULL, hidden = 0
WHERE substr(claimed_by, 1, length(:prefix)) = :prefix

-- name: held_suspects
SELECT lease_owner, attempts, max_attempts FROM work_items INDEXED BY work_items_held
WHERE status IN ('leased', 'running') AND reason = 'lease_expired' AND attempts >= 3
  AND substr(lease_owner, 1, length(:prefix)) = :prefix

-- name: expired_deadlines
SELECT * FROM work_items INDEXED BY work_items_deadline
WHERE deadline_unix IS NOT NULL AND deadline_unix <= ?
  AND status IN ('submitted', 'ready', 'leased', 'running')
LIMIT ?

-- name: stranded
SELECT w.* FROM work_items w INDEXED BY work_items_ready
WHERE w.status = 'ready' AND w.ready_at <= :now
  AND NOT EXISTS (SELECT 1 FROM agent_dispatch_queue q WHERE q.job_id = w.id)
  AND w.updated_at <= :now - :grace
LIMIT :limit

-- name: settled_waiters
SELECT w.* FROM work_items w INDEXED BY work_items_waiting
WHERE w.status = 'submitted'
  AND NOT EXISTS (
      SELECT 1 FROM work_dependencies d JOIN work_items p ON p.id = d.depends_on
      WHERE d.job_id = w.id AND p.status IN ('submitted', 'ready', 'leased', 'running')
  )
LIMIT ?

-- name: drop_dead_rows
DELETE FROM agent_dispatch_queue
WHERE claimed_by IS NULL AND job_id IN (
    SELECT q.job_id FROM agent_dispatch_queue q JOIN work_items w ON w.id = q.job_id
    WHERE w.status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')
    LIMIT 500
)

-- name: ready_due
-- Ready items due by :now, oldest ready first (the partial ready index, in its order).
SELECT * FROM work_items INDEXED BY work_items_ready
WHERE status = 'ready' AND ready_at <= :now
ORDER BY ready_at LIMIT :limit

-- name: list
SELECT * FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) AND (:status IS NULL OR status = :status)
ORDER BY seq DESC LIMIT :limit OFFSET :offset

-- name: search
-- The listing with the optional filters of a search (a NULL filter is off).
SELECT * FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) AND (:status IS NULL OR status = :status)
  AND (:kind IS NULL OR kind = :kind) AND (:session_id IS NULL OR session_id = :session_id)
  AND (:agent_name IS NULL OR agent_name = :agent_name)
  AND (:created_from IS NULL OR created_at >= :created_from)
  AND (:created_to IS NULL OR created_at < :created_to)
  AND (:id_contains IS NULL OR instr(id, :id_contains) > 0)
ORDER BY seq DESC LIMIT :limit OFFSET :offset

-- name: counts
SELECT status, count(*) AS n FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) GROUP BY status

-- name: fleet_counts
-- The fleet gauges: open and dead-lettered items per tenant, with the oldest
-- stamp of each group (the dead-letter age). Terminal successes are not read.
SELECT tenant, status, count(*) AS n, min(COALESCE(completed_at, updated_at)) AS oldest
FROM work_items WHERE status IN ('submitted', 'ready', 'leased', 'running', 'dead_letter')
GROUP BY tenant, status

-- name: events_of
SELECT at, event, status, attempt, epoch, detail FROM work_events WHERE job_id = ? ORDER BY id

-- name: record_poison
INSERT OR IGNORE INTO poison_envelopes (digest, raw, reason, created_at) VALUES (?, ?, ?, ?)

-- name: poison
SELECT digest, raw, reason, created_at FROM poison_envelopes ORDER BY created_at DESC LIMIT ?

-- name: heartbeat
INSERT INTO dispatch_workers (
    worker_id, host, capacity, active_sessions, queue_backend, started_at, last_heartbeat, process, counters
) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (worker_id) DO UPDATE SET
    capacity = excluded.capacity, active_sessions = excluded.active_sessions,
    last_heartbeat = excluded.last_heartbeat, counters = excluded.counters

-- name: workers
SELECT * FROM dispatch_workers WHERE last_heartbeat >= ? ORDER BY started_at, worker_id

-- name: fold_worker
-- Before remove_worker, in its transaction: the row's counts (or the
-- worker's final ones, given at a clean stop) go into the fleet's.
INSERT INTO dispatch_fleet_counters (name, value)
SELECT c.key, c.value FROM dispatch_workers w, json_each(coalesce(:final, w.counters)) c
WHERE w.worker_id = :id
ON CONFLICT (name) DO UPDATE SET value = dispatch_fleet_counters.value + excluded.value

-- name: remove_worker
DELETE FROM dispatch_workers WHERE worker_id = :id

-- name: fleet_counters
-- One statement, one snapshot: a row removed between two reads would be
-- counted twice, then once (a counter going down).
SELECT name, sum(value) AS value FROM (
    SELECT name, value FROM dispatch_fleet_counters
    UNION ALL
    SELECT c.key, c.value FROM dispatch_workers w, json_each(w.counters) c
) GROUP BY name

-- name: outbox_take
SELECT id, envelope, item_seq FROM agent_dispatch_queue ORDER BY id LIMIT ?

-- name: outbox_lease
UPDATE agent_dispatch_queue SET claimed_by = :owner, claimed_at = :now
WHERE id IN (
    SELECT id FROM agent_dispatch_queue
    WHERE claimed_by IS NULL OR claimed_by = :owner OR claimed_at <= :now - :hold
    ORDER BY id LIMIT :limit
)
RETURNING id, envelope, item_seq

-- name: outbox_done
DELETE FROM agent_dispatch_queue WHERE id = ?

-- name: token_create
INSERT INTO api_tokens (token_id, token_hash, tenant, label, created_at) VALUES (?, ?, ?, ?, ?)

-- name: token_revoke
UPDATE api_tokens SET revoked_at = ? WHERE token_id = ? AND revoked_at IS NULL

-- name: token_lookup
SELECT tenant FROM api_tokens WHERE token_hash = ? AND revoked_at IS NULL

-- name: checkpoint_save
-- Fenced like a renewal: only the item's live lease (status, owner, epoch,
-- token, unexpired on the database clock) writes; a stale attempt changes nothing.
UPDATE work_items SET checkpoint = :state
WHERE id = :id AND tenant = :tenant AND status IN ('leased', 'running')
  AND lease_owner = :owner AND lease_epoch = :epoch AND lease_token = :token
  AND lease_expires_at > :now

-- name: schedule_add
INSERT OR IGNORE INTO dispatch_schedules (
    tenant, name, cron, tz, kind, payload, session_id, priority, agent_name, paused, next_at,
    created_at, updated_at
) VALUES (
    :tenant, :name, :cron, :tz, :kind, :payload, :session_id, :priority, :agent_name, :paused, :next_at,
    :now, :now
)

-- name: schedules
SELECT * FROM dispatch_schedules WHERE (:tenant IS NULL OR tenant = :tenant) ORDER BY tenant, name

-- name: schedule_update
UPDATE dispatch_schedules SET paused = :paused, next_at = :next_at, updated_at = :now
WHERE tenant = :tenant AND name = :name

-- name: schedule_delete
DELETE FROM dispatch_schedules WHERE tenant = :tenant AND name = :name

-- name: schedules_due
SELECT * FROM dispatch_schedules INDEXED BY dispatch_schedules_due
WHERE paused = 0 AND next_at <= :now ORDER BY next_at LIMIT :limit

-- name: schedule_advance
-- Compare-and-set: only the firer that read this next_at moves it on.
UPDATE dispatch_schedules
SET next_at = :next_at, last_tick = :last_tick, last_job_id = :last_job_id, updated_at = :now
WHERE tenant = :tenant AND name = :name AND next_at = :expected AND paused = 0

-- name: depth_breakdown
-- Non-terminal items per tenant, kind and status (the dashboard's depth table).
SELECT tenant, kind, status, count(*) AS n FROM work_items
WHERE status IN ('submitted', 'ready', 'leased', 'running') AND (:tenant IS NULL OR tenant = :tenant)
GROUP BY tenant, kind, status ORDER BY tenant, kind, status

-- name: activity_open
-- Items accepted and not yet finished at :since (a replayed item counts from its creation).
SELECT count(*) AS n FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) AND created_at <= :since
  AND (completed_at IS NULL OR completed_at > :since)

-- name: activity_created
SELECT CAST((created_at - :since) / :bucket AS INTEGER) AS bucket, count(*) AS n FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) AND created_at > :since GROUP BY bucket

-- name: activity_finished
SELECT CAST((completed_at - :since) / :bucket AS INTEGER) AS bucket, status, count(*) AS n FROM work_items
WHERE (:tenant IS NULL OR tenant = :tenant) AND completed_at > :since GROUP BY bucket, status

-- name: purge_dead
-- Only dead letters of the tenant go; the side-effect ledger stays (it records
-- what happened outside, and a later job reusing a key must still see it).
DELETE FROM work_items
WHERE id = :id AND status = 'dead_letter' AND (:tenant IS NULL OR tenant = :tenant)
RETURNING id

-- name: purge_events
DELETE FROM work_events WHERE job_id = :id

-- name: purge_dependencies
DELETE FROM work_dependencies WHERE job_id = :id OR depends_on = :id

-- name: purge_queue
DELETE FROM agent_dispatch_queue WHERE job_id = :id

-- name: cancelled_since
-- Jobs cancelled since a time: the partial index of migration 014 holds only
-- cancellation events, so this read costs nothing on the hot path.
SELECT job_id FROM work_events INDEXED BY work_events_cancelled WHERE event = 'cancelled' AND at >= ?

-- name: renew_many
-- Every live lease of the list ([id, tenant, owner, epoch, token] each) in
-- one statement; the refused ones are simply not returned.
UPDATE work_items AS w SET lease_expires_at = :until, updated_at = :now
FROM (
    SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS tenant,
           json_extract(value, '$[2]') AS owner, json_extract(value, '$[3]') AS epoch,
           json_extract(value, '$[4]') AS token
    FROM json_each(:leases)
) AS l
WHERE w.id = l.id AND w.tenant = l.tenant AND w.lease_owner = l.owner AND w.lease_epoch = l.epoch
  AND w.lease_token = l.token AND w.status IN ('leased', 'running') AND w.lease_expires_at > :now
RETURNING id, lease_token, lease_expires_at

-- name: set_timeouts
-- The execution timeouts of newly accepted items ([id, seconds] each).
UPDATE work_items SET timeout_s = json_extract(j.value, '$[1]')
FROM json_each(?) AS j WHERE work_items.id = json_extract(j.value, '$[0]')
