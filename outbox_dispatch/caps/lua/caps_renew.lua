-- Extend a held slot (ZADD XX: a lapsed or unknown holder is not re-added).
-- KEYS[1] semaphore, KEYS[2] sentinel. ARGV: token, lease ms.
-- Returns 1 renewed, 0 the slot is gone although the semaphores are complete (lapsed: another
-- row may hold it now), -1 the sentinel is missing (a rebuild will restore live holders).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
    if redis.call('PTTL', KEYS[1]) < lease * 2 then
        redis.call('PEXPIRE', KEYS[1], lease * 2)
    end
    return 1
end
if redis.call('EXISTS', KEYS[2]) == 0 then
    return -1
end
return 0
