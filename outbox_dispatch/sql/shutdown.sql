-- Shutdown: a worker that is stopped hands back the rows it holds, as (id, claim token) pairs
-- of the delivery messages it received and did not finish (worker/leaving.py).

-- name: shutdown_hand_back
-- Rows not started are due again under their claim's token, as claim_give_back makes them
-- (from when they were due before the claim, so the next claim takes them without counting
-- an attempt, and a start of the claim's own message, here or anywhere, is refused). With
-- lost, at the end of a cold shutdown, rows started under the token are due now too: their
-- handlers were cut off, so the next claim takes them as lost attempts (maybe_applied), not
-- after the heartbeat timeout. Each row's family, command and actor name its cap slot.
UPDATE __SCHEMA__.outbox o SET due_at = CASE WHEN o.started_at IS NULL
        THEN coalesce(o.due_since, o.claimed_at) ELSE now() END
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS g(id, token)
WHERE o.id = g.id AND o.claim_token = g.token
  AND (o.started_at IS NULL OR (%(lost)s AND o.due_at > now()))
RETURNING o.id, o.family, o.command, o.actor, o.claim_token, o.started_at IS NOT NULL;
