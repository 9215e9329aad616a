-- Take a cap slot. KEYS[1] the actor's semaphore (sorted set: holder token -> lease end, ms),
-- KEYS[2] the "semaphores are complete" sentinel. ARGV: token, cap, lease ms.
-- Returns 1 granted (or renewed: the token already holds a slot), 0 at cap, -1 when the
-- sentinel is missing (Redis lost its data): the caller must rebuild before claiming.
if redis.call('EXISTS', KEYS[2]) == 0 then
    return -1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
    return 1
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
    if redis.call('PTTL', KEYS[1]) < lease * 2 then
        redis.call('PEXPIRE', KEYS[1], lease * 2)
    end
    return 1
end
return 0
