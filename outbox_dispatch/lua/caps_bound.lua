-- Before a batched message's rows start: make each held slot end within the heartbeat timeout
-- (the run lease its row gets when it starts), and never extend one. A row whose start is then
-- refused (its attempt started before, in a worker that died) keeps the end its own start
-- gave the slot, so the slot does not outlive the row's lease; a row that starts with too
-- little left renews its slot itself.
-- KEYS[1] semaphore, KEYS[2] sentinel. ARGV: token, lease ms.
-- Returns the ms the slot has left (> 0), 0 lapsed (gone although the semaphores are
-- complete: another row may hold it now), -1 the sentinel is missing (a rebuild will restore
-- live holders).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local bound = now + tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
    score = tonumber(score)
    if score > bound then
        redis.call('ZADD', KEYS[1], 'XX', bound, ARGV[1])
        score = bound
    end
    return score - now
end
if redis.call('EXISTS', KEYS[2]) == 0 then
    return -1
end
return 0
