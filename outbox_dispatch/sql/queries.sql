-- Named queries used by store.py. __SCHEMA__ is replaced by the quoted, validated schema name.
-- Times come from the database clock (now()), never from a client.

-- name: insert
-- A row due now also sends a NOTIFY, which Postgres delivers at commit (never for a rolled-back
-- transaction, once per family per transaction): the worker's listener claims at once.
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

-- name: find_dedupe
SELECT id FROM __SCHEMA__.outbox WHERE dedupe_key = %(dedupe_key)s;

-- name: lock_family
-- Serializes one family's claims so the in-flight count cannot race; released at commit.
-- Also turns bitmap scans off for the claim's transaction: a bitmap scan cannot skip the dead
-- index entries that settled rows leave behind until vacuum (seen: 66k entries, 4.5 ms per
-- in-flight count), while a plain index scan marks them dead once and then passes them by.
SELECT pg_advisory_xact_lock(hashtext(%(lock_name)s)),
       set_config('enable_bitmapscan', 'off', true);

-- name: in_flight
-- Claimed rows whose lease still runs. A row whose lease ran out is not in flight, started or
-- not: its holder is dead or stalled (every live handler's lease is renewed by its heartbeat),
-- and the row is due again, so counting it would let dead workers' rows stop the family.
-- Counted up to max_in_flight (a claim needs no more), along the outbox_claimed index.
SELECT count(*) FROM (
    SELECT 1 FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND claim_token IS NOT NULL AND due_at > now()
    ORDER BY due_at
    LIMIT %(max_in_flight)s
) AS live;

-- name: pick_due
-- A claim's first statement: due rows of a family from the outbox_due index range, oldest
-- first, skipping rows another claimer holds; locked until the claim commits.
SELECT id FROM __SCHEMA__.outbox
WHERE family = %(family)s AND due_at <= now()
  AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
ORDER BY due_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: lease_rows
-- A claim's second statement: lease the rows it holds locked (picked due rows, or the capped
-- claim's take) under the given tokens (the cap slots' tokens; none given: a fresh one each).
-- A previous claim that never started (its message was lost or came too late) does not count
-- as an attempt; one that started and never settled was lost mid-run, so the next attempt is
-- marked maybe_applied, and a lost last attempt parks the row instead of running it again
-- (returned with no token). Each row is judged from its own columns and found by primary key:
-- no join, so no plan can turn the claim into a scan per row (a table without statistics
-- once got a nested loop of sequential scans: 5 s for 2,000 rows).
UPDATE __SCHEMA__.outbox o SET
    (attempts, maybe_applied, lost_attempts, last_error, claim_token, claimed_at, due_since,
     started_at, waiting, parked_at, due_at) = (
    SELECT
        CASE WHEN j.exhausted OR (o.claim_token IS NOT NULL AND NOT j.lost) THEN o.attempts
             ELSE o.attempts + 1 END,
        o.maybe_applied OR j.lost,
        o.lost_attempts + j.lost::int,
        CASE WHEN j.lost THEN 'attempt ' || o.attempts
                 || ' ended without an outcome (worker died or lease ran out)'
             ELSE o.last_error END,
        CASE WHEN j.exhausted THEN NULL
             WHEN cardinality(%(tokens)s::uuid[]) = 0 THEN gen_random_uuid()
             ELSE (%(tokens)s::uuid[])[array_position(%(ids)s::bigint[], o.id)] END,
        CASE WHEN j.exhausted THEN NULL ELSE now() END,
        CASE WHEN j.exhausted THEN o.due_since ELSE o.due_at END,
        NULL::timestamptz,
        false,
        CASE WHEN j.exhausted THEN now() END,
        CASE WHEN j.exhausted THEN o.due_at
             ELSE clock_timestamp() + make_interval(secs => %(lease)s) END
    FROM (SELECT o.started_at IS NOT NULL AS lost,
                 o.started_at IS NOT NULL AND (
                     %(park_lost)s OR o.lost_attempts + 1 >= %(max_lost)s::int
                     OR (%(max_attempts)s::int IS NOT NULL
                         AND o.attempts >= %(max_attempts)s::int)
                 ) AS exhausted) j
)
WHERE o.id = ANY(%(ids)s::bigint[])
RETURNING o.id, o.claim_token, o.command, o.actor, o.attempts, o.claim_token IS NULL,
    o.last_error;

