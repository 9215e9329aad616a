-- The claim, in the order it runs: lock the family, count what is in flight, pick due rows
-- (none of a paused family, outbox_paused; capped families: rank candidates per actor), lease
-- them; rows whose actor is at its cap are set waiting, waiting rows whose actor freed a slot
-- are offered first, and the slots of started attempts whose lease ran out are given back.

-- name: claim_lock_family
-- Serializes one family's claims so the in-flight count cannot race; released at commit.
-- Also turns bitmap scans off for the claim's transaction: a bitmap scan cannot skip the dead
-- index entries that settled rows leave behind until vacuum, so every in-flight count would
-- read them all, while a plain index scan marks them dead once and then passes them by.
-- Which of the claim and the delivery start waits for the WAL flush (policy.starts_flushed):
-- - starts that flush: the claim does not (synchronous_commit off, this transaction only). A
--   claim lost in a Postgres crash leaves its rows as they were, its messages carry tokens no
--   row has and are dropped as stale, and the start that needs the claim flushes its WAL.
-- - starts that do not flush (the default): the claim does, with the session's setting, or
--   'local' where that is 'off' (a server that flushes nothing by default would lose both).
--   A start lost in a crash then leaves a claim older than the server's start, which the
--   claim and the start below take as an attempt that may have run (lost).
-- The wait for the lock is another claim of the family, as long as that claim: a server's
-- lock_timeout default (set against pile-ups behind DDL) must not fail this one for it, so the
-- claim's transaction waits without one (set first: the target list runs in order).
SELECT set_config('lock_timeout', '0', true),
       pg_advisory_xact_lock(hashtext(%(lock_name)s)),
       set_config('enable_bitmapscan', 'off', true),
       set_config('synchronous_commit',
           CASE WHEN %(flushed_starts)s THEN 'off'
                WHEN current_setting('synchronous_commit') = 'off' THEN 'local'
                ELSE current_setting('synchronous_commit') END,
           true);

