-- Take the cap slots of a claim's rows, in order, in one script run (not a script call per
-- slot). KEYS[1] the "semaphores are complete" sentinel, KEYS[2] the
-- family's "rows wait for a slot" flag, KEYS[3..] each slot's semaphore (a sorted set: holder
-- token -> lease end, ms; an actor's may repeat). ARGV: lease ms, 1 when the claim sets rows
-- waiting anyway (its plan had more of an actor's rows than its cap) else 0, then token and
-- cap per slot. Expired holders are dropped first.
-- A claim's lease end is written half a millisecond late: a score ending in .5 marks a slot
-- no heartbeat has renewed since its claim (renewals write whole ms; a rebuild writes .5 too),
-- which is what caps_release.lua (unrenewed) may give back once its row's lease ran out.
-- The flag is set, for two leases, here and not by a later call: a slot refused now may be
-- released by its holder right after, and that release must see the flag to note the freed
-- slot and wake the claimer (caps_release.lua). A waiting row comes due by itself after one
-- lease, so a flag that expires strands nothing.
-- Returns a list: per slot 1 granted (or renewed: the token already holds it), 0 at cap; or
-- the one-element list {-1} when the sentinel is missing (Redis lost its data): the caller
-- must rebuild before claiming.
if redis.call('EXISTS', KEYS[1]) == 0 then
    return {-1}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local waiting = ARGV[2] == '1'
local claimed = now + lease + 0.5
local granted = {}
local swept = {}
for i = 3, #KEYS do
    local key, token, cap = KEYS[i], ARGV[2 * i - 3], tonumber(ARGV[2 * i - 2])
    if not swept[key] then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        swept[key] = true
    end
    if redis.call('ZSCORE', key, token) then
        redis.call('ZADD', key, claimed, token)
        granted[i - 2] = 1
    elseif redis.call('ZCARD', key) < cap then
        redis.call('ZADD', key, claimed, token)
        if redis.call('PTTL', key) < lease * 2 then
            redis.call('PEXPIRE', key, lease * 2)
        end
        granted[i - 2] = 1
    else
        granted[i - 2] = 0
        waiting = true
    end
end
if waiting then
    redis.call('SET', KEYS[2], '1', 'PX', lease * 2)
end
return granted
