-- Per-actor caps and ordered families.
-- waiting: a capped row whose actor was at its cap when claimed; moved out of the due range
--          (due_at = now + lease) until a slot of its actor frees or the lease passes.
-- blocked: a row of an ordered family behind its actor's head; due_at is 'infinity' until it
--          becomes the head, when due_at = greatest(ready_at, now()).
-- ready_at: the due time the row was enqueued with (kept while it is blocked).
ALTER TABLE __SCHEMA__.outbox
    ADD COLUMN waiting  boolean     NOT NULL DEFAULT false,
    ADD COLUMN blocked  boolean     NOT NULL DEFAULT false,
    ADD COLUMN ready_at timestamptz;

-- One actor's unsettled rows in enqueue order: the ordered head check at enqueue, promotion of
-- the next blocked or waiting row, and the caps rebuild all read one small range of it.
CREATE INDEX outbox_actor_queue ON __SCHEMA__.outbox (family, actor, id)
    WHERE actor IS NOT NULL AND cancelled_at IS NULL AND done_at IS NULL;
