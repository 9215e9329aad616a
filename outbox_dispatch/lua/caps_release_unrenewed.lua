-- Give back the slots of started attempts whose rows' leases ran out, those no heartbeat
-- renewed since their claim took them or a rebuild restored them (the score still ends in .5:
-- caps_acquire.lua, caps_restore.lua): their worker died before the first renewal, and the
-- slot would otherwise run on to the claim's lease. A slot a heartbeat renews stays (a worker
-- cut off from Postgres alone still runs its handler); one renewed once ends a heartbeat
-- timeout after that renewal, before its row's lease. KEYS and ARGV as caps_release.lua.
local n = tonumber(ARGV[2])
for i = n + 2, #KEYS do
    local a = 2 * (i - n) - 1
    local score = redis.call('ZSCORE', KEYS[i], ARGV[a])
    if score and tonumber(score) % 1 ~= 0 and redis.call('ZREM', KEYS[i], ARGV[a]) == 1 then
        for f = 2, n + 1 do
            redis.call('HINCRBY', KEYS[f], ARGV[a + 1], 1)
        end
    end
end
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', tonumber(ARGV[1])) then
    return 1
end
return 0
