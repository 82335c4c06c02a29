-- Durable intake on SQLite: the queries of backends/sqlite/intake.py.
-- Tables: schema.sql. Every write runs under the file's one write lock.

-- name: inst_by_route
SELECT * FROM intake_installations WHERE connector = :connector AND route_key = :route_key ORDER BY id

-- name: inst_get
SELECT * FROM intake_installations WHERE id = :id

-- name: inst_list
SELECT id, connector, external_id, route_key, tenant, status, bot_user_id, api_base, public_url, created_at
FROM intake_installations ORDER BY connector, external_id

-- name: inst_upsert
INSERT INTO intake_installations
    (id, connector, external_id, route_key, tenant, status, credentials, bot_user_id, api_base, public_url,
     created_at, updated_at)
VALUES (:id, :connector, :external_id, :route_key, :tenant, 'active', :credentials, :bot_user_id, :api_base,
        :public_url, :now, :now)
ON CONFLICT (connector, external_id) DO UPDATE SET
    route_key = excluded.route_key, tenant = excluded.tenant, credentials = excluded.credentials,
    bot_user_id = excluded.bot_user_id, api_base = excluded.api_base, public_url = excluded.public_url,
    updated_at = excluded.updated_at

-- name: inst_set_status
UPDATE intake_installations SET status = :status, updated_at = :now WHERE id = :id

-- name: agent_upsert
INSERT INTO intake_agents (name, enabled, created_at, updated_at) VALUES (:name, :enabled, :now, :now)
ON CONFLICT (name) DO UPDATE SET enabled = excluded.enabled, updated_at = excluded.updated_at

-- name: agent_get
SELECT name, enabled FROM intake_agents WHERE name = :name

-- name: agent_list
SELECT name, enabled, created_at, updated_at FROM intake_agents ORDER BY name

-- name: route_set
INSERT INTO intake_routes (installation_id, channel, agent, updated_at) VALUES (:installation_id, :channel, :agent, :now)
ON CONFLICT (installation_id, channel) DO UPDATE SET agent = excluded.agent, updated_at = excluded.updated_at

-- name: route_delete
DELETE FROM intake_routes WHERE installation_id = :installation_id AND channel = :channel

-- name: route_list
SELECT installation_id, channel, agent, updated_at FROM intake_routes ORDER BY installation_id, channel

-- name: route_resolve
SELECT agent FROM intake_routes WHERE installation_id = :installation_id AND channel IN (:channel, '*')
ORDER BY CASE WHEN channel = '*' THEN 1 ELSE 0 END LIMIT 1

-- name: receipt_by_source
SELECT * FROM intake_receipts WHERE connector = :connector AND source_id = :source_id

-- name: receipt_get
SELECT * FROM intake_receipts WHERE id = :id

-- name: receipt_insert
-- The envelope is stamped with the receipt time (the database clock).
INSERT INTO intake_receipts
    (id, connector, source_id, installation_id, tenant, state, reason, job_id, agent, conversation, sender,
     message_key, body_sha256, body_size, envelope, raw, answer_status, answer_type, answer_body, retry_num,
     retry_reason, received_at)
VALUES (:id, :connector, :source_id, :installation_id, :tenant, :state, :reason, :job_id, :agent, :conversation,
        :sender, :message_key, :body_sha256, :body_size, json_set(:envelope, '$.received_at', :now), :raw,
        :answer_status, :answer_type, :answer_body, :retry_num, :retry_reason, :now)
-- No conflict target: the id is derived from (connector, source_id), so a
-- copy may collide on either unique index.
ON CONFLICT DO NOTHING
RETURNING id

-- name: receipt_forget_refusal
-- Its retry is new work: the refusal makes way for the receipt it will write.
DELETE FROM intake_receipts
WHERE connector = :connector AND source_id = :source_id AND state = 'rejected' AND reason = 'backlog_full'

