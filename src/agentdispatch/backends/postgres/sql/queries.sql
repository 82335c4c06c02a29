-- name: now
SELECT extract(epoch FROM clock_timestamp())::float8 AS now

-- name: load
SELECT * FROM work_items WHERE id = %(id)s

-- name: load_lock
SELECT * FROM work_items WHERE id = %(id)s FOR UPDATE

-- name: item_read
SELECT now, item, leaf, blocker_status, blocker_expires_at FROM dispatch_item_read(%(id)s, %(session)s)

-- name: items_read
SELECT now, item, leaf FROM dispatch_items_read(%(ids)b::text[])

-- name: submit_read
SELECT now, depth, seqs, items FROM dispatch_submit_read(%(ids)b::text[], %(n)s, %(max)s)

-- name: submit_new
SELECT outcome, depth, shift, seqs
FROM dispatch_submit_new(%(max)s, %(at)s, %(items)s::json, %(events)s::json, %(queue)s::json)

-- name: submit_write
-- A submission's rows in one statement (items, provenance, envelopes); the
-- statement triggers run at its end, as they would after three statements.
WITH items AS (
    INSERT INTO work_items (
        seq, id, tenant, session_id, session_ref, kind, agent_name, payload, priority, status,
        reason, attempts, max_attempts, dependencies, deadline_unix, created_at, ready_at,
        updated_at, lease_epoch
    )
    SELECT * FROM unnest(
        %(seq)b::bigint[], %(id)b::text[], %(tenant)b::text[], %(session_id)b::text[],
        %(session_ref)b::text[], %(kind)b::text[], %(agent_name)b::text[], %(payload)b::text[],
        %(priority)b::int[], %(status)b::text[], %(reason)b::text[], %(attempts)b::int[],
        %(max_attempts)b::int[], %(dependencies)b::text[], %(deadline_unix)b::float8[],
        %(created_at)b::float8[], %(ready_at)b::float8[], %(updated_at)b::float8[], %(lease_epoch)b::bigint[]
    )
), events AS (
    INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
    SELECT * FROM unnest(
        %(e_job_id)b::text[], %(e_at)b::float8[], %(e_event)b::text[], %(e_status)b::text[],
        %(e_attempt)b::int[], %(e_epoch)b::bigint[], %(e_detail)b::text[]
    )
)
INSERT INTO agent_dispatch_queue (
    job_id, item_seq, session_ref, tenant_ref, group_ref, priority, deadline_unix, envelope,
    enqueued_at, visible_at
)
SELECT * FROM unnest(
    %(q_job_id)b::text[], %(q_item_seq)b::bigint[], %(q_session_ref)b::text[], %(q_tenant_ref)b::text[],
    %(q_group_ref)b::text[], %(q_priority)b::int[], %(q_deadline_unix)b::float8[], %(q_envelope)b::text[],
    %(q_enqueued_at)b::float8[], %(q_visible_at)b::float8[]
)

-- name: load_many
SELECT * FROM work_items WHERE id = ANY(%(ids)b::text[]) ORDER BY id FOR UPDATE

-- name: next_seqs
SELECT unnest(dispatch_next_seqs(%(n)s)) AS seq

-- name: insert_many
INSERT INTO work_items (
    seq, id, tenant, session_id, session_ref, kind, agent_name, payload, priority, status,
    reason, attempts, max_attempts, dependencies, deadline_unix, created_at, ready_at,
    updated_at, lease_epoch
)
SELECT * FROM unnest(
    %(seq)b::bigint[], %(id)b::text[], %(tenant)b::text[], %(session_id)b::text[],
    %(session_ref)b::text[], %(kind)b::text[], %(agent_name)b::text[], %(payload)b::text[],
    %(priority)b::int[], %(status)b::text[], %(reason)b::text[], %(attempts)b::int[],
    %(max_attempts)b::int[], %(dependencies)b::text[], %(deadline_unix)b::float8[],
    %(created_at)b::float8[], %(ready_at)b::float8[], %(updated_at)b::float8[], %(lease_epoch)b::bigint[]
)

