-- The claimer takes the freed-slot counts of a family at once. KEYS[1] the freed hash.
local counts = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return counts
