-- Cancel requests: rows nobody delivers are settled at once, the holder honours the rest.

-- name: cancel_match
-- Unsettled rows a cancel names: by id, by dedupe key, or by actor and command.
SELECT id, family, actor FROM __SCHEMA__.outbox
WHERE cancelled_at IS NULL AND done_at IS NULL AND parked_at IS NULL
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(dedupe_key)s::text IS NULL OR dedupe_key = %(dedupe_key)s)
  AND (%(actor)s::text IS NULL OR actor = %(actor)s)
  AND (%(command)s::text IS NULL OR command = %(command)s)
ORDER BY id;

-- name: cancel_request
INSERT INTO __SCHEMA__.outbox_cancel (row_id, reason, requested_by)
SELECT unnest(%(ids)s::bigint[]), %(reason)s, %(by)s
ON CONFLICT (row_id) DO NOTHING;

-- name: cancel_now
-- Rows nobody is delivering (no live claim) are settled as cancelled at once; rows another
-- transaction holds locked keep their request, which the holder honours.
WITH free AS (
    SELECT id FROM __SCHEMA__.outbox
    WHERE id = ANY(%(ids)s::bigint[]) AND cancelled_at IS NULL AND done_at IS NULL
      AND parked_at IS NULL AND (claim_token IS NULL OR (started_at IS NULL AND due_at <= now()))
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM __SCHEMA__.outbox_cancel WHERE row_id IN (SELECT id FROM free)
)
UPDATE __SCHEMA__.outbox o SET cancelled_at = now(), cancel_reason = %(reason)s,
    cancelled_by = %(by)s, claim_token = NULL, started_at = NULL, claimed_at = NULL,
    waiting = false
FROM free WHERE o.id = free.id
RETURNING o.id, o.family, o.actor;
