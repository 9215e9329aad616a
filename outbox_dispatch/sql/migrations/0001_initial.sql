-- The outbox table: one row per request, written in the caller's transaction.
-- due_at is the next time the row may be claimed; while claimed it is the lease end.
CREATE TABLE __SCHEMA__.outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    family         text        NOT NULL,
    command        text        NOT NULL,
    actor          text,
    payload        jsonb       NOT NULL,
    dedupe_key     text,
    due_at         timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 0,
    claim_token    uuid,
    claimed_at     timestamptz,
    started_at     timestamptz,
    last_error     text,
    maybe_applied  boolean     NOT NULL DEFAULT false,
    trace_context  jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    parked_at      timestamptz,
    cancelled_at   timestamptz,
    cancel_reason  text,
    done_at        timestamptz,
    CONSTRAINT outbox_attempts_nonnegative CHECK (attempts >= 0),
    -- a claimed row is never parked, cancelled or done at the same time
    CONSTRAINT outbox_claim_is_live CHECK (
        claim_token IS NULL OR (parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL)
    )
);

-- The claim reads one range of this index per family: live rows with due_at <= now().
-- Future rows sit past now() in the range and settled or parked rows are not in it at all.
CREATE INDEX outbox_due ON __SCHEMA__.outbox (family, due_at)
    WHERE parked_at IS NULL AND cancelled_at IS NULL AND done_at IS NULL;

-- In-flight rows (claimed, lease running) for the claimer's backpressure count.
CREATE INDEX outbox_claimed ON __SCHEMA__.outbox (family, due_at)
    WHERE claim_token IS NOT NULL;

CREATE INDEX outbox_parked ON __SCHEMA__.outbox (family, parked_at)
    WHERE parked_at IS NOT NULL;

-- A dedupe key names one request for as long as its row exists.
CREATE UNIQUE INDEX outbox_dedupe_key ON __SCHEMA__.outbox (dedupe_key)
    WHERE dedupe_key IS NOT NULL;
