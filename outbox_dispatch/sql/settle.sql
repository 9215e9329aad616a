-- Settles: every one is fenced by the claim token and yields to a pending cancel request
-- (settle_cancel); core/settle.py decides which one applies.

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
    last_traceback = %(traceback)s, lost_attempts = 0,
    maybe_applied = maybe_applied OR %(maybe_applied)s
WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_park
UPDATE __SCHEMA__.outbox SET parked_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL, last_error = %(error)s, last_traceback = %(traceback)s
WHERE id = %(id)s AND claim_token = %(token)s
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
RETURNING id;

-- name: settle_cancel
-- The claim holder settles a row someone asked to cancel: it keeps who, when and why. The
-- request is taken only under the current token, with the row locked first: a stale holder's
-- settle must leave it for the current one (otherwise the current holder's success would
-- delete the row as delivered after the cancel).
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

-- name: settle_without_flush
-- Deferred settles of delivered rows commit without waiting for their WAL flush: one lost in
-- a Postgres crash leaves its rows started, and they run again after their lease with
-- maybe_applied, as after a worker killed before its settle. Nothing else settles this way.
SELECT set_config('synchronous_commit', 'off', true);
