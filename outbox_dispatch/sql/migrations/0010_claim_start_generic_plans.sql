-- The start that claims plans its statements once per session. PL/pgSQL plans each statement
-- of a function for the values of its first five calls in a session (custom plans) before it
-- settles on one plan for all values; with the function's first call compiling it, a new
-- connection's first six starts took 0.5-0.9 ms each (4 ms the first) against 0.2 ms after.
-- Each statement here reads one row by its primary key or the outbox_claimed index for one
-- family, a plan that does not depend on the values, so the generic plan is the plan the
-- sixth call settles on: it is made on the first call now. (store.py also calls the function
-- on no row when a main-pool session opens, so a pool process's first delivery does not
-- compile it.)
ALTER FUNCTION __SCHEMA__.outbox_claim_start(
    bigint, uuid, float8, text, integer, text, text, timestamptz
) SET plan_cache_mode = force_generic_plan;
