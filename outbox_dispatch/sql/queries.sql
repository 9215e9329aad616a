-- Named queries used by store.py. __SCHEMA__ is replaced by the quoted, validated schema name.
-- Times come from the database clock (now()), never from a client.

-- name: insert
INSERT INTO __SCHEMA__.outbox (family, command, actor, payload, dedupe_key, due_at)
VALUES (%(family)s, %(command)s, %(actor)s, %(payload)s::jsonb, %(dedupe_key)s,
        coalesce(%(at)s::timestamptz, now()) + make_interval(secs => %(delay)s))
ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: find_dedupe
SELECT id FROM __SCHEMA__.outbox WHERE dedupe_key = %(dedupe_key)s;

-- name: lock_family
-- Serializes one family's claims so the in-flight count cannot race; released at commit.
SELECT pg_advisory_xact_lock(hashtext(%(lock_name)s));

-- name: in_flight
SELECT count(*) FROM __SCHEMA__.outbox
WHERE family = %(family)s AND claim_token IS NOT NULL AND due_at > now();

-- name: claim
-- One statement: pick due rows of a family from the outbox_due index range, skip rows that
-- another claimer holds, then lease them under a fresh token. A previous claim that never
-- started (its message was lost or came too late) does not count as an attempt; one that
-- started and never settled was lost mid-run, so the next attempt is marked maybe_applied,
-- and a lost last attempt parks the row instead of running it again.
WITH picked AS (
    SELECT id FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND due_at <= now()
      AND parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL
    ORDER BY due_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
judged AS (
    SELECT o.id,
           o.started_at IS NOT NULL AS lost,
           o.started_at IS NOT NULL AND (
               %(park_lost)s OR (%(max_attempts)s::int IS NOT NULL
                                 AND o.attempts >= %(max_attempts)s::int)
           ) AS exhausted
    FROM __SCHEMA__.outbox o JOIN picked USING (id)
)
UPDATE __SCHEMA__.outbox o SET
    attempts = CASE
        WHEN j.exhausted OR (o.claim_token IS NOT NULL AND NOT j.lost) THEN o.attempts
        ELSE o.attempts + 1 END,
    maybe_applied = o.maybe_applied OR j.lost,
    last_error = CASE WHEN j.lost
        THEN 'attempt ' || o.attempts || ' ended without an outcome (worker died or lease ran out)'
        ELSE o.last_error END,
    claim_token = CASE WHEN j.exhausted THEN NULL ELSE gen_random_uuid() END,
    claimed_at = CASE WHEN j.exhausted THEN NULL ELSE now() END,
    started_at = NULL,
    parked_at = CASE WHEN j.exhausted THEN now() END,
    due_at = CASE WHEN j.exhausted THEN o.due_at ELSE now() + make_interval(secs => %(lease)s) END
FROM judged j
WHERE o.id = j.id
RETURNING o.id, o.claim_token, o.command, o.actor, o.attempts, j.exhausted, o.last_error;

-- name: begin
-- Delivery start: the token must still hold, the lease must still run and the attempt must
-- not have started before (a redelivered message of a killed worker waits for the lease).
UPDATE __SCHEMA__.outbox SET started_at = now(),
    due_at = now() + make_interval(secs => %(lease)s)
WHERE id = %(id)s AND claim_token = %(token)s AND started_at IS NULL AND due_at > now()
RETURNING family, command, actor, payload, attempts, maybe_applied, dedupe_key;

-- name: explain_stale
SELECT claim_token = %(token)s AS same_token, started_at IS NOT NULL AS started,
       due_at <= now() AS lapsed
FROM __SCHEMA__.outbox WHERE id = %(id)s;

-- name: renew
UPDATE __SCHEMA__.outbox SET due_at = now() + make_interval(secs => %(lease)s)
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: settle_delete
DELETE FROM __SCHEMA__.outbox WHERE id = %(id)s AND claim_token = %(token)s RETURNING id;

-- name: settle_done
UPDATE __SCHEMA__.outbox SET done_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: settle_retry
UPDATE __SCHEMA__.outbox SET due_at = now() + make_interval(secs => %(delay)s),
    claim_token = NULL, started_at = NULL, claimed_at = NULL, last_error = %(error)s
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: settle_park
UPDATE __SCHEMA__.outbox SET parked_at = now(), claim_token = NULL, started_at = NULL,
    claimed_at = NULL, last_error = %(error)s
WHERE id = %(id)s AND claim_token = %(token)s
RETURNING id;

-- name: status
SELECT family,
    count(*) FILTER (WHERE live AND due_at <= now()) AS due,
    count(*) FILTER (WHERE live AND due_at > now() AND claim_token IS NULL) AS scheduled,
    count(*) FILTER (WHERE live AND due_at > now() AND claim_token IS NOT NULL) AS in_flight,
    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
    count(*) FILTER (WHERE cancelled_at IS NOT NULL) AS cancelled,
    count(*) FILTER (WHERE done_at IS NOT NULL) AS done,
    coalesce(extract(epoch FROM now() - min(due_at) FILTER (WHERE live AND due_at <= now())), 0)
        AS oldest_due_age
FROM (
    SELECT family, due_at, claim_token, parked_at, cancelled_at, done_at,
           parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL AS live
    FROM __SCHEMA__.outbox
) s
GROUP BY family ORDER BY family;

-- name: parked_list
SELECT id, family, command, actor, attempts, maybe_applied, last_error, created_at, parked_at
FROM __SCHEMA__.outbox
WHERE parked_at IS NOT NULL AND (%(family)s::text IS NULL OR family = %(family)s)
ORDER BY parked_at, id
LIMIT %(limit)s;

-- name: parked_retry
UPDATE __SCHEMA__.outbox SET parked_at = NULL, attempts = 0, due_at = now(),
    claim_token = NULL, started_at = NULL, claimed_at = NULL
WHERE parked_at IS NOT NULL
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(family)s::text IS NULL OR family = %(family)s)
RETURNING id;

-- name: parked_purge
DELETE FROM __SCHEMA__.outbox
WHERE parked_at IS NOT NULL
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(family)s::text IS NULL OR family = %(family)s)
RETURNING id;
