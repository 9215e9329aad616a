-- Ordered heads found by index (promotion cost no longer grows with an actor's backlog), and
-- a count of consecutive attempts that ended without an outcome, so a handler that kills its
-- process every time is parked even in a family that retries forever.
CREATE INDEX outbox_heads ON __SCHEMA__.outbox (family, actor)
    WHERE actor IS NOT NULL AND NOT blocked AND cancelled_at IS NULL AND done_at IS NULL;

ALTER TABLE __SCHEMA__.outbox
    ADD COLUMN lost_attempts integer NOT NULL DEFAULT 0;
