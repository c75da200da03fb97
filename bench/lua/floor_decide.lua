-- floor_decide.lua: only the reads and writes a decision of n checks needs, none of its arithmetic.
--
-- The bench's floor for decide.lua: called with the very KEYS and ARGV a decision sends
-- (ratelimits/lua/decide.lua says what each is), it reads the clock and every state, writes
-- every state back with its TTL and counts the request once in its usage row, as an admitted
-- decision does. What decide.lua costs beyond this is its own Lua.
--
-- KEYS[1]          policy version stamp; KEYS[1 + i] check i's state; KEYS[n + 2] the usage hash
-- ARGV[1]          the packed request (its first 8 bytes, twice, are written as every state: 16
--                  bytes, as a token bucket's, read back as a past arrival time)
-- ARGV[2]          the usage row; check i's state TTL (ms) is its record's last number
--
-- Returns {now, version}.
local t = redis.call('TIME')
local n = #KEYS - 2
local stored = redis.call('MGET', unpack(KEYS, 1, n + 1))
local value = string.rep(string.sub(ARGV[1], 1, 8), 2)
-- The TTLs, as decide.lua reads them: the header (REQUEST), then per check a record (CHECK).
local pos = select(9, struct.unpack('<dBdddddd', ARGV[1]))
for i = 1, n do
  local _, ttl
  _, _, _, _, _, _, ttl, pos = struct.unpack('<BBddddd', ARGV[1], pos)
  redis.call('SET', KEYS[i + 1], value, 'PX', ttl)
end
redis.call('HINCRBY', KEYS[#KEYS], ARGV[2] .. 'a', 1)
return {tonumber(t[1]), stored[1]}
