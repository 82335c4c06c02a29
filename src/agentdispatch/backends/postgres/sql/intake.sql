-- Durable intake on PostgreSQL: the queries of backends/postgres/intake.py.
-- Tables and the request path's functions (dispatch_intake_admit,
-- dispatch_intake_backlog): schema.sql.

-- name: inst_by_route
SELECT * FROM intake_installations WHERE connector = %(connector)s AND route_key = %(route_key)s ORDER BY id

-- name: inst_get
SELECT * FROM intake_installations WHERE id = %(id)s

-- name: inst_list
SELECT id, connector, external_id, route_key, tenant, status, bot_user_id, api_base, public_url, created_at
FROM intake_installations ORDER BY connector, external_id

-- name: inst_upsert
INSERT INTO intake_installations
    (id, connector, external_id, route_key, tenant, status, credentials, bot_user_id, api_base, public_url,
     created_at, updated_at)
VALUES (%(id)s, %(connector)s, %(external_id)s, %(route_key)s, %(tenant)s, 'active', %(credentials)s, %(bot_user_id)s, %(api_base)s,
        %(public_url)s, %(now)s, %(now)s)
ON CONFLICT (connector, external_id) DO UPDATE SET
    route_key = excluded.route_key, tenant = excluded.tenant, credentials = excluded.credentials,
    bot_user_id = excluded.bot_user_id, api_base = excluded.api_base, public_url = excluded.public_url,
    updated_at = excluded.updated_at

-- name: inst_set_status
UPDATE intake_installations SET status = %(status)s, updated_at = %(now)s WHERE id = %(id)s

-- name: agent_upsert
INSERT INTO intake_agents (name, enabled, created_at, updated_at) VALUES (%(name)s, %(enabled)s, %(now)s, %(now)s)
ON CONFLICT (name) DO UPDATE SET enabled = excluded.enabled, updated_at = excluded.updated_at

-- name: agent_get
SELECT name, enabled FROM intake_agents WHERE name = %(name)s

-- name: agent_list
SELECT name, enabled, created_at, updated_at FROM intake_agents ORDER BY name

-- name: route_set
INSERT INTO intake_routes (installation_id, channel, agent, updated_at) VALUES (%(installation_id)s, %(channel)s, %(agent)s, %(now)s)
ON CONFLICT (installation_id, channel) DO UPDATE SET agent = excluded.agent, updated_at = excluded.updated_at

-- name: route_delete
DELETE FROM intake_routes WHERE installation_id = %(installation_id)s AND channel = %(channel)s

-- name: route_list
SELECT installation_id, channel, agent, updated_at FROM intake_routes ORDER BY installation_id, channel

-- name: route_resolve
SELECT agent FROM intake_routes WHERE installation_id = %(installation_id)s AND channel IN (%(channel)s, '*')
ORDER BY CASE WHEN channel = '*' THEN 1 ELSE 0 END LIMIT 1

-- name: receipt_by_source
SELECT * FROM intake_receipts WHERE connector = %(connector)s AND source_id = %(source_id)s

-- name: receipt_get
SELECT * FROM intake_receipts WHERE id = %(id)s

-- name: receipt_insert
-- The envelope is stamped with the receipt time (the database clock).
INSERT INTO intake_receipts
    (id, connector, source_id, installation_id, tenant, state, reason, job_id, agent, conversation, sender,
     message_key, body_sha256, body_size, envelope, raw, answer_status, answer_type, answer_body, retry_num,
     retry_reason, received_at)
VALUES (%(id)s, %(connector)s, %(source_id)s, %(installation_id)s, %(tenant)s, %(state)s, %(reason)s, %(job_id)s, %(agent)s, %(conversation)s,
        %(sender)s, %(message_key)s, %(body_sha256)s, %(body_size)s, jsonb_set(%(envelope)s::jsonb, '{received_at}', to_jsonb(%(now)s::float8))::text, %(raw)s,
        %(answer_status)s, %(answer_type)s, %(answer_body)s, %(retry_num)s, %(retry_reason)s, %(now)s)
-- No conflict target: the id is derived from (connector, source_id), so a
-- copy may collide on either unique index.
ON CONFLICT DO NOTHING
RETURNING id

-- name: receipt_forget_refusal
-- Its retry is new work: the refusal makes way for the receipt it will write.
DELETE FROM intake_receipts
WHERE connector = %(connector)s AND source_id = %(source_id)s AND state = 'rejected' AND reason = 'backlog_full'

-- name: mismatch_insert
INSERT INTO intake_mismatches (receipt_id, body_sha256, at) VALUES (%(receipt_id)s, %(body_sha256)s, %(now)s)

-- name: mismatch_bump
UPDATE intake_receipts SET mismatches = mismatches + 1 WHERE id = %(receipt_id)s

-- name: backlog
-- The backlog to compare with the bound, exact under concurrent intakes
-- without a wait (dispatch_intake_backlog takes a slot for the job).
SELECT dispatch_intake_backlog(%(agent)s, %(bound)s, %(job)s) AS n

-- name: bump_intake
UPDATE intake_receipts SET intake_attempts = intake_attempts + 1 WHERE id = %(id)s RETURNING intake_attempts AS n

-- name: bump_turn
UPDATE intake_receipts SET turn_attempts = turn_attempts + 1 WHERE id = %(id)s RETURNING turn_attempts AS n

-- name: mirror_intake
UPDATE work_items SET intake_attempts = %(n)s WHERE id = %(id)s

-- name: mirror_turn
UPDATE work_items SET turn_attempts = %(n)s WHERE id = %(id)s

