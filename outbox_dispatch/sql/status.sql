-- What operators read: per-family counts, cap and line counts, and parked rows.

-- name: status_families
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

-- name: status_waiting_blocked
SELECT family,
       count(*) FILTER (WHERE waiting) AS waiting,
       count(*) FILTER (WHERE blocked) AS blocked
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND parked_at IS NULL AND cancelled_at IS NULL
  AND done_at IS NULL AND (waiting OR blocked)
GROUP BY family;

-- name: status_actors_in_flight
SELECT family, actor, count(*) AS in_flight
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND actor IS NOT NULL
  AND claim_token IS NOT NULL AND due_at > now()
GROUP BY family, actor;

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

-- name: status_row_state
-- Why an operation on a row matched nothing: what the row is now, if it exists.
SELECT parked_at IS NOT NULL, cancelled_at IS NOT NULL, done_at IS NOT NULL
FROM __SCHEMA__.outbox WHERE id = %(id)s;

-- name: status_find_rows
-- An operator's search: a row id, or an exact actor or dedupe key (the actor through its
-- per-family index). A row blocked behind its actor's head is due at 'infinity': NULL here.
SELECT id, family, command, actor, dedupe_key, payload, attempts, lost_attempts, last_error,
    last_traceback, maybe_applied, NULLIF(due_at, 'infinity') AS due_at, claim_token IS NOT NULL AS claimed,
    claimed_at, started_at, created_at, parked_at, cancelled_at, cancel_reason, cancelled_by,
    done_at, waiting, blocked, progress
FROM __SCHEMA__.outbox
WHERE id = %(id)s
   OR (family = ANY(%(families)s::text[]) AND actor = %(text)s)
   OR dedupe_key = %(text)s
ORDER BY id DESC
LIMIT %(limit)s;

-- name: status_row_command
-- The command of the row a task call's dedupe key found (it must be the task's own).
SELECT command FROM __SCHEMA__.outbox WHERE id = %(id)s;

-- name: status_pause
-- Pause a family (again: the reason and who are updated, the time kept).
INSERT INTO __SCHEMA__.outbox_paused (family, reason, paused_by)
VALUES (%(family)s, %(reason)s, %(by)s)
ON CONFLICT (family) DO UPDATE SET reason = EXCLUDED.reason, paused_by = EXCLUDED.paused_by
RETURNING family;

-- name: status_resume
DELETE FROM __SCHEMA__.outbox_paused WHERE family = %(family)s RETURNING family;

-- name: status_paused
SELECT family, paused_at, reason, paused_by FROM __SCHEMA__.outbox_paused ORDER BY family;

-- name: audit_write
INSERT INTO __SCHEMA__.outbox_audit (by, action, selection, rows, reason)
VALUES (%(by)s, %(action)s, %(selection)s::jsonb, %(rows)s, %(reason)s);

-- name: audit_list
SELECT id, at, by, action, selection, rows, reason FROM __SCHEMA__.outbox_audit
ORDER BY id DESC
LIMIT %(limit)s;

-- name: status_matching
-- An operator's bulk selection, one batch at a time in id order: parked rows (retry, purge) or
-- pending ones (cancel) of a family, command, actor, error text and age.
SELECT id, family, command, actor, last_error, coalesce(parked_at, created_at) AS since
FROM __SCHEMA__.outbox
WHERE CASE WHEN %(parked)s THEN parked_at IS NOT NULL
           ELSE parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL END
  AND (%(family)s::text IS NULL OR family = %(family)s)
  AND (%(command)s::text IS NULL OR command = %(command)s)
  AND (%(actor)s::text IS NULL OR actor = %(actor)s)
  AND (%(error)s::text IS NULL OR last_error ILIKE '%%' || %(error)s || '%%')
  AND (%(older)s::float8 IS NULL
       OR coalesce(parked_at, created_at) < now() - make_interval(secs => %(older)s))
  AND id > %(after)s
ORDER BY id
LIMIT %(limit)s;

-- name: status_matching_count
SELECT count(*) FROM __SCHEMA__.outbox
WHERE CASE WHEN %(parked)s THEN parked_at IS NOT NULL
           ELSE parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL END
  AND (%(family)s::text IS NULL OR family = %(family)s)
  AND (%(command)s::text IS NULL OR command = %(command)s)
  AND (%(actor)s::text IS NULL OR actor = %(actor)s)
  AND (%(error)s::text IS NULL OR last_error ILIKE '%%' || %(error)s || '%%')
  AND (%(older)s::float8 IS NULL
       OR coalesce(parked_at, created_at) < now() - make_interval(secs => %(older)s));
