-- Maintenance: pruning settled rows, stale cancel requests and the audit log past its
-- retention, and the cron schedules.

-- name: maintenance_prune
-- One bounded batch of settled rows past their family's retention.
DELETE FROM __SCHEMA__.outbox WHERE id IN (
    SELECT id FROM __SCHEMA__.outbox
    WHERE family = %(family)s AND (done_at IS NOT NULL OR cancelled_at IS NOT NULL)
      AND coalesce(done_at, cancelled_at) < now() - make_interval(secs => %(retention)s)
    ORDER BY coalesce(done_at, cancelled_at)
    LIMIT %(batch)s
)
RETURNING id;

-- name: maintenance_prune_audit
-- One bounded batch of the operators' audit log past its retention, oldest first.
DELETE FROM __SCHEMA__.outbox_audit WHERE id IN (
    SELECT id FROM __SCHEMA__.outbox_audit
    WHERE at < now() - make_interval(secs => %(retention)s)
    ORDER BY at
    LIMIT %(batch)s
)
RETURNING id;

-- name: maintenance_prune_cancel_requests
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

-- name: cron_now
SELECT now();
