-- Give back slots of one family: rows whose handlers returned or that settled. KEYS[1] the
-- family's wake key, KEYS[2..n+1] its freed-slots hashes (actor -> slots freed since the last
-- claim), one per database: the cap is global, so the actor's waiting rows in any database
-- may take it; KEYS[n+2..] each slot's semaphore. ARGV: wake window ms, n, then token and
-- actor per slot. Several slots in one run: a process's held releases (caps_pipelined.py).
-- Returns 1 when the caller should wake the claimer (the first release in each window), else 0.
local n = tonumber(ARGV[2])
for i = n + 2, #KEYS do
    local a = 2 * (i - n) - 1
    if redis.call('ZREM', KEYS[i], ARGV[a]) == 1 then
        for f = 2, n + 1 do
            redis.call('HINCRBY', KEYS[f], ARGV[a + 1], 1)
        end
    end
end
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', tonumber(ARGV[1])) then
    return 1
end
return 0
