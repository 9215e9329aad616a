-- Enqueue: the caller's transaction writes the row (and, for a row due now, a NOTIFY that
-- Postgres delivers at commit). __SCHEMA__ is replaced by the quoted, validated schema name;
-- every time is the database clock (now()), never a client's.

-- name: enqueue_insert
-- A row due now also sends a NOTIFY with its family's name, which Postgres delivers at commit
-- (never for a rolled-back transaction, once per family per transaction): the worker's
-- listener claims at once.
WITH ins AS (
    INSERT INTO __SCHEMA__.outbox
        (family, command, actor, payload, dedupe_key, due_at, trace_context)
    VALUES (%(family)s, %(command)s, %(actor)s, %(payload)s::jsonb, %(dedupe_key)s,
            coalesce(%(at)s::timestamptz, now()) + make_interval(secs => %(delay)s),
            %(trace)s::jsonb)
    ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT ins.id FROM ins
LEFT JOIN LATERAL (SELECT pg_notify(%(channel)s, %(family)s) WHERE %(wake)s) w ON true;

-- name: enqueue_find_dedupe
SELECT id FROM __SCHEMA__.outbox WHERE dedupe_key = %(dedupe_key)s;

-- name: enqueue_insert_ordered
-- Run under lock_actor. The row becomes the actor's head when the actor has no unsettled row
-- (a parked one counts while parked rows block); otherwise it waits, blocked, behind it.
WITH head AS (
    SELECT EXISTS (
        SELECT 1 FROM __SCHEMA__.outbox h
        WHERE h.family = %(family)s AND h.actor = %(actor)s
          AND h.cancelled_at IS NULL AND h.done_at IS NULL
          AND (h.parked_at IS NULL OR %(parked_blocks)s)
    ) AS taken
), due AS (
    SELECT coalesce(%(at)s::timestamptz, now()) + make_interval(secs => %(delay)s) AS at
),
ins AS (
    INSERT INTO __SCHEMA__.outbox
        (family, command, actor, payload, dedupe_key, due_at, ready_at, blocked, trace_context)
    SELECT %(family)s, %(command)s, %(actor)s, %(payload)s::jsonb, %(dedupe_key)s,
           CASE WHEN head.taken THEN 'infinity'::timestamptz ELSE due.at END, due.at, head.taken,
           %(trace)s::jsonb
    FROM head, due
    ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT ins.id FROM ins
LEFT JOIN LATERAL (SELECT pg_notify(%(channel)s, %(family)s) WHERE %(wake)s) w ON true;
