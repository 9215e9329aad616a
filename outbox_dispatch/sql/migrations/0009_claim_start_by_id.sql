-- A start that claims finds its row by the primary key alone. Migration 0008's function
-- matched the row's id together with its family, due time and state, which is what the
-- partial index outbox_due (family, due_at, for rows not parked, cancelled or done) covers:
-- a planner without statistics of the table (a new table, a backlog loaded before
-- autovacuum's ANALYZE, autovacuum off) priced the two indexes alike and walked every due
-- row of outbox_due for the one row, 14 ms a start next to 100,000 due rows instead of 0.3,
-- with the family's claim lock held. Here the row is found by its id and locked, and the
-- update takes that row version (a TID scan); the check that asks for a claim reads the row
-- by its id behind OFFSET 0, so that its conditions cannot choose the index. Otherwise the
-- function is 0008's, with the same signature: workers of either version call it.
CREATE OR REPLACE FUNCTION __SCHEMA__.outbox_claim_start(
    p_id bigint, p_token uuid, p_run_lease float8, p_family text, p_max_in_flight integer,
    p_lock_name text, p_channel text, p_now timestamptz
) RETURNS TABLE (
    family text, command text, actor text, payload jsonb, attempts integer,
    maybe_applied boolean, dedupe_key text, cancel_requested boolean, waited float8,
    trace_context jsonb, claim_age float8
) LANGUAGE plpgsql VOLATILE ROWS 1 AS $$
#variable_conflict use_column
DECLARE
    v_row tid;
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
        -- the row by its primary key (no condition that outbox_due's predicate could serve),
        -- locked: its version is the one updated below. A row held by a claim is not waited for
        SELECT l.ctid INTO v_row FROM __SCHEMA__.outbox l
        WHERE l.id = p_id AND l.claim_token IS NULL FOR UPDATE;
        RETURN QUERY
        UPDATE __SCHEMA__.outbox o SET attempts = o.attempts + 1, claim_token = p_token,
            claimed_at = p_now, due_since = o.due_at, started_at = p_now, waiting = false,
            due_at = p_now + make_interval(secs => p_run_lease)
        WHERE o.ctid = v_row AND o.id = p_id AND o.family = p_family AND o.claim_token IS NULL
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
        SELECT 1 FROM (  -- OFFSET 0: the row by its primary key, then its columns checked
            SELECT claim_token, due_at, parked_at, cancelled_at, done_at
            FROM __SCHEMA__.outbox WHERE id = p_id OFFSET 0) AS n
        WHERE n.claim_token IS NULL AND n.due_at <= p_now
          AND n.parked_at IS NULL AND n.cancelled_at IS NULL AND n.done_at IS NULL);
END
$$;
