-- A start that claims (deliver_claim_begin), as a function: a row a commit's NOTIFY named,
-- handed unclaimed by the listener to an idle pool process of its own worker, is claimed and
-- started in one round trip. A PL/pgSQL function keeps its statements' plans for the session
-- (the plain statement planned its nested count on every call), and each of its statements
-- takes its own snapshot under READ COMMITTED (the main pool's sessions, pool.py): the count
-- and the update see every claim committed before the family's lock was taken.
--
-- It takes the family's claim lock first, as a claim does, so no claim races its in-flight
-- count, and commits as a claim does, waiting for its WAL flush: a start lost in a crash is
-- lost with its claim, and the row is as it was. Only a row no one holds (no token) and that
-- is due: a lapsed claim's row is the claim's to judge (a lost attempt). A row it does not
-- start is left as it is; when it is still there for a claim to take (no room in flight), a
-- NOTIFY of its family asks the listener for one at once. A row a claim took first asks
-- nothing: its claim's message delivers it. Returns the started row, or no row. Its clock
-- is the calling statement's now(), passed as p_now (tests move every statement's clock).
CREATE FUNCTION __SCHEMA__.outbox_claim_start(
    p_id bigint, p_token uuid, p_run_lease float8, p_family text, p_max_in_flight integer,
    p_lock_name text, p_channel text, p_now timestamptz
) RETURNS TABLE (
    family text, command text, actor text, payload jsonb, attempts integer,
    maybe_applied boolean, dedupe_key text, cancel_requested boolean, waited float8,
    trace_context jsonb, claim_age float8
) LANGUAGE plpgsql VOLATILE ROWS 1 AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(p_lock_name)),
        set_config('enable_bitmapscan', 'off', true),
        set_config('synchronous_commit',
            CASE WHEN current_setting('synchronous_commit') = 'off' THEN 'local'
                 ELSE current_setting('synchronous_commit') END,
            true);
    IF (SELECT count(*) FROM (
            SELECT 1 FROM __SCHEMA__.outbox l
            WHERE l.family = p_family AND l.claim_token IS NOT NULL AND l.due_at > p_now
            ORDER BY l.due_at
            LIMIT p_max_in_flight) AS live) < p_max_in_flight THEN
        RETURN QUERY
        UPDATE __SCHEMA__.outbox o SET attempts = o.attempts + 1, claim_token = p_token,
            claimed_at = p_now, due_since = o.due_at, started_at = p_now, waiting = false,
            due_at = p_now + make_interval(secs => p_run_lease)
        WHERE o.id = p_id AND o.family = p_family AND o.claim_token IS NULL
          AND o.due_at <= p_now AND o.parked_at IS NULL AND o.cancelled_at IS NULL
          AND o.done_at IS NULL AND NOT o.waiting AND NOT o.blocked
        RETURNING o.family, o.command, o.actor, o.payload, o.attempts, o.maybe_applied,
            o.dedupe_key,
            EXISTS (SELECT 1 FROM __SCHEMA__.outbox_cancel c WHERE c.row_id = o.id),
            extract(epoch FROM p_now - o.due_since)::float8, o.trace_context, 0::float8;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_notify(p_channel, p_family)
    WHERE EXISTS (
        SELECT 1 FROM __SCHEMA__.outbox n
        WHERE n.id = p_id AND n.claim_token IS NULL AND n.due_at <= p_now
          AND n.parked_at IS NULL AND n.cancelled_at IS NULL AND n.done_at IS NULL);
END
$$;