-- name: save
UPDATE work_items SET
    status = %(status)s, reason = %(reason)s, attempts = %(attempts)s, max_attempts = %(max_attempts)s,
    ready_at = %(ready_at)s, updated_at = %(updated_at)s, completed_at = %(completed_at)s,
    lease_owner = %(lease_owner)s, lease_epoch = %(lease_epoch)s, lease_token = %(lease_token)s,
    lease_expires_at = %(lease_expires_at)s, result = %(result)s, error = %(error)s
WHERE id = %(id)s

-- name: save_event
-- The usual write of a commit (one item, one provenance row) in one statement.
WITH saved AS (
    UPDATE work_items SET
        status = %(status)s, reason = %(reason)s, attempts = %(attempts)s, max_attempts = %(max_attempts)s,
        ready_at = %(ready_at)s, updated_at = %(updated_at)s, completed_at = %(completed_at)s,
        lease_owner = %(lease_owner)s, lease_epoch = %(lease_epoch)s, lease_token = %(lease_token)s,
        lease_expires_at = %(lease_expires_at)s, result = %(result)s, error = %(error)s
    WHERE id = %(id)s
)
INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
VALUES (%(e_job_id)s, %(e_at)s, %(e_event)s, %(e_status)s, %(e_attempt)s, %(e_epoch)s, %(e_detail)s)

-- name: save_many
-- Many items' writes (one per item: PostgresTx keeps each item's last) and
-- their provenance rows, in one statement.
WITH saved AS (
    UPDATE work_items w SET
        status = s.status, reason = s.reason, attempts = s.attempts, max_attempts = s.max_attempts,
        ready_at = s.ready_at, updated_at = s.updated_at, completed_at = s.completed_at,
        lease_owner = s.lease_owner, lease_epoch = s.lease_epoch, lease_token = s.lease_token,
        lease_expires_at = s.lease_expires_at, result = s.result, error = s.error
    FROM unnest(
        %(id)b::text[], %(status)b::text[], %(reason)b::text[], %(attempts)b::int[], %(max_attempts)b::int[],
        %(ready_at)b::float8[], %(updated_at)b::float8[], %(completed_at)b::float8[], %(lease_owner)b::text[],
        %(lease_epoch)b::bigint[], %(lease_token)b::text[], %(lease_expires_at)b::float8[], %(result)b::text[],
        %(error)b::text[]
    ) AS s(
        id, status, reason, attempts, max_attempts, ready_at, updated_at, completed_at, lease_owner,
        lease_epoch, lease_token, lease_expires_at, result, error
    )
    WHERE w.id = s.id
)
INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
SELECT * FROM unnest(
    %(e_job_id)b::text[], %(e_at)b::float8[], %(e_event)b::text[], %(e_status)b::text[],
    %(e_attempt)b::int[], %(e_epoch)b::bigint[], %(e_detail)b::text[]
)

-- name: event_many
INSERT INTO work_events (job_id, at, event, status, attempt, epoch, detail)
SELECT * FROM unnest(
    %(job_id)b::text[], %(at)b::float8[], %(event)b::text[], %(status)b::text[],
    %(attempt)b::int[], %(epoch)b::bigint[], %(detail)b::text[]
)

-- name: enqueue_many
INSERT INTO agent_dispatch_queue (
    job_id, item_seq, session_ref, tenant_ref, group_ref, priority, deadline_unix, envelope,
    enqueued_at, visible_at
)
SELECT * FROM unnest(
    %(job_id)b::text[], %(item_seq)b::bigint[], %(session_ref)b::text[], %(tenant_ref)b::text[],
    %(group_ref)b::text[], %(priority)b::int[], %(deadline_unix)b::float8[], %(envelope)b::text[],
    %(enqueued_at)b::float8[], %(visible_at)b::float8[]
)

-- name: has_envelope
SELECT 1 AS one FROM agent_dispatch_queue WHERE job_id = %(id)s LIMIT 1

