-- The outbox schema as the migrations leave it, in one file to read. `outbox-dispatch migrate`
-- applies sql/migrations/ (they upgrade an existing schema); tests/adoption/test_schema.py
-- checks that this file builds exactly what they build. __SCHEMA__ is the schema's name.

-- The migrations applied to this schema (written by migrate, not by a migration).
CREATE TABLE __SCHEMA__.outbox_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- One row per request, written in the caller's transaction with its business change.
CREATE TABLE __SCHEMA__.outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    family         text        NOT NULL,
    command        text        NOT NULL,
    actor          text,
    payload        jsonb       NOT NULL,
    dedupe_key     text,
    -- when the row may next be claimed; while it is claimed, the end of the claim's lease
    due_at         timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 0,
    -- the claim that holds the row: every start and settle is fenced by it
    claim_token    uuid,
    claimed_at     timestamptz,
    started_at     timestamptz,
    last_error     text,
    -- an attempt may have run without its outcome being recorded (a lost attempt)
    maybe_applied  boolean     NOT NULL DEFAULT false,
    trace_context  jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    parked_at      timestamptz,
    cancelled_at   timestamptz,
    cancel_reason  text,
    done_at        timestamptz,
    -- a capped row whose actor was at its cap when claimed: out of the due range (due_at =
    -- now + lease) until a slot of its actor frees or the lease passes
    waiting        boolean     NOT NULL DEFAULT false,
    -- a row of an ordered family behind its actor's head: due_at is 'infinity' until it
    -- becomes the head, then greatest(ready_at, now())
    blocked        boolean     NOT NULL DEFAULT false,
    -- the due time the row was enqueued with, kept while it is blocked
    ready_at       timestamptz,
    cancelled_by   text,
    progress       jsonb,
    -- consecutive attempts that ended without an outcome: a handler that kills its process
    -- every time is parked even in a family that retries forever
    lost_attempts  integer     NOT NULL DEFAULT 0,
    -- when the current attempt became due: commit-to-start latency is measured from it
    due_since      timestamptz,
    -- the traceback of the attempt that last failed (the handler's frames, the last 8 KB)
    last_traceback text,
    CONSTRAINT outbox_attempts_nonnegative CHECK (attempts >= 0),
    -- a claimed row is never parked, cancelled or done at the same time
    CONSTRAINT outbox_claim_is_live CHECK (
        claim_token IS NULL OR (parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL)
    )
);

-- A claim reads one range of this index per family: live rows with due_at <= now().
CREATE INDEX outbox_due ON __SCHEMA__.outbox (family, due_at)
    WHERE parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL;

-- Claimed rows, for a family's in-flight count and its lapsed claims.
CREATE INDEX outbox_claimed ON __SCHEMA__.outbox (family, due_at)
    WHERE claim_token IS NOT NULL;

-- A dedupe key names one request for as long as its row exists.
CREATE UNIQUE INDEX outbox_dedupe_key ON __SCHEMA__.outbox (dedupe_key)
    WHERE dedupe_key IS NOT NULL;

-- One actor's unsettled rows in enqueue order: the ordered head check at enqueue, promotion
-- of the next blocked or waiting row, and the caps rebuild read one small range of it.
CREATE INDEX outbox_actor_queue ON __SCHEMA__.outbox (family, actor, id)
    WHERE actor IS NOT NULL AND cancelled_at IS NULL AND done_at IS NULL;

-- Ordered heads by actor, so that promotion does not grow with an actor's backlog.
CREATE INDEX outbox_heads ON __SCHEMA__.outbox (family, actor)
    WHERE actor IS NOT NULL AND NOT blocked AND cancelled_at IS NULL AND done_at IS NULL;

CREATE INDEX outbox_parked ON __SCHEMA__.outbox (family, parked_at)
    WHERE parked_at IS NOT NULL;

-- Settled rows kept for their family's retention, in the order prune deletes them.
CREATE INDEX outbox_settled ON __SCHEMA__.outbox (family, coalesce(done_at, cancelled_at))
    WHERE done_at IS NOT NULL OR cancelled_at IS NOT NULL;

-- Cancel requests for rows that could not be settled as cancelled on the spot (running, or
-- claimed and on their way to a worker): deliveries and heartbeats honour them.
CREATE TABLE __SCHEMA__.outbox_cancel (
    row_id       bigint      PRIMARY KEY,
    requested_at timestamptz NOT NULL DEFAULT now(),
    reason       text,
    requested_by text
);

-- The last tick each cron schedule has enqueued: beat processes serialize on its row, so
-- several of them still write one row per tick.
CREATE TABLE __SCHEMA__.outbox_cron (
    name      text        PRIMARY KEY,
    last_tick timestamptz NOT NULL
);

-- What each delivering process measured of a family's handlers (mean run time of its recent
-- rows): the claimer sizes a backlog's messages from it and counts the consumers seen lately.
CREATE TABLE __SCHEMA__.outbox_run_stats (
    family      text             NOT NULL,
    process     text             NOT NULL,
    run_seconds double precision NOT NULL,
    updated_at  timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (family, process)
);

-- Paused families: their due rows are not claimed (running ones finish, enqueues commit) until
-- resumed; a row here holds on every worker and survives restarts.
CREATE TABLE __SCHEMA__.outbox_paused (
    family    text        PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    reason    text,
    paused_by text
);

-- What operators did: every retry, purge, cancel, pause and resume, from the CLI, the page,
-- the Django admin or Python, with who, what, how many rows and why. Pruned after the
-- dispatcher's audit_retention (90 days by default).
CREATE TABLE __SCHEMA__.outbox_audit (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    by        text        NOT NULL,
    action    text        NOT NULL,
    selection jsonb       NOT NULL,
    rows      integer     NOT NULL,
    reason    text
);
CREATE INDEX outbox_audit_at ON __SCHEMA__.outbox_audit (at);
