-- Cap semaphore upkeep in Postgres: the shared/exclusive lock that keeps a rebuild from
-- missing a claim, and the live leases a rebuild restores.

-- name: caps_lock_shared
-- Capped claims hold this shared; a rebuild of the semaphores takes it exclusively, so it
-- sees every claim that took slots before Redis lost them. Either waits for the other, as
-- long as a claim or a rebuild lasts: a server's lock_timeout default must not fail it for
-- that (a rebuild that timed out behind a stream of claims would leave capped rows waiting),
-- so both transactions wait without one (set first: the target list runs in order).
SELECT set_config('lock_timeout', '0', true),
       pg_advisory_xact_lock_shared(hashtextextended(%(lock_name)s, 0));

-- name: caps_lock_exclusive
SELECT set_config('lock_timeout', '0', true),
       pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0));

-- name: caps_live_leases
-- Rows holding a live lease in capped families: what the cap semaphores must contain, each
-- for what is left of its own lease. A row past its lease holds nothing: its holder stopped
-- renewing (every live handler's heartbeat renews), and the row is due again.
SELECT family, actor, command, claim_token,
       greatest(1, (extract(epoch FROM due_at - now()) * 1000)::bigint) AS remaining_ms
FROM __SCHEMA__.outbox
WHERE family = ANY(%(families)s::text[]) AND actor IS NOT NULL AND claim_token IS NOT NULL
  AND due_at > now();

-- name: caps_leases_held
-- After a rebuild restored its holders: which of them still hold (a row settled between the
-- rebuild's read and the restore released a slot Redis did not have yet).
SELECT claim_token FROM __SCHEMA__.outbox
WHERE claim_token = ANY(%(tokens)s::uuid[]) AND due_at > now();