-- name: mismatch_insert
INSERT INTO intake_mismatches (receipt_id, body_sha256, at) VALUES (:receipt_id, :body_sha256, :now)

-- name: mismatch_bump
UPDATE intake_receipts SET mismatches = mismatches + 1 WHERE id = :receipt_id

-- name: backlog
-- The agent's open intake turns (the write lock makes the count exact).
SELECT count(*) AS n FROM work_items
WHERE agent_name = :agent AND kind = 'intake_turn' AND status IN ('submitted', 'ready', 'leased', 'running')

-- name: bump_intake
UPDATE intake_receipts SET intake_attempts = intake_attempts + 1 WHERE id = :id RETURNING intake_attempts AS n

-- name: bump_turn
UPDATE intake_receipts SET turn_attempts = turn_attempts + 1 WHERE id = :id RETURNING turn_attempts AS n

-- name: mirror_intake
UPDATE work_items SET intake_attempts = :n WHERE id = :id

-- name: mirror_turn
UPDATE work_items SET turn_attempts = :n WHERE id = :id

-- name: steered_of
SELECT envelope FROM intake_receipts
WHERE installation_id = :installation_id AND conversation = :conversation AND steered_into = :job_id
ORDER BY received_at, id

-- name: mark_captured
UPDATE intake_receipts SET captured = 1, engaged = :engaged WHERE id = :id

-- name: finish
UPDATE intake_receipts SET state = :state, reason = :reason, finished_at = :now
WHERE id = :id AND state IN ('accepted', 'running')

-- name: set_running
UPDATE intake_receipts SET state = 'running' WHERE id = :id AND state = 'accepted'

-- name: set_reply
UPDATE intake_receipts SET reply = :reply WHERE id = :id

-- name: history_insert
INSERT INTO intake_history (installation_id, conversation, message_key, receipt_id, role, sender, text, at)
VALUES (:installation_id, :conversation, :message_key, :receipt_id, :role, :sender, :text, :now)
ON CONFLICT (installation_id, conversation, message_key) DO NOTHING

-- name: history_recent
SELECT role, sender, text, at FROM intake_history
WHERE installation_id = :installation_id AND conversation = :conversation ORDER BY id DESC LIMIT :limit

-- name: newer_pending
SELECT r.id, r.sender, r.envelope FROM intake_receipts r JOIN work_items w ON w.id = r.job_id
WHERE r.installation_id = :installation_id AND r.conversation = :conversation AND r.state = 'accepted'
  AND w.seq > (SELECT seq FROM work_items WHERE id = :job_id)
ORDER BY w.seq

-- name: steer
UPDATE intake_receipts SET state = 'steered', reason = 'steered', steered_into = :job_id, finished_at = :now
WHERE id = :id AND state = 'accepted'

-- name: runs_of_agent
SELECT count(*) AS n FROM intake_runs WHERE agent = :agent AND expires_at > :now AND job_id <> :job_id

-- name: runs_of_installation
SELECT count(*) AS n FROM intake_runs WHERE installation_id = :installation_id AND expires_at > :now AND job_id <> :job_id

-- name: run_upsert
INSERT INTO intake_runs (job_id, agent, installation_id, conversation, requester, started_at, expires_at)
VALUES (:job_id, :agent, :installation_id, :conversation, :requester, :now, :expires_at)
ON CONFLICT (job_id) DO UPDATE SET expires_at = excluded.expires_at

-- name: run_release
DELETE FROM intake_runs WHERE job_id = :job_id

-- name: scrub
UPDATE intake_receipts SET envelope = NULL, raw = NULL, scrubbed_at = :now
WHERE scrubbed_at IS NULL AND received_at < :cutoff
  AND (job_id IS NULL OR job_id IN (
      SELECT id FROM work_items WHERE status IN ('succeeded', 'failed', 'cancelled', 'dead_letter')))

-- name: receipt_states
SELECT state, count(*) AS n FROM intake_receipts GROUP BY state ORDER BY state