-- name: add_dependency
INSERT INTO work_dependencies (depends_on, job_id) VALUES (%s, %s) ON CONFLICT DO NOTHING

-- name: dependants
SELECT job_id FROM work_dependencies WHERE depends_on = %(id)s ORDER BY job_id

-- name: admission
-- Compare-and-admit's depth, exact for ``n`` new items under ``max`` (see
-- dispatch_admission): no global lock while far from the bound.
SELECT dispatch_admission(%(n)s, %(max)s) AS n

-- name: admission_exact
-- The exact path of dispatch_admission (every token) for a caller that does
-- not say how many items it adds.
SELECT dispatch_admission(2147483647, NULL) AS n

-- name: session_lock
-- Fleet-wide per-session exclusion inside the claim transaction only.
SELECT pg_advisory_xact_lock(hashtextextended('agentdispatch.session:' || %(session_ref)s, 0))

-- name: session_blocker
SELECT status, lease_expires_at, ready_at FROM work_items
WHERE session_ref = %(session_ref)s
  AND status IN ('submitted', 'ready', 'leased', 'running')
  AND id <> %(id)s
  AND (seq < %(seq)s OR status IN ('leased', 'running'))
LIMIT 1

-- name: effect_get
-- Locked: a stale attempt settling its mark waits for (or precedes) this read.
SELECT * FROM side_effects WHERE tenant = %(tenant)s AND key = %(key)s FOR UPDATE

-- name: effects_read
-- The rows of many (tenant, key) pairs, locked in key order (writers of
-- overlapping batches cannot deadlock).
SELECT s.* FROM side_effects AS s
JOIN unnest(%(tenants)s::text[], %(keys)s::text[]) AS k (tenant, key) ON s.tenant = k.tenant AND s.key = k.key
ORDER BY s.tenant, s.key
FOR UPDATE OF s

-- name: effects_write
-- effect_put for many rows (distinct keys) in one statement.
INSERT INTO side_effects (tenant, key, job_id, state, epoch, result, created_at, updated_at)
SELECT tenant, key, job_id, state, epoch, result, %(now)s, %(now)s
FROM unnest(%(tenant)s::text[], %(key)s::text[], %(job_id)s::text[], %(state)s::text[], %(epoch)s::bigint[],
            %(result)s::text[]) AS x (tenant, key, job_id, state, epoch, result)
ON CONFLICT (tenant, key) DO UPDATE SET
    job_id = excluded.job_id, state = excluded.state, epoch = excluded.epoch, result = excluded.result,
    updated_at = excluded.updated_at

-- name: effect_put
INSERT INTO side_effects (tenant, key, job_id, state, epoch, result, created_at, updated_at)
VALUES (%(tenant)s, %(key)s, %(job_id)s, %(state)s, %(epoch)s, %(result)s, %(now)s, %(now)s)
ON CONFLICT (tenant, key) DO UPDATE SET
    job_id = excluded.job_id, state = excluded.state, epoch = excluded.epoch, result = excluded.result,
    updated_at = excluded.updated_at

