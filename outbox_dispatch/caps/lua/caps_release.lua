-- Give back slots of one family: rows whose handlers returned or that settled, or (unrenewed)
-- started attempts whose rows' leases ran out. KEYS[1] the family's wake key, KEYS[2] its
-- "rows wait for a slot" flag (caps_acquire.lua), KEYS[3..n+2] its freed-slots hashes
-- (actor -> slots freed since the last claim), one per database: the cap is global, so the
-- actor's waiting rows in any database may take it; KEYS[n+3..] each slot's semaphore. ARGV:
-- wake window ms, n, unrenewed (1 or 0), then token and actor per slot. Several slots in one
-- run: the lapsed holders a claim gives back (Caps.release_lapsed).
-- unrenewed = 1 gives back only slots no heartbeat renewed since their claim took them or a
-- rebuild restored them (the score still ends in .5: caps_acquire.lua, caps_restore.lua):
-- their worker died before the first renewal, and the slot would otherwise run on to the
-- claim's lease. A slot a heartbeat renews stays (a worker cut off from Postgres alone still
-- runs its handler); one renewed once ends a heartbeat timeout after that renewal, before its
-- row's lease.
-- A freed slot is noted, and the claimer woken, only while the family's rows wait for slots:
-- with none waiting, nothing needs the slot but the next claim, which finds it free.
-- Returns 1 when the caller should wake the claimer (the first noted release in each
-- window), else 0.
local n = tonumber(ARGV[2])
local unrenewed = ARGV[3] == '1'
local noting = redis.call('EXISTS', KEYS[2]) == 1
local noted = false
for i = n + 3, #KEYS do
    local a = 2 * (i - n) - 2
    local give = true
    if unrenewed then
        local score = redis.call('ZSCORE', KEYS[i], ARGV[a])
        give = score and tonumber(score) % 1 ~= 0
    end
    if give and redis.call('ZREM', KEYS[i], ARGV[a]) == 1 and noting then
        for f = 3, n + 2 do
            redis.call('HINCRBY', KEYS[f], ARGV[a + 1], 1)
        end
        noted = true
    end
end
if noted and redis.call('SET', KEYS[1], '1', 'NX', 'PX', tonumber(ARGV[1])) then
    return 1
end
return 0
