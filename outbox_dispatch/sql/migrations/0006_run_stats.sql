-- What each delivering process measured of a family's handlers: the mean run time of its
-- recent rows, reported every few seconds. The claimer sizes a backlog's messages from it
-- (rows per message by run time) and counts the processes seen lately as consumers.
CREATE TABLE __SCHEMA__.outbox_run_stats (
    family text NOT NULL,
    process text NOT NULL,
    run_seconds float8 NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (family, process)
);