-- name: effect_settle
-- Fenced by the epoch on the row: only the attempt whose mark is still
-- "intended" settles it (a stale attempt's late answer changes nothing).
UPDATE side_effects SET state = %(state)s, result = %(result)s, updated_at = %(now)s
WHERE tenant = %(tenant)s AND key = %(key)s AND job_id = %(job_id)s AND epoch = %(epoch)s AND state = 'intended'

-- name: effects_of
SELECT * FROM side_effects WHERE job_id = %(id)s ORDER BY created_at, key

-- name: expired_leases
SELECT * FROM work_items
WHERE status IN ('leased', 'running') AND lease_expires_at <= %(now)s
ORDER BY lease_expires_at LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: unserve
-- The fairness group (the session) of a turn whose lease expired: the claim
-- that served it counts for nothing.
UPDATE dispatch_fair_groups SET last_served = 0 WHERE priority = %(priority)s AND group_ref = %(group_ref)s

-- name: held_by
-- Not SKIP LOCKED: an item missed here would wait out its TTL, as the row of
-- its worker goes once nothing it held is left.
SELECT * FROM work_items
WHERE status IN ('leased', 'running') AND left(lease_owner, length(%(prefix)s)) = %(prefix)s
LIMIT %(limit)s
FOR UPDATE

-- name: release_claims
-- Their groups' holds end with them (see 022_held_groups.sql), and so do
-- their tenants' (023).
WITH r AS (
    UPDATE agent_dispatch_queue SET visible_at = %(now)s, claimed_by = NULL, claimed_at = NULL
    WHERE left(claimed_by, length(%(prefix)s)) = %(prefix)s
    RETURNING priority, group_ref
), g AS (
    UPDATE dispatch_fair_groups g SET held_until = 0
    FROM (SELECT DISTINCT priority, group_ref FROM r) k
    WHERE g.priority = k.priority AND g.group_ref = k.group_ref AND g.held_until <> 0
    RETURNING g.priority, g.tenant_ref
)
SELECT dispatch_fair_unhold(array_agg(g.priority), array_agg(g.tenant_ref)) FROM g

-- name: held_suspects
SELECT lease_owner, attempts, max_attempts FROM work_items
WHERE status IN ('leased', 'running') AND reason = 'lease_expired' AND attempts >= 3
  AND left(lease_owner, length(%(prefix)s)) = %(prefix)s

-- name: expired_deadlines
SELECT * FROM work_items
WHERE deadline_unix IS NOT NULL AND deadline_unix <= %(now)s
  AND status IN ('submitted', 'ready', 'leased', 'running')
ORDER BY deadline_unix LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: stranded
SELECT w.* FROM work_items w
WHERE w.status = 'ready' AND w.ready_at <= %(now)s
  AND NOT EXISTS (SELECT 1 FROM agent_dispatch_queue q WHERE q.job_id = w.id)
  AND w.updated_at <= %(now)s - %(grace)s
LIMIT %(limit)s
FOR UPDATE OF w SKIP LOCKED

-- name: settled_waiters
SELECT w.* FROM work_items w
WHERE w.status = 'submitted'
  AND NOT EXISTS (
      SELECT 1 FROM work_dependencies d JOIN work_items p ON p.id = d.depends_on
      WHERE d.job_id = w.id AND p.status IN ('submitted', 'ready', 'leased', 'running')
  )
LIMIT %(limit)s
FOR UPDATE OF w SKIP LOCKED

-- name: drop_dead_rows
DELETE FROM agent_dispatch_queue
WHERE id IN (
    SELECT q.id FROM agent_dispatch_queue q JOIN work_items w ON w.id = q.job_id
    WHERE q.claimed_by IS NULL
      AND w.status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')
    ORDER BY q.id
    LIMIT 500
    FOR UPDATE OF q SKIP LOCKED
)
RETURNING id

-- name: fair_sweep
SELECT dispatch_fair_sweep(%(limit)s) AS n

-- name: ready_due
-- Ready items due by now, oldest ready first (the partial ready index, in its order).
SELECT * FROM work_items
WHERE status = 'ready' AND ready_at <= %(now)s
ORDER BY ready_at LIMIT %(limit)s

-- name: list
SELECT * FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND (%(status)s::text IS NULL OR status = %(status)s)
ORDER BY seq DESC LIMIT %(limit)s OFFSET %(offset)s

-- name: search
-- The listing with the optional filters of a search (a NULL filter is off).
SELECT * FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(kind)s::text IS NULL OR kind = %(kind)s)
  AND (%(session_id)s::text IS NULL OR session_id = %(session_id)s)
  AND (%(agent_name)s::text IS NULL OR agent_name = %(agent_name)s)
  AND (%(created_from)s::float8 IS NULL OR created_at >= %(created_from)s)
  AND (%(created_to)s::float8 IS NULL OR created_at < %(created_to)s)
  AND (%(id_contains)s::text IS NULL OR strpos(id, %(id_contains)s) > 0)
