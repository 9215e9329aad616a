-- Handler run times per family and process, reported by delivering processes and read by
-- claimers to size the messages of a backlog.

-- name: runstats_report
-- A process's mean handler run time for a family (upserted every few seconds at most).
INSERT INTO __SCHEMA__.outbox_run_stats (family, process, run_seconds, updated_at)
VALUES (%(family)s, %(process)s, %(run_seconds)s, now())
ON CONFLICT (family, process)
DO UPDATE SET run_seconds = excluded.run_seconds, updated_at = excluded.updated_at;

-- name: runstats_read
-- Per family: the processes that delivered its rows lately and their mean run time.
SELECT family, count(*)::int, avg(run_seconds)::float8
FROM __SCHEMA__.outbox_run_stats
WHERE updated_at > now() - make_interval(secs => %(max_age)s)
GROUP BY family;

-- name: runstats_prune
-- Reports of processes gone quiet long ago (restarted workers leave theirs behind).
DELETE FROM __SCHEMA__.outbox_run_stats
WHERE updated_at < now() - make_interval(secs => %(max_age)s);
