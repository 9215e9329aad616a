-- One route for a row: every row is claimed by a claim and started by a start fenced by its
-- claim token. The start that claimed a row a commit named (0008-0010) is no longer called.
DROP FUNCTION IF EXISTS __SCHEMA__.outbox_claim_start(
    bigint, uuid, float8, text, integer, text, text, timestamptz
);
-- Nothing calls outbox_live_claims (0007) since the claim counts live claims inline.
DROP FUNCTION IF EXISTS __SCHEMA__.outbox_live_claims(text, integer, timestamptz);