ORDER BY seq DESC LIMIT %(limit)s OFFSET %(offset)s

-- name: counts
SELECT status, count(*) AS n FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) GROUP BY status

-- name: fleet_counts
-- The fleet gauges: open and dead-lettered items per tenant, with the oldest
-- stamp of each group (the dead-letter age). Terminal successes are not read.
SELECT tenant, status, count(*) AS n, min(COALESCE(completed_at, updated_at)) AS oldest
FROM work_items WHERE status IN ('submitted', 'ready', 'leased', 'running', 'dead_letter')
GROUP BY tenant, status

-- name: oldest_snapshot
-- The open transaction of this database holding back its cleanup horizon
-- longest: a snapshot (backend_xmin) or a written, uncommitted row (backend_xid)
-- keeps every row deleted after it from being vacuumed. Prepared transactions
-- have no session. Another role's sessions show a null xact_start unless this
-- role has pg_read_all_stats (or pg_monitor); they are then not seen.
SELECT age_s, pid, state FROM (
    SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 AS age_s, pid, coalesce(state, '') AS state
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
      AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
    UNION ALL
    SELECT extract(epoch FROM clock_timestamp() - prepared)::float8, NULL, 'prepared'
    FROM pg_prepared_xacts WHERE database = current_database()
) AS open ORDER BY age_s DESC LIMIT 1

-- name: hot_table_pages
-- The pages of each named table of the store's schema, those of at least
-- %(min_pages)s only (a catalog read: no page of theirs is read), and only
-- tables this role may rewrite (VACUUM FULL skips others with a warning).
SELECT c.relname, pg_relation_size(c.oid) / 8192 AS pages
FROM unnest(%(names)s::text[]) AS name
JOIN pg_class c ON c.oid = to_regclass(name)
WHERE pg_relation_size(c.oid) / 8192 >= %(min_pages)s AND pg_has_role(c.relowner, 'USAGE')

-- name: events_of
SELECT at, event, status, attempt, epoch, detail FROM work_events WHERE job_id = %(id)s ORDER BY id

-- name: record_poison
-- RETURNING (not rowcount): pipeline mode delivers rows on fetch.
INSERT INTO poison_envelopes (digest, raw, reason, created_at) VALUES (%s, %s, %s, %s)
ON CONFLICT DO NOTHING RETURNING digest

-- name: poison
SELECT digest, raw, reason, created_at FROM poison_envelopes ORDER BY created_at DESC LIMIT %(limit)s

-- name: heartbeat
INSERT INTO dispatch_workers (
    worker_id, host, capacity, active_sessions, queue_backend, started_at, last_heartbeat, process, counters
) VALUES (%s, %s, %s, %s, %s, %s, extract(epoch FROM clock_timestamp())::float8, %s, %s)
ON CONFLICT (worker_id) DO UPDATE SET
    capacity = excluded.capacity, active_sessions = excluded.active_sessions,
    last_heartbeat = excluded.last_heartbeat, counters = excluded.counters

-- name: workers
SELECT * FROM dispatch_workers
WHERE last_heartbeat >= extract(epoch FROM clock_timestamp())::float8 - %(max_age)s
ORDER BY started_at, worker_id

-- name: remove_worker
-- The row's counts (or the worker's final ones, given at a clean stop) go
-- into the fleet's, in the statement that deletes the row: a second removal
-- waits for the first and then finds no row, so nothing is added twice.
-- Keys in order: two removals lock the counter rows in the same order.
WITH gone AS (DELETE FROM dispatch_workers WHERE worker_id = %(id)s RETURNING counters)
INSERT INTO dispatch_fleet_counters (name, value)
SELECT c.key, c.value::float8 FROM gone, jsonb_each_text(coalesce(%(final)s, gone.counters)::jsonb) c
ORDER BY c.key
ON CONFLICT (name) DO UPDATE SET value = dispatch_fleet_counters.value + excluded.value

