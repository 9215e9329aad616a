-- Job lifecycle: cancellation, progress, retention pruning and durable cron.

ALTER TABLE __SCHEMA__.outbox
    ADD COLUMN cancelled_by text,
    ADD COLUMN progress     jsonb;

-- Cancel requests for rows that could not be settled as cancelled on the spot (running, or
-- claimed and on their way to a worker): delivery and heartbeats honour them.
CREATE TABLE __SCHEMA__.outbox_cancel (
    row_id       bigint PRIMARY KEY,
    requested_at timestamptz NOT NULL DEFAULT now(),
    reason       text,
    requested_by text
);

-- Settled rows kept for their family's retention window, in the order prune deletes them.
CREATE INDEX outbox_settled ON __SCHEMA__.outbox (family, (coalesce(done_at, cancelled_at)))
    WHERE done_at IS NOT NULL OR cancelled_at IS NOT NULL;

-- The last tick each cron schedule has enqueued: beat processes serialize on this row, so
-- several of them still make one row per tick.
CREATE TABLE __SCHEMA__.outbox_cron (
    name      text PRIMARY KEY,
    last_tick timestamptz NOT NULL
);
