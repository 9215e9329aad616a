-- Give back the slot of a started attempt whose row's lease ran out, if no heartbeat renewed
-- it since its claim took it or a rebuild restored it (its score still ends in .5:
-- caps_acquire.lua, caps_restore.lua): its worker died before the first renewal, and the
-- slot would otherwise run on to the claim's lease. A slot a heartbeat renews stays (a worker
-- cut off from Postgres alone still runs its handler); one renewed once ends a heartbeat
-- timeout after that renewal, before its row's lease.
-- KEYS and ARGV as caps_release.lua; returns 1 when the caller should wake the claimer.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) % 1 ~= 0 and redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    for i = 3, #KEYS do
        redis.call('HINCRBY', KEYS[i], ARGV[2], 1)
    end
end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', tonumber(ARGV[3])) then
    return 1
end
return 0