-- name: claim_lease
-- A claim's lease, run under the family lock: the rows it holds locked (the capped claim's
-- take, under its cap slots' tokens), or, given no ids, the family's due rows it picks here,
-- oldest first from the outbox_due index range, skipping rows another claimer holds, as many
-- as the batch and the in-flight limit leave room for (live claims counted along the
-- outbox_claimed index: a claim whose lease ran out is not in flight, started or not, since
-- its holder is dead or stalled and the row is due again). Count, pick and lease are one
-- statement so that a claim is one round trip with the lock (pipelined): the statement's
-- snapshot is taken after the lock is granted, so the count sees every claim committed before.
-- A previous claim that never started (its message was lost or came too late) does not count
-- as an attempt; one that started and never settled was lost mid-run, so the next attempt is
-- marked maybe_applied, and a lost last attempt parks the row instead of running it again
-- (returned with no token). Where starts do not flush, a claim older than the server's start
-- counts as started: a Postgres crash may have lost its start after the handler ran. Each row
-- is judged from its own columns and found by primary key: no join, so no plan can turn the
-- claim into a scan per row (a nested loop of sequential scans, on a table without
-- statistics). Ids, when given, come sorted (Store._lease), so a row's token is found by
-- binary search (width_bucket), where a search of the array per row would make a claim
-- quadratic. The first column is the room the pick had (NULL when ids were given); a last row
-- with no id carries it even when nothing was leased.
WITH room AS MATERIALIZED (
    -- live claims counted along the outbox_claimed index, at most max_in_flight of them
    SELECT greatest(0, least(%(batch)s::int, %(max_in_flight)s::int - (
        SELECT count(*) FROM (
            SELECT 1 FROM __SCHEMA__.outbox
            WHERE family = %(family)s AND claim_token IS NOT NULL AND due_at > now()
            ORDER BY due_at
            LIMIT %(max_in_flight)s::int
        ) AS live
    )))::int AS n
    WHERE %(ids)s::bigint[] IS NULL
), chosen AS MATERIALIZED (
    SELECT coalesce(%(ids)s::bigint[], ARRAY(
        SELECT id FROM __SCHEMA__.outbox
        WHERE family = %(family)s AND due_at <= now()
          AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_paused p WHERE p.family = %(family)s)
        ORDER BY due_at
        LIMIT (SELECT n FROM room)
        FOR UPDATE SKIP LOCKED
    )) AS ids
), leased AS (
    UPDATE __SCHEMA__.outbox o SET
        (attempts, maybe_applied, lost_attempts, last_error, last_traceback, claim_token,
         claimed_at, due_since, started_at, waiting, parked_at, due_at) = (
        SELECT
            CASE WHEN j.exhausted OR (o.claim_token IS NOT NULL AND NOT j.lost) THEN o.attempts
                 ELSE o.attempts + 1 END,
            o.maybe_applied OR j.lost,
            o.lost_attempts + j.lost::int,
            CASE WHEN j.lost AND o.started_at IS NULL THEN 'attempt ' || o.attempts
                     || ' ended without an outcome (claimed before Postgres restarted, which'
                     || ' may have lost its start)'
                 WHEN j.lost THEN 'attempt ' || o.attempts
                     || ' ended without an outcome (worker died or lease ran out)'
                 ELSE o.last_error END,
            CASE WHEN j.lost THEN NULL ELSE o.last_traceback END,
            CASE WHEN j.exhausted THEN NULL
                 WHEN cardinality(%(tokens)s::uuid[]) = 0 THEN gen_random_uuid()
                 ELSE (%(tokens)s::uuid[])[width_bucket(o.id, %(ids)s::bigint[])] END,
            CASE WHEN j.exhausted THEN NULL ELSE now() END,
            CASE WHEN j.exhausted THEN o.due_since ELSE o.due_at END,
            NULL::timestamptz,
            false,
            CASE WHEN j.exhausted THEN now() END,
            CASE WHEN j.exhausted THEN o.due_at
                 ELSE clock_timestamp() + make_interval(secs => %(lease)s) END
        FROM (SELECT k.lost, k.lost AND (
                         %(park_lost)s OR o.lost_attempts + 1 >= %(max_lost)s::int
                         OR (%(max_attempts)s::int IS NOT NULL
                             AND o.attempts >= %(max_attempts)s::int)
                     ) AS exhausted
              FROM (SELECT o.started_at IS NOT NULL OR (
                        NOT %(flushed_starts)s AND o.claim_token IS NOT NULL
                        AND o.claimed_at < pg_postmaster_start_time()) AS lost) k) j
    )
    WHERE o.id = ANY((SELECT ids FROM chosen)::bigint[])
    RETURNING o.id, o.claim_token, o.command, o.actor, o.attempts, o.claim_token IS NULL,
        o.last_error
)
SELECT (SELECT n FROM room), leased.* FROM leased
UNION ALL
SELECT (SELECT n FROM room), NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::int,
       NULL::boolean, NULL::text;

-- name: claim_capped_candidates
-- Due rows of a capped family from the outbox_due index range, locked as they are read (SKIP
-- LOCKED), then ranked per actor; rows with no actor rank 1 (uncapped). In (rank, due) order
-- the first row of every actor comes before the second row of any, so one actor's backlog
-- cannot fill the claim. The room (as in claim_lease) is counted here too, so that the probe
-- (four candidates a row of room, at least 100) needs no round trip of its own: the first
-- column is the room; when no row is due, one row with no id carries it.
WITH room AS MATERIALIZED (
    -- live claims counted along the outbox_claimed index, at most max_in_flight of them
    SELECT greatest(0, least(%(batch)s::int, %(max_in_flight)s::int - (
        SELECT count(*) FROM (
            SELECT 1 FROM __SCHEMA__.outbox
            WHERE family = %(family)s AND claim_token IS NOT NULL AND due_at > now()
            ORDER BY due_at
            LIMIT %(max_in_flight)s::int
        ) AS live
    )))::int AS n
), due AS MATERIALIZED (
    SELECT id, actor, command, due_at FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND due_at <= now()
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_paused p WHERE p.family = %(family)s)
    ORDER BY due_at
    LIMIT (SELECT CASE WHEN n = 0 THEN 0 ELSE greatest(4 * n, 100) END FROM room)
    FOR UPDATE SKIP LOCKED
), ranked AS (
    SELECT id, actor, command, due_at,
           CASE WHEN actor IS NULL THEN 1
                ELSE row_number() OVER (PARTITION BY actor ORDER BY due_at, id) END AS rank
    FROM due
)
SELECT room.n AS room, r.id, r.actor, r.command, r.rank
FROM room LEFT JOIN ranked r ON true
ORDER BY r.rank, r.due_at, r.id;

