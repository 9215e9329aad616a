-- The claimer takes the freed-slot counts of a family at once. KEYS[1] the freed hash, KEYS[2]
-- the "semaphores are complete" sentinel. Returns the sentinel's value ('' when missing: the
-- acquire then asks for a rebuild), then actor, count pairs. The sentinel rides here so that a
-- claim's generation check (caps/semaphore.py) costs no round trip of its own.
local written_by = redis.call('GET', KEYS[2]) or ''
local counts = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
table.insert(counts, 1, written_by)
return counts
