-- Delivery: start an attempt (token, lease and not-started checks), renew its lease while the
-- handler runs, and hand back a row that may not start.

-- name: deliver_begin
-- Delivery start: the token must still hold, the lease must still run and the attempt must
-- not have started before (a redelivered message of a killed worker waits for the lease).
-- From here the lease is the heartbeat timeout: a dead worker's row is due again that soon.
-- Unless the family's starts flush (policy.starts_flushed: then it waits, as 'local' where
-- the session says 'off'), the statement commits without waiting for its WAL flush, the
-- claim before it having waited for its own; then a claim older than the server's start may
-- not start from a message delivered before (a Postgres crash may have lost a start that ran,
-- so the row waits for its lease and runs again as a lost attempt, maybe_applied). A message's
-- first delivery (%(first_delivery)s) may: no attempt can have started under its token.
-- It returns how long ago the row was claimed: the claim took the row's cap slot for the
-- family's lease at most that long ago, so a young claim's slot is surely still held.
-- The same statement settles the row this process delivered just before, if any (one row
-- deleted, and one kept as done for its family's retention; id 0 for none): that deferred
-- settle then costs no round trip of its own, and it commits with the start, before the next
-- handler runs. Fenced by token, yielding to a cancel request, as settle_delete and
-- settle_done are. Scalars, not arrays: the prepared statement's generic plan is its best
-- (with arrays Postgres would re-plan it on every execution).
WITH deleted AS (
    DELETE FROM __SCHEMA__.outbox o
    WHERE o.id = %(deleted)s AND o.claim_token = %(deleted_token)s
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id)
    RETURNING o.id
), done AS (
    UPDATE __SCHEMA__.outbox o SET done_at = now(), claim_token = NULL, started_at = NULL,
        claimed_at = NULL
    WHERE o.id = %(done)s AND o.claim_token = %(done_token)s
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id)
    RETURNING o.id
), started AS (
    UPDATE __SCHEMA__.outbox SET started_at = now(),
        due_at = now() + make_interval(secs => %(run_lease)s)
    WHERE id = %(id)s AND claim_token = %(token)s AND started_at IS NULL AND due_at > now()
      AND NOT waiting
      AND (%(flushed)s OR %(first_delivery)s OR claimed_at >= pg_postmaster_start_time())
    RETURNING family, command, actor, payload, attempts, maybe_applied, dedupe_key,
        EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = id)
            AS cancel_requested,
        extract(epoch FROM now() - due_since)::float8 AS waited, trace_context,
        extract(epoch FROM now() - claimed_at)::float8 AS claim_age
)
SELECT s.family, s.command, s.actor, s.payload, s.attempts, s.maybe_applied, s.dedupe_key,
    s.cancel_requested, s.waited, s.trace_context, s.claim_age,
    (SELECT id FROM deleted), (SELECT id FROM done)
FROM (SELECT set_config('synchronous_commit',
          CASE WHEN NOT %(flushed)s THEN 'off'
               WHEN current_setting('synchronous_commit') = 'off' THEN 'local'
               ELSE current_setting('synchronous_commit') END, true)
      ) AS one LEFT JOIN started s ON true;

-- name: deliver_explain_stale
SELECT claim_token = %(token)s AS same_token, started_at IS NOT NULL AS started,
       due_at <= now() AS lapsed, claimed_at < pg_postmaster_start_time() AS before_restart
FROM __SCHEMA__.outbox WHERE id = %(id)s;

-- name: deliver_handback
-- A delivery that may not start (its cap slot lapsed) returns the row, uncounted, due now.
-- Only the process whose start just succeeded hands a row back, before its handler ran.
UPDATE __SCHEMA__.outbox SET claim_token = NULL, claimed_at = NULL, started_at = NULL,
    due_at = now(), attempts = greatest(attempts - 1, 0)
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: deliver_renew
-- Heartbeat: extend the leases still held (fenced by token) and report cancel requests.
UPDATE __SCHEMA__.outbox o SET due_at = now() + make_interval(secs => %(run_lease)s),
    progress = coalesce(p.progress, o.progress)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(progress)s::jsonb[])
    AS p(id, token, progress)
WHERE o.id = p.id AND o.claim_token = p.token AND o.due_at > now()
RETURNING o.id, EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id);

-- name: deliver_commit_as_configured
-- A transactional handler's transaction commits as the server's, role's or URL's
-- synchronous_commit says, not as the pool's sessions do (session_commits_flush): its effects
-- and its row's settle are kept or lost together, so a lost commit runs the row again, whole.
-- Sent only where session_commits_flush changed the session's setting.
SET LOCAL synchronous_commit TO DEFAULT;

-- name: deliver_check_claim
-- A transactional handler's first statement: its claim still holds, and whether a cancel is
-- pending. The row is not locked: the heartbeat renews its lease from another connection like
-- any other, and the settle at the end of the handler's transaction is fenced by the token.
SELECT id, EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
FROM __SCHEMA__.outbox WHERE id = %(id)s AND claim_token = %(token)s AND due_at > now();
