-- renew.lua: extend the leases of slots a live worker still holds (its heartbeat).
--
-- KEYS[1..n]   sorted sets of slots (lua/decide.lua: concurrency per subject, the fleet)
-- ARGV[1]       now (us), or negative: read the Redis clock (TIME), as the decide script does
-- ARGV[2]       the lease (us): each slot now expires that long from now
-- ARGV[2 + i]   the slot id held under KEYS[i]
-- Returns how many slots were renewed.
--
-- Only a slot still in its set is renewed (XX): one that expired (its worker was stalled for
-- longer than the lease) or was released stays gone. The set's own TTL is lengthened to cover
-- the renewed slot, never shortened (GT: another slot of the set may outlive this one).
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local lease = tonumber(ARGV[2])
local ttl_ms = math.ceil(lease / 1000) + 1000  -- as a slot check's state TTL (Policy.state_ttl_ms)
local renewed = 0
for i = 1, #KEYS do
  local score = redis.call('ZSCORE', KEYS[i], ARGV[2 + i])
  if score and tonumber(score) > now then  -- expired, not yet purged: gone all the same
    redis.call('ZADD', KEYS[i], 'XX', now + lease, ARGV[2 + i])
    redis.call('PEXPIRE', KEYS[i], ttl_ms, 'GT')
    renewed = renewed + 1
  end
end
return renewed
