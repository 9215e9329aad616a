-- The outbox's own Postgres sessions: what their statements rely on, set once per new
-- connection (store/pool.py for the pool, claim/listener.py for the commit listener),
-- whatever the server's, role's or URL's defaults. The user's own connections keep
-- the user's settings.

-- name: session_commits_flush
-- A pooled session's commits wait for the disk: locally where the server's (or the role's,
-- or the URL's) default flushes nothing, else as that default says (a synchronous standby is
-- waited for too). Run once per new connection (store/pool.py); a row back: it changed the
-- session's setting.
SELECT set_config('synchronous_commit', 'local', false)
WHERE current_setting('synchronous_commit') = 'off';

-- name: session_defaults
-- What the statements of every session of our pool and of the commit listener rely on,
-- whatever the server's (or the role's, or the URL's) defaults; run once per new connection
-- (store/pool.py, claim/listener.py):
-- - statements outside a transaction block read committed too: under REPEATABLE READ a lone
--   UPDATE (a start, a settle) fails on a row another session changed meanwhile (transaction
--   blocks begin READ COMMITTED from psycopg: a claim counts in flight after the family's
--   lock, and a transactional handler's settle must serialize with the heartbeat's renewal
--   of its row);
-- - dates and intervals come back as psycopg parses them (DateStyle ISO, IntervalStyle
--   postgres): under 'SQL, DMY' a capped claim, which reads its candidates' due times,
--   would fail on every pass, and the family's rows would never be delivered;
-- - an idle session is not ended by the server (idle_session_timeout, Postgres 14 and
--   later): a pool keeps its connections between statements and deliveries, and the
--   listener's waits for a NOTIFY are idle; each one ended would fail the statement that
--   next used it (a claim, a start, a settle, a transactional handler's attempt).
SELECT set_config('default_transaction_isolation', 'read committed', false),
       set_config('DateStyle', 'ISO', false),
       set_config('IntervalStyle', 'postgres', false),
       (SELECT set_config('idle_session_timeout', '0', false)
        WHERE current_setting('idle_session_timeout', true) IS NOT NULL);
