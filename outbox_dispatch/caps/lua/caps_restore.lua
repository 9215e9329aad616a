-- Rebuild: put back a holder whose lease is still live in Postgres. KEYS[1] semaphore.
-- ARGV: token, remaining lease ms. Written half a millisecond late, as a claim's is
-- (caps_acquire.lua): no heartbeat has renewed the slot since.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local remaining = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + remaining + 0.5, ARGV[1])
if redis.call('PTTL', KEYS[1]) < remaining * 2 then
    redis.call('PEXPIRE', KEYS[1], remaining * 2 + 1000)
end
return 1
