-- What operators need. The traceback of the attempt that last failed (the handler's frames,
-- the last 8 KB), beside last_error: a parked row says where its handler failed.
ALTER TABLE __SCHEMA__.outbox ADD COLUMN last_traceback text;

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
