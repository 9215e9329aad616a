-- Give a slot back after its row settled. KEYS[1] the actor's semaphore, KEYS[2] the wake key,
-- KEYS[3..] the family's freed-slots hashes (actor -> slots freed since the last claim), one
-- per database: the cap is global, so the actor's waiting rows in any database may take it.
-- ARGV: token, actor, wake window ms. Returns 1 when the caller should wake the claimer (the
-- first release in each window), else 0.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    for i = 3, #KEYS do
        redis.call('HINCRBY', KEYS[i], ARGV[2], 1)
    end
end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', tonumber(ARGV[3])) then
    return 1
end
return 0
