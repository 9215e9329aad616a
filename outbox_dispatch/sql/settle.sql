-- Settles: every one is fenced by the claim token and yields to a pending cancel request
-- (settle_cancel); settle.py decides which one applies.

-- name: settle_delete
-- Every settle is fenced by the claim token and yields to a cancel request (settle_cancel).
DELETE FROM __SCHEMA__.outbox WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_done
UPDATE __SCHEMA__.outbox SET done_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL
WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_retry
-- maybe_applied: the handler returned after it was told to stop, so its effects are unknown.
UPDATE __SCHEMA__.outbox SET due_at = now() + make_interval(secs => %(delay)s),
    claim_token = NULL, started_at = NULL, claimed_at = NULL, last_error = %(error)s,
    lost_attempts = 0, maybe_applied = maybe_applied OR %(maybe_applied)s
WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_park
UPDATE __SCHEMA__.outbox SET parked_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL, last_error = %(error)s
WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_cancel
-- The claim holder settles a row someone asked to cancel: it keeps who, when and why. The
-- request is taken only under the current token, with the row locked first: a stale holder's
-- settle must leave it for the current one (found by the model-based test: otherwise the
-- current holder's success deleted the row as delivered after the cancel).
WITH held AS (
    SELECT id FROM __SCHEMA__.outbox
    WHERE id = %(id)s AND claim_token = %(token)s
    FOR UPDATE
), req AS (
    DELETE FROM __SCHEMA__.outbox_cancel WHERE row_id IN (SELECT id FROM held)
    RETURNING reason, requested_by
)
UPDATE __SCHEMA__.outbox o SET cancelled_at = now(), cancel_reason = req.reason,
    cancelled_by = req.requested_by, claim_token = NULL, started_at = NULL, claimed_at = NULL,
    waiting = false
FROM req
WHERE o.id = %(id)s AND o.claim_token = %(token)s
RETURNING o.id;

-- name: settle_delete_many
-- The successes of a batch in one statement; rows with a cancel request are left to settle_cancel.
DELETE FROM __SCHEMA__.outbox o
USING unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS p(id, token)
WHERE o.id = p.id AND o.claim_token = p.token
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id)
RETURNING o.id;

-- name: settle_done_many
UPDATE __SCHEMA__.outbox o SET done_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS p(id, token)
WHERE o.id = p.id AND o.claim_token = p.token
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id)
RETURNING o.id;

-- name: session_commits_flush
-- A main-pool session's commits wait for the disk: locally where the server's (or the role's,
-- or the URL's) default flushes nothing, else as that default says (a synchronous standby is
-- waited for too). Run once per new connection (pool.py).
SELECT set_config('synchronous_commit', 'local', false)
WHERE current_setting('synchronous_commit') = 'off';

-- name: session_defaults
-- What a main-pool session's statements rely on, whatever the server's (or the role's, or
-- the URL's) defaults; run once per new connection (pool.py), as session_commits_flush:
-- - statements outside a transaction block read committed too: the start that claims is one,
--   and its function counts the family's in-flight rows after taking the family's lock;
--   under REPEATABLE READ the whole call would read the snapshot taken before the lock, miss
--   the claim it waited for, and start a row past max_in_flight;
-- - dates and intervals come back as psycopg parses them (DateStyle ISO, IntervalStyle
--   postgres): under 'SQL, DMY' a capped claim, which reads its candidates' due times,
--   failed on every pass, and the family's rows were never delivered;
-- - an idle session is not ended by the server (idle_session_timeout, Postgres 14 and
--   later): a pool keeps its connections between statements, and the listener's waits for
--   a NOTIFY are idle; each one ended failed the statement that next used it (a claim, a
--   start, a settle).
SELECT set_config('default_transaction_isolation', 'read committed', false),
       set_config('DateStyle', 'ISO', false),
       set_config('IntervalStyle', 'postgres', false),
       (SELECT set_config('idle_session_timeout', '0', false)
        WHERE current_setting('idle_session_timeout', true) IS NOT NULL);

-- name: handler_session_defaults
-- The handlers' pool (transactional handlers: the handler's writes and its settle, one
-- transaction, which pool.py begins READ COMMITTED) takes the rest of session_defaults: the
-- date formats psycopg parses, and no idle_session_timeout (its connections idle between
-- deliveries; one the server ended failed the next transactional handler's attempt).
SELECT set_config('DateStyle', 'ISO', false),
       set_config('IntervalStyle', 'postgres', false),
       (SELECT set_config('idle_session_timeout', '0', false)
        WHERE current_setting('idle_session_timeout', true) IS NOT NULL);

-- name: settle_without_flush
-- Deferred settles of delivered rows commit without waiting for their WAL flush: one lost in
-- a Postgres crash leaves its rows started, and they run again after their lease with
-- maybe_applied, as after a worker killed before its settle. Nothing else settles this way.
SELECT set_config('synchronous_commit', 'off', true);