-- name: fleet_counters
-- One statement, one snapshot: a row removed between two reads would be
-- counted twice, then once (a counter going down).
SELECT name, sum(value) AS value FROM (
    SELECT name, value FROM dispatch_fleet_counters
    UNION ALL
    SELECT c.key, c.value::float8 FROM dispatch_workers w, jsonb_each_text(w.counters::jsonb) c
) t GROUP BY name

-- name: outbox_take
SELECT id, envelope, item_seq FROM agent_dispatch_queue ORDER BY id LIMIT %(limit)s

-- name: outbox_lease
UPDATE agent_dispatch_queue q
SET claimed_by = %(owner)s, claimed_at = extract(epoch FROM clock_timestamp())::float8
WHERE q.id IN (
    SELECT id FROM agent_dispatch_queue
    WHERE claimed_by IS NULL OR claimed_by = %(owner)s
       OR claimed_at <= extract(epoch FROM clock_timestamp())::float8 - %(hold)s
    ORDER BY id LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
RETURNING q.id, q.envelope, q.item_seq

-- name: outbox_done
DELETE FROM agent_dispatch_queue WHERE id = ANY(%(ids)b::bigint[])

-- name: token_create
INSERT INTO api_tokens (token_id, token_hash, tenant, label, created_at) VALUES (%s, %s, %s, %s, %s)

-- name: token_revoke
UPDATE api_tokens SET revoked_at = %s WHERE token_id = %s AND revoked_at IS NULL

-- name: token_lookup
SELECT tenant FROM api_tokens WHERE token_hash = %(hash)s AND revoked_at IS NULL

-- name: meta_get
SELECT value FROM dispatch_meta WHERE key = %(key)s

-- name: schema_version
SELECT coalesce(max(version), 0) FROM dispatch_migrations

-- name: schema_present
-- In the schema the steps create their tables in, not one further down the
-- search path.
SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'dispatch_meta')

-- name: schema_step_done
INSERT INTO dispatch_migrations (version, name, applied_at)
VALUES (%(version)s, %(name)s, extract(epoch FROM clock_timestamp()))

-- name: migrate_lock
SELECT pg_advisory_xact_lock(hashtextextended('agentdispatch.migrate:' || current_schema(), 0))

-- name: checkpoint_save
-- Fenced like a renewal: only the item's live lease (status, owner, epoch,
-- token, unexpired on the database clock) writes; a stale attempt changes nothing.
UPDATE work_items SET checkpoint = %(state)s
WHERE id = %(id)s AND tenant = %(tenant)s AND status IN ('leased', 'running')
  AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s AND lease_token = %(token)s
  AND lease_expires_at > extract(epoch FROM clock_timestamp())::float8
RETURNING id

-- name: schedule_add
INSERT INTO dispatch_schedules (
    tenant, name, cron, tz, kind, payload, session_id, priority, agent_name, paused, next_at,
    created_at, updated_at
) VALUES (
    %(tenant)s, %(name)s, %(cron)s, %(tz)s, %(kind)s, %(payload)s, %(session_id)s, %(priority)s,
    %(agent_name)s, %(paused)s, %(next_at)s, extract(epoch FROM clock_timestamp())::float8,
    extract(epoch FROM clock_timestamp())::float8
) ON CONFLICT (tenant, name) DO NOTHING

-- name: schedules
SELECT * FROM dispatch_schedules WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) ORDER BY tenant, name

-- name: schedule_update
UPDATE dispatch_schedules
SET paused = %(paused)s, next_at = %(next_at)s, updated_at = extract(epoch FROM clock_timestamp())::float8
WHERE tenant = %(tenant)s AND name = %(name)s

-- name: schedule_delete
DELETE FROM dispatch_schedules WHERE tenant = %(tenant)s AND name = %(name)s

-- name: schedules_due
SELECT *, extract(epoch FROM clock_timestamp())::float8 AS db_now FROM dispatch_schedules
WHERE NOT paused AND next_at <= extract(epoch FROM clock_timestamp())::float8
ORDER BY next_at LIMIT %(limit)s

