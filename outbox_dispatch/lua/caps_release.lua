-- Give a slot back after its row settled. KEYS[1] the actor's semaphore, KEYS[2] the family's
-- freed-slots hash (actor -> slots freed since the last claim), KEYS[3] the wake key.
-- ARGV: token, actor, wake window ms. Returns 1 when the caller should wake the claimer (the
-- first release in each window), else 0.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
end
if redis.call('SET', KEYS[3], '1', 'NX', 'PX', tonumber(ARGV[3])) then
    return 1
end
return 0