-- name: begin
-- Delivery start: the token must still hold, the lease must still run and the attempt must
-- not have started before (a redelivered message of a killed worker waits for the lease).
-- From here the lease is the heartbeat timeout: a dead worker's row is due again that soon.
UPDATE __SCHEMA__.outbox SET started_at = now(),
    due_at = now() + make_interval(secs => %(run_lease)s)
WHERE id = %(id)s AND claim_token = %(token)s AND started_at IS NULL AND due_at > now()
  AND NOT waiting
RETURNING family, command, actor, payload, attempts, maybe_applied, dedupe_key,
    EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = id) AS cancel_requested,
    extract(epoch FROM now() - due_since)::float8 AS waited, trace_context;

-- name: explain_stale
SELECT claim_token = %(token)s AS same_token, started_at IS NOT NULL AS started,
       due_at <= now() AS lapsed
FROM __SCHEMA__.outbox WHERE id = %(id)s;

-- name: renew
-- Heartbeat: extend the leases still held (fenced by token) and report cancel requests.
UPDATE __SCHEMA__.outbox o SET due_at = now() + make_interval(secs => %(run_lease)s),
    progress = coalesce(p.progress, o.progress)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(progress)s::jsonb[])
    AS p(id, token, progress)
WHERE o.id = p.id AND o.claim_token = p.token AND o.due_at > now()
RETURNING o.id, EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id);

-- name: cancel_requests
SELECT row_id FROM __SCHEMA__.outbox_cancel WHERE row_id = ANY(%(ids)s::bigint[]);

-- name: check_claim
-- A transactional handler's first statement: its claim still holds, and whether a cancel is
-- pending. The row is not locked: the heartbeat renews its lease from another connection like
-- any other, and the settle at the end of the handler's transaction is fenced by the token.
SELECT id, EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = %(id)s)
FROM __SCHEMA__.outbox WHERE id = %(id)s AND claim_token = %(token)s AND due_at > now();

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

-- name: prune
-- One bounded batch of settled rows past their family's retention.
DELETE FROM __SCHEMA__.outbox WHERE id IN (
    SELECT id FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND (done_at IS NOT NULL OR cancelled_at IS NOT NULL)
      AND coalesce(done_at, cancelled_at) < now() - make_interval(secs => %(retention)s)
    ORDER BY coalesce(done_at, cancelled_at)
    LIMIT %(batch)s
)
RETURNING id;

-- name: prune_cancel_requests
-- Cancel requests whose row was settled (or deleted) before the request committed.
DELETE FROM __SCHEMA__.outbox_cancel c
WHERE NOT EXISTS (
    SELECT 1 FROM __SCHEMA__.outbox o
    WHERE o.id = c.row_id AND o.cancelled_at IS NULL AND o.done_at IS NULL
)
RETURNING row_id;

-- name: cron_lock
-- Creates the schedule's row on first sight, then holds it for this transaction.
WITH ins AS (
    INSERT INTO __SCHEMA__.outbox_cron (name, last_tick) VALUES (%(name)s, %(initial)s)
    ON CONFLICT (name) DO NOTHING
)
SELECT 1;

-- name: cron_last
SELECT last_tick FROM __SCHEMA__.outbox_cron WHERE name = %(name)s FOR UPDATE;

-- name: cron_advance
UPDATE __SCHEMA__.outbox_cron SET last_tick = greatest(last_tick, %(tick)s) WHERE name = %(name)s;

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

