-- Take the cap slots of a claim's rows, in order, in one script run (a run per slot cost the
-- claim a script call each). KEYS[1] the "semaphores are complete" sentinel, KEYS[2..] each
-- slot's semaphore (a sorted set: holder token -> lease end, ms; an actor's may repeat).
-- ARGV: lease ms, then token and cap per slot. Expired holders are dropped first.
-- A claim's lease end is written half a millisecond late: a score ending in .5 marks a slot
-- no heartbeat has renewed since its claim (renewals write whole ms; a rebuild writes .5 too),
-- which is what caps_release.lua (unrenewed) may give back once its row's lease ran out.
-- Returns a list: per slot 1 granted (or renewed: the token already holds it), 0 at cap; or
-- the one-element list {-1} when the sentinel is missing (Redis lost its data): the caller
-- must rebuild before claiming.
if redis.call('EXISTS', KEYS[1]) == 0 then
    return {-1}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local claimed = now + lease + 0.5
local granted = {}
local swept = {}
for i = 2, #KEYS do
    local key, token, cap = KEYS[i], ARGV[2 * i - 2], tonumber(ARGV[2 * i - 1])
    if not swept[key] then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        swept[key] = true
    end
    if redis.call('ZSCORE', key, token) then
        redis.call('ZADD', key, claimed, token)
        granted[i - 1] = 1
    elseif redis.call('ZCARD', key) < cap then
        redis.call('ZADD', key, claimed, token)
        if redis.call('PTTL', key) < lease * 2 then
            redis.call('PEXPIRE', key, lease * 2)
        end
        granted[i - 1] = 1
    else
        granted[i - 1] = 0
    end
end
return granted
