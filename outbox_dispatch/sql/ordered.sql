-- Ordered families: per-actor locks, heads, and the promotion of an actor's next row.

-- name: ordered_lock_actor
-- Serializes enqueue and head changes of one actor of an ordered family, held to commit.
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0));

-- name: ordered_lock_actor_checked
-- lock_actor on a caller's transaction, which must read the latest commits: under REPEATABLE
-- READ or SERIALIZABLE its snapshot can predate another producer's commit, and the head check
-- would miss that producer's row. The lock is taken only at READ COMMITTED; the caller refuses
-- the others before anything is written.
SELECT current_setting('transaction_isolation') AS isolation,
       CASE WHEN current_setting('transaction_isolation') = 'read committed'
            THEN pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0)) END;

-- name: ordered_promote
-- Run under lock_actor for each actor named. Each named actor of the family that has no head
-- (outbox_heads) gets its lowest blocked id as head (outbox_actor_queue): two index probes per
-- actor, whatever its backlog.
UPDATE __SCHEMA__.outbox o SET blocked = false, due_at = greatest(o.ready_at, now())
FROM (
    SELECT n.id
    FROM unnest(%(actors)s::text[]) AS a(actor)
    CROSS JOIN LATERAL (
        SELECT b.id FROM __SCHEMA__.outbox b
        WHERE b.family = %(family)s AND b.actor = a.actor AND b.blocked
          AND b.cancelled_at IS NULL AND b.done_at IS NULL
        ORDER BY b.id
        LIMIT 1
    ) n
    WHERE NOT EXISTS (
        SELECT 1 FROM __SCHEMA__.outbox h
        WHERE h.family = %(family)s AND h.actor = a.actor AND NOT h.blocked
          AND h.cancelled_at IS NULL AND h.done_at IS NULL
          AND (h.parked_at IS NULL OR %(parked_blocks)s)
    )
) n
WHERE o.id = n.id
RETURNING o.id;

-- name: ordered_headless_actors
-- Safety sweep: actors of an ordered family with blocked rows and no head (a crash between a
-- head's change and its successor's promotion).
SELECT DISTINCT b.actor FROM __SCHEMA__.outbox b
WHERE b.family = %(family)s AND b.blocked AND b.actor IS NOT NULL
  AND b.cancelled_at IS NULL AND b.done_at IS NULL
  AND NOT EXISTS (
      SELECT 1 FROM __SCHEMA__.outbox h
      WHERE h.family = b.family AND h.actor = b.actor AND NOT h.blocked
        AND h.cancelled_at IS NULL AND h.done_at IS NULL
        AND (h.parked_at IS NULL OR %(parked_blocks)s)
  )
LIMIT 1000;

-- name: ordered_block_rows
-- Retried parked rows of an ordered family get back in line; promote_blocked then gives the
-- actor its lowest row as head if it has none.
UPDATE __SCHEMA__.outbox SET blocked = true, ready_at = now(), due_at = 'infinity'
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: ordered_unblock
-- Rows left blocked behind an ordered head in a family that is no longer ordered: due again.
-- Blocked rows wait at due_at = infinity, so the outbox_due index finds them.
UPDATE __SCHEMA__.outbox SET blocked = false, due_at = greatest(ready_at, now())
WHERE id IN (
    SELECT id FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND due_at = 'infinity' AND blocked
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
    LIMIT %(batch)s
)
RETURNING id;