-- name: status
-- In flight means a live lease, as the claimer counts it; a row whose lease ran out is due
-- (its attempt was lost and it is claimed again).
SELECT family,
    count(*) FILTER (WHERE live AND due_at <= now()) AS due,
    count(*) FILTER (WHERE live AND due_at > now() AND claim_token IS NULL) AS scheduled,
    count(*) FILTER (WHERE live AND claim_token IS NOT NULL AND due_at > now()) AS in_flight,
    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
    count(*) FILTER (WHERE cancelled_at IS NOT NULL) AS cancelled,
    count(*) FILTER (WHERE done_at IS NOT NULL) AS done,
    coalesce(extract(epoch FROM now() - min(due_at) FILTER (WHERE live AND due_at <= now())), 0)
        AS oldest_due_age,
    count(*) FILTER (WHERE live AND maybe_applied) AS maybe_applied
FROM (
    SELECT family, due_at, claim_token, parked_at, cancelled_at, done_at, maybe_applied,
           parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL AS live
    FROM __SCHEMA__.outbox
) s
GROUP BY family ORDER BY family;

-- name: parked_list
SELECT id, family, command, actor, attempts, maybe_applied, last_error, created_at, parked_at
FROM __SCHEMA__.outbox
WHERE parked_at IS NOT NULL AND (%(family)s::text IS NULL OR family = %(family)s)
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
ORDER BY parked_at, id
LIMIT %(limit)s;

-- name: parked_retry
UPDATE __SCHEMA__.outbox SET parked_at = NULL, attempts = 0, lost_attempts = 0, due_at = now(),
    claim_token = NULL, started_at = NULL, claimed_at = NULL
WHERE parked_at IS NOT NULL
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(family)s::text IS NULL OR family = %(family)s)
RETURNING id, family, actor;

-- name: parked_purge
DELETE FROM __SCHEMA__.outbox
WHERE parked_at IS NOT NULL
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(family)s::text IS NULL OR family = %(family)s)
RETURNING id, family, actor;

-- name: lock_actor
-- Serializes enqueue and head changes of one actor of an ordered family, held to commit.
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0));

-- name: lock_actor_checked
-- lock_actor on a caller's transaction, which must read the latest commits: under REPEATABLE
-- READ or SERIALIZABLE its snapshot can predate another producer's commit, and the head check
-- would miss that producer's row. The lock is taken only at READ COMMITTED; the caller refuses
-- the others before anything is written.
SELECT current_setting('transaction_isolation') AS isolation,
       CASE WHEN current_setting('transaction_isolation') = 'read committed'
            THEN pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0)) END;

-- name: insert_ordered
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

-- name: promote_blocked
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

-- name: headless_actors
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

-- name: block_rows
-- Retried parked rows of an ordered family get back in line; promote_blocked then gives the
-- actor its lowest row as head if it has none.
UPDATE __SCHEMA__.outbox SET blocked = true, ready_at = now(), due_at = 'infinity'
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: capped_candidates
-- Due rows of a capped family from the outbox_due index range, locked as they are read (SKIP
-- LOCKED), then ranked per actor; rows with no actor rank 1 (uncapped). In (rank, due) order
-- the first row of every actor comes before the second row of any, so one actor's backlog
-- cannot fill the claim.
WITH due AS MATERIALIZED (
    SELECT id, actor, command, due_at FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND due_at <= now()
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
    ORDER BY due_at
    LIMIT %(probe)s
    FOR UPDATE SKIP LOCKED
)
SELECT id, actor, command,
       CASE WHEN actor IS NULL THEN 1
            ELSE row_number() OVER (PARTITION BY actor ORDER BY due_at, id) END AS rank
FROM due
ORDER BY rank, due_at, id;

