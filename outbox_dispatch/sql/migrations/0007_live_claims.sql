-- A family's live claims (leases still running), counted up to a limit: what its in-flight
-- limit holds against. A function so that one statement can take the family's claim lock
-- and then count: a VOLATILE function's query takes its own snapshot, after the lock, where
-- the calling statement's was taken before it (a start that claims is one statement,
-- deliver_claim_begin). The claim's lease statement counts the same, inline (claim_lease).
-- The clock is the caller's now().
CREATE FUNCTION __SCHEMA__.outbox_live_claims(fam text, cap integer, at timestamptz)
RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT count(*) FROM (
        SELECT 1 FROM __SCHEMA__.outbox
        WHERE family = fam AND claim_token IS NOT NULL AND due_at > at
        ORDER BY due_at
        LIMIT cap
    ) AS live
$$;
