-- Enqueue: the caller's transaction writes the row (and, for a row due now, a NOTIFY that
-- Postgres delivers at commit). __SCHEMA__ is replaced by the quoted, validated schema name;
-- every time is the database clock (now()), never a client's.

-- name: enqueue_insert
-- A row due now also sends a NOTIFY, which Postgres delivers at commit (never for a rolled-back
-- transaction, once per family per transaction): the worker's listener claims at once. The
-- transaction's first such row names itself: a JSON array [family, id, command, actor] that
-- lets the listener hand the row, unclaimed, to an idle pool process of its worker, which
-- claims and starts it in one statement (deliver_claim_begin). The rows after it send the
-- family's name (a bulk insert stays one notification), as does a row whose names would make
-- a long payload. Which is first is kept in a setting local to the transaction (set_config's
-- third argument), which a rolled-back savepoint undoes with its NOTIFY.
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
LEFT JOIN LATERAL (SELECT pg_notify(%(channel)s, CASE
        WHEN coalesce(current_setting('outbox_dispatch.woke', true), '') <> ''
            THEN %(family)s
        WHEN set_config('outbox_dispatch.woke', 'y', true) = 'y'
             AND octet_length(%(command)s) + coalesce(octet_length(%(actor)s), 0) < 1000
            THEN json_build_array(%(family)s, ins.id, %(command)s, %(actor)s)::text
        ELSE %(family)s END)
    WHERE %(wake)s) w ON true;

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