-- name: claim_lapsed_holders
-- Started attempts of the family whose lease ran out: their worker died or stalled past the
-- heartbeat timeout. Their cap slots still run to their claims' leases (a start does not
-- shorten a young claim's slot, worker/slots.py), so the claim gives them back before it takes
-- slots. All of them, along the outbox_claimed index (claimed rows only, so never the due
-- backlog; a dead worker's rows are claimed again, under new tokens, by this very claim, so
-- one left out here would keep its slot for a whole lease); an attempt that never started
-- needs nothing: its slot ends with its claim's lease.
SELECT actor, command, claim_token FROM __SCHEMA__.outbox
WHERE family = %(family)s AND claim_token IS NOT NULL AND due_at <= now()
  AND started_at IS NOT NULL AND actor IS NOT NULL
ORDER BY due_at;

-- name: claim_mark_waiting
-- Rows whose actor is at its cap leave the due range for one lease, or until a slot frees.
-- A lapsed claim they still carried ends here: its token goes (no old worker can renew or
-- settle a waiting row), an attempt that never started is given back, and a started one keeps
-- started_at, so the claim that takes the row counts it as lost (maybe_applied). Where starts
-- do not flush, a claim older than the server's start may have started: it is kept as one.
UPDATE __SCHEMA__.outbox SET waiting = true, due_at = now() + make_interval(secs => %(lease)s),
    attempts = CASE WHEN claim_token IS NOT NULL AND started_at IS NULL AND (
                        %(flushed_starts)s OR claimed_at >= pg_postmaster_start_time())
                    THEN greatest(attempts - 1, 0) ELSE attempts END,
    started_at = CASE WHEN claim_token IS NOT NULL AND started_at IS NULL
                           AND NOT %(flushed_starts)s
                           AND claimed_at < pg_postmaster_start_time()
                      THEN claimed_at ELSE started_at END,
    claim_token = NULL, claimed_at = NULL
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: claim_freed_waiting
-- Each slot freed since the last claim picks one waiting row of its actor (oldest first),
-- locked as it is read: the claim offers them first, and leases those that get a slot
-- straight from waiting, so a freed slot costs its row no update of its own (no promotion to
-- due, no second probe).
SELECT w.id, f.actor, w.command
FROM unnest(%(actors)s::text[], %(counts)s::int[]) AS f(actor, n)
CROSS JOIN LATERAL (
    SELECT id, command FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND actor = f.actor AND waiting
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
    ORDER BY id
    LIMIT f.n
    FOR UPDATE SKIP LOCKED
) w
ORDER BY w.id;

-- name: claim_promote
-- Freed-slot rows a claim had no room for come due now, ahead of the next claim's probe.
UPDATE __SCHEMA__.outbox SET waiting = false, due_at = now()
WHERE id = ANY(%(ids)s::bigint[]) AND waiting
RETURNING id;

-- name: claim_give_back
-- A claim whose messages could not be published (the broker down, a publish that raised): its
-- rows that have not started are due again, under the claim's token, as if its lease had run
-- out, so the next claim takes them without counting an attempt (a claim that never started
-- is not one). They are due from when they were due before the claim (due_since), which keeps
-- their place in line and lies before the start of any message of the claim: a start that
-- waited on the row's lock re-checks its lease against its own now() and is refused, and a
-- message that did go out is refused the same way. A row that started first is left to run.
UPDATE __SCHEMA__.outbox o SET due_at = coalesce(o.due_since, o.claimed_at)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS g(id, token)
WHERE o.id = g.id AND o.claim_token = g.token AND o.started_at IS NULL
RETURNING o.id;

-- name: claim_request
-- Ask the commit listener for a claim of a family now (a cap slot freed), as a commit does.
SELECT pg_notify(%(channel)s, %(family)s);

-- name: claim_families_due
-- Which of the given families have a due row and are not paused: one probe of the outbox_due
-- index each, so a claim pass over many idle families costs one round trip, not a claim
-- transaction each.
SELECT f FROM unnest(%(families)s::text[]) AS f
WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.outbox_paused p WHERE p.family = f) AND EXISTS (
    SELECT 1 FROM __SCHEMA__.outbox
    WHERE family = f AND due_at <= now()
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
);