-- name: db_now
SELECT extract(epoch FROM clock_timestamp())::float8

-- name: schedule_advance
-- Compare-and-set: only the firer that read this next_at moves it on.
UPDATE dispatch_schedules
SET next_at = %(next_at)s, last_tick = %(last_tick)s, last_job_id = %(last_job_id)s,
    updated_at = extract(epoch FROM clock_timestamp())::float8
WHERE tenant = %(tenant)s AND name = %(name)s AND next_at = %(expected)s AND NOT paused

-- name: depth_breakdown
-- Non-terminal items per tenant, kind and status (the dashboard's depth table).
SELECT tenant, kind, status, count(*) AS n FROM work_items
WHERE status IN ('submitted', 'ready', 'leased', 'running') AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
GROUP BY tenant, kind, status ORDER BY tenant, kind, status

-- name: activity_open
-- Items accepted and not yet finished at since (a replayed item counts from its creation).
SELECT count(*) AS n FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND created_at <= %(since)s
  AND (completed_at IS NULL OR completed_at > %(since)s)

-- name: activity_created
SELECT floor((created_at - %(since)s) / %(bucket)s)::int AS bucket, count(*) AS n FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND created_at > %(since)s GROUP BY 1

-- name: activity_finished
SELECT floor((completed_at - %(since)s) / %(bucket)s)::int AS bucket, status, count(*) AS n FROM work_items
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND completed_at > %(since)s GROUP BY 1, 2

-- name: purge_dead
-- Only dead letters of the tenant go, with their provenance and dependency
-- rows; the side-effect ledger stays (it records what happened outside, and a
-- later job reusing a key must still see it).
WITH gone AS (
    DELETE FROM work_items
    WHERE id = ANY(%(ids)s::text[]) AND status = 'dead_letter' AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
    RETURNING id
), events AS (
    DELETE FROM work_events WHERE job_id IN (SELECT id FROM gone)
), deps AS (
    DELETE FROM work_dependencies WHERE job_id IN (SELECT id FROM gone) OR depends_on IN (SELECT id FROM gone)
), queued AS (
    DELETE FROM agent_dispatch_queue WHERE job_id IN (SELECT id FROM gone)
)
SELECT id FROM gone

-- name: cancelled_since
-- Jobs cancelled since a time, and the clock: the partial index of migration
-- 014 holds only cancellation events, so this read costs nothing on the hot path.
SELECT extract(epoch FROM clock_timestamp())::float8 AS now,
       coalesce((SELECT array_agg(job_id) FROM work_events WHERE event = 'cancelled' AND at >= %(since)s),
                '{}') AS ids

-- name: renew_many
-- Every live lease of the lists in one statement, rows locked in id order
-- (as every batch locks them); the refused ones are simply not returned.
WITH l AS (
    SELECT * FROM unnest(%(ids)s::text[], %(tenants)s::text[], %(owners)s::text[], %(epochs)s::bigint[],
                         %(tokens)s::text[]) AS l (id, tenant, owner, epoch, token)
), clock AS (
    SELECT extract(epoch FROM clock_timestamp())::float8 AS now
), live AS (
    SELECT w.id FROM work_items w JOIN l ON l.id = w.id CROSS JOIN clock
    WHERE w.tenant = l.tenant AND w.lease_owner = l.owner AND w.lease_epoch = l.epoch
      AND w.lease_token = l.token AND w.status IN ('leased', 'running') AND w.lease_expires_at > clock.now
    ORDER BY w.id
    FOR UPDATE OF w
)
UPDATE work_items w SET lease_expires_at = clock.now + %(ttl)s, updated_at = clock.now
FROM live CROSS JOIN clock
WHERE w.id = live.id
RETURNING w.id, w.lease_token, w.lease_expires_at

-- name: set_timeouts
-- The execution timeouts of newly accepted items.
UPDATE work_items w SET timeout_s = t.seconds
FROM unnest(%(ids)s::text[], %(seconds)s::float8[]) AS t (id, seconds)
WHERE w.id = t.id