-- name: mark_waiting
-- Rows whose actor is at its cap leave the due range for one lease, or until a slot frees.
-- A lapsed claim they still carried ends here: its token goes (no old worker can renew or
-- settle a waiting row), an attempt that never started is given back, and a started one keeps
-- started_at, so the claim that takes the row counts it as lost (maybe_applied).
UPDATE __SCHEMA__.outbox SET waiting = true, due_at = now() + make_interval(secs => %(lease)s),
    attempts = CASE WHEN claim_token IS NOT NULL AND started_at IS NULL
                    THEN greatest(attempts - 1, 0) ELSE attempts END,
    claim_token = NULL, claimed_at = NULL
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: promote_freed
-- Each slot freed since the last claim makes one waiting row of its actor due now (oldest
-- first), so the claim that follows can take it.
UPDATE __SCHEMA__.outbox o SET waiting = false, due_at = now()
FROM (
    SELECT w.id
    FROM unnest(%(actors)s::text[], %(counts)s::int[]) AS f(actor, n)
    CROSS JOIN LATERAL (
        SELECT id FROM __SCHEMA__.outbox
        WHERE family = %(family)s AND actor = f.actor AND waiting
          AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
        ORDER BY id
        LIMIT f.n
        FOR UPDATE SKIP LOCKED
    ) w
) p
WHERE o.id = p.id
RETURNING o.id;

-- name: handback
-- A delivery that may not start (its cap slot lapsed) returns the row, uncounted, due now.
UPDATE __SCHEMA__.outbox SET claim_token = NULL, claimed_at = NULL, started_at = NULL,
    due_at = now(), attempts = greatest(attempts - 1, 0)
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: live_leases
-- Rows holding a live lease in capped families: what the cap semaphores must contain, each
-- for what is left of its own lease. A row past its lease holds nothing: its holder stopped
-- renewing (every live handler's heartbeat renews), and the row is due again.
SELECT family, actor, command, claim_token,
       greatest(1, (extract(epoch FROM due_at - now()) * 1000)::bigint) AS remaining_ms
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND actor IS NOT NULL AND claim_token IS NOT NULL
  AND due_at > now();

-- name: leases_held
-- After a rebuild restored its holders: which of them still hold (a row settled between the
-- rebuild's read and the restore released a slot Redis did not have yet).
SELECT claim_token FROM __SCHEMA__.outbox
WHERE claim_token = ANY(%(tokens)s::uuid[]) AND due_at > now();

-- name: lock_caps_shared
-- Capped claims hold this shared; a rebuild of the semaphores takes it exclusively, so it
-- sees every claim that took slots before Redis lost them.
SELECT pg_advisory_xact_lock_shared(hashtextextended(%(lock_name)s, 0));

-- name: lock_caps_exclusive
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0));

-- name: cap_status
SELECT family,
       count(*) FILTER (WHERE waiting) AS waiting,
       count(*) FILTER (WHERE blocked) AS blocked
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND parked_at IS NULL AND cancelled_at IS NULL
  AND done_at IS NULL AND (waiting OR blocked)
GROUP BY family;

-- name: actors_in_flight
SELECT family, actor, count(*) AS in_flight
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND actor IS NOT NULL
  AND claim_token IS NOT NULL AND due_at > now()
GROUP BY family, actor;

-- name: begin_many
-- Delivery start for a batched message: every row whose claim still holds starts at once.
UPDATE __SCHEMA__.outbox o SET started_at = now(),
    due_at = now() + make_interval(secs => %(run_lease)s)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS p(id, token)
WHERE o.id = p.id AND o.claim_token = p.token AND o.started_at IS NULL AND o.due_at > now()
  AND NOT o.waiting
RETURNING o.id, o.claim_token, o.family, o.command, o.actor, o.payload, o.attempts,
    o.maybe_applied, o.dedupe_key,
    EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id),
    extract(epoch FROM now() - o.due_since)::float8, o.trace_context;

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

-- name: unblock
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

-- name: clock_now
SELECT now();
