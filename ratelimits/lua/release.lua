-- release.lua: give back one request's slots. Idempotent: releasing twice, releasing an
-- unknown id or releasing after expiry changes nothing, and a count can never go below zero
-- (it is the size of a set).
--
-- KEYS[1..n]  the sorted sets holding the request's slot (concurrency per subject, the fleet)
-- ARGV[1]     the slot id
-- Returns how many slots were actually released.
local released = 0
for i = 1, #KEYS do
  released = released + redis.call('ZREM', KEYS[i], ARGV[1])
end
return released
