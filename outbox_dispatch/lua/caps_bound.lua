-- Before a batched message's rows start: make each held slot end within the heartbeat timeout
-- (the run lease its row gets when it starts), and never extend one. A row whose start is then
-- refused (its attempt started before, in a worker that died) keeps the end its own start
-- gave the slot, so the slot does not outlive the row's lease; a row that starts with too
-- little left renews its slot itself. One script run for the message's slots.
-- KEYS[1] the sentinel, KEYS[2..] each slot's semaphore. ARGV: lease ms, then each slot's
-- token. Returns a list, per slot: the ms it has left (> 0), 0 lapsed (gone although the
-- semaphores are complete: another row may hold it now), -1 the sentinel is missing (a
-- rebuild will restore live holders).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local bound = now + tonumber(ARGV[1])
local complete = nil
local left = {}
for i = 2, #KEYS do
    local key, token = KEYS[i], ARGV[i]
    local score = redis.call('ZSCORE', key, token)
    if score and tonumber(score) > now then
        score = tonumber(score)
        if score > bound then
            redis.call('ZADD', key, 'XX', bound, token)
            score = bound
        end
        left[i - 1] = score - now
    else
        if complete == nil then
            complete = redis.call('EXISTS', KEYS[1]) == 1
        end
        left[i - 1] = complete and 0 or -1
    end
end
return left