-- name: steered_of
SELECT envelope FROM intake_receipts
WHERE installation_id = %(installation_id)s AND conversation = %(conversation)s AND steered_into = %(job_id)s
ORDER BY received_at, id

-- name: mark_captured
UPDATE intake_receipts SET captured = 1, engaged = %(engaged)s WHERE id = %(id)s

-- name: finish
UPDATE intake_receipts SET state = %(state)s, reason = %(reason)s, finished_at = %(now)s
WHERE id = %(id)s AND state IN ('accepted', 'running')

-- name: set_running
UPDATE intake_receipts SET state = 'running' WHERE id = %(id)s AND state = 'accepted'

-- name: set_reply
UPDATE intake_receipts SET reply = %(reply)s WHERE id = %(id)s

-- name: history_insert
INSERT INTO intake_history (installation_id, conversation, message_key, receipt_id, role, sender, text, at)
VALUES (%(installation_id)s, %(conversation)s, %(message_key)s, %(receipt_id)s, %(role)s, %(sender)s, %(text)s, %(now)s)
ON CONFLICT (installation_id, conversation, message_key) DO NOTHING

-- name: history_recent
SELECT role, sender, text, at FROM intake_history
WHERE installation_id = %(installation_id)s AND conversation = %(conversation)s ORDER BY id DESC LIMIT %(limit)s

-- name: newer_pending
SELECT r.id, r.sender, r.envelope FROM intake_receipts r JOIN work_items w ON w.id = r.job_id
WHERE r.installation_id = %(installation_id)s AND r.conversation = %(conversation)s AND r.state = 'accepted'
  AND w.seq > (SELECT seq FROM work_items WHERE id = %(job_id)s)
ORDER BY w.seq

-- name: steer
UPDATE intake_receipts SET state = 'steered', reason = 'steered', steered_into = %(job_id)s, finished_at = %(now)s
WHERE id = %(id)s AND state = 'accepted'

-- name: runs_of_agent
SELECT count(*) AS n FROM intake_runs WHERE agent = %(agent)s AND expires_at > %(now)s AND job_id <> %(job_id)s

-- name: runs_of_installation
SELECT count(*) AS n FROM intake_runs WHERE installation_id = %(installation_id)s AND expires_at > %(now)s AND job_id <> %(job_id)s

-- name: run_upsert
INSERT INTO intake_runs (job_id, agent, installation_id, conversation, requester, started_at, expires_at)
VALUES (%(job_id)s, %(agent)s, %(installation_id)s, %(conversation)s, %(requester)s, %(now)s, %(expires_at)s)
ON CONFLICT (job_id) DO UPDATE SET expires_at = excluded.expires_at

-- name: run_release
DELETE FROM intake_runs WHERE job_id = %(job_id)s

-- name: scrub
UPDATE intake_receipts SET envelope = NULL, raw = NULL, scrubbed_at = %(now)s
WHERE scrubbed_at IS NULL AND received_at < %(cutoff)s
  AND (job_id IS NULL OR job_id IN (
      SELECT id FROM work_items WHERE status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')))

-- name: receipt_states
SELECT state, count(*) AS n FROM intake_receipts GROUP BY state ORDER BY state

-- name: lock
-- Serialise the capacity count of one agent or installation (every process
-- takes the agent's lock first).
SELECT pg_advisory_xact_lock(hashtext(%(key)s)) IS NULL AS locked

-- name: now
SELECT extract(epoch FROM clock_timestamp())::float8 AS now

-- name: admit_group
-- A group of concurrent deliveries in one statement, in the order of n (one
-- statement: the statement timeout bounds the whole group). The rows of
-- admit_row follow as its VALUES.
SELECT v.n, a.outcome, a.agent, a.answer_status, a.answer_type, a.answer_body
FROM (VALUES {rows}) AS v (n, receipt, channel, accept, bound, max, at, items, events, queue)
CROSS JOIN LATERAL dispatch_intake_admit(
    v.receipt, v.channel, v.accept, v.bound, v.max, v.at, v.items, v.events, v.queue) AS a

-- name: admit_slots
-- The backlog slot rows of the group's agents that have none yet, created
-- before any delivery of the group is written and in the order of the
-- agents' names. Created by each delivery as it came, two concurrent groups
-- whose first deliveries to new agents came in opposite orders each waited
-- for the slots the other had just created: a deadlock, which PostgreSQL
-- breaks only after deadlock_timeout (1 s by default) while every webhook
-- waits. In one order, the later group waits for the earlier one only.
-- The agent is resolved as dispatch_intake_admit resolves it.
INSERT INTO intake_backlog_slots (agent, slot)
SELECT a.agent, g.slot
FROM (
    SELECT DISTINCT coalesce((SELECT t.agent FROM intake_routes t
                              WHERE t.installation_id = r.inst AND t.channel IN (r.channel, '*')
                              ORDER BY CASE WHEN t.channel = '*' THEN 1 ELSE 0 END LIMIT 1), '') AS agent,
           r.bound
    FROM json_to_recordset(%(routes)s::json) AS r (inst text, channel text, bound integer)
) AS a
CROSS JOIN LATERAL generate_series(0, a.bound - 1) AS g (slot)
WHERE NOT EXISTS (SELECT 1 FROM intake_backlog_slots s WHERE s.agent = a.agent AND s.slot = a.bound - 1)
ORDER BY a.agent, g.slot
ON CONFLICT DO NOTHING

-- name: admit_row
(%(n)s::integer, %(receipt)s::json, %(channel)s::text, %(accept)s::boolean, %(bound)s::integer,
 %(max)s::bigint, %(at)s::float8, %(items)s::json, %(events)s::json, %(queue)s::json)
