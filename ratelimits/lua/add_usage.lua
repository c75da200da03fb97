-- add_usage.lua: add counts made without the store (degraded decisions) to the usage counters.
--
-- Counts as decide.lua does (ratelimits/counters.py, count(), is the same rule in Python): a
-- new row beyond the cap is counted in its overflow row instead, and a minute's first row sets
-- its hash's expiry. One call for every minute: all of the counts are added, or none.
--
-- KEYS[1..k]       the usage hash of each minute the counts are of
-- ARGV[1]          seconds an undrained usage hash lives (ratelimits/backends/layout.py)
-- ARGV[2]          the most rows a minute counts (USAGE['MAX_SUBJECTS'])
-- ARGV[3]          the call's deadline (us, Redis TIME; 0: none): its worker keeps counts it
--                  got no answer for and sends them again, so a call that runs after it adds
--                  nothing and answers the error LATE (ratelimits/backends/deadline.py)
-- ARGV[4 + 5(i-1)] count i: the index k of its minute's key, its row, its metric (one letter),
--                  the row's overflow row, the count
--
-- Returns how many of the counts went to an overflow row.

local deadline = tonumber(ARGV[3])
if deadline > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) > deadline then
    return redis.error_reply('LATE the call ran after its deadline; nothing was counted')
  end
end
local cap = tonumber(ARGV[2])
local overflowed = 0
for i = 4, #ARGV, 5 do
  local counters, row, metric, n = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 4])
  if redis.call('HINCRBY', counters, row .. metric, n) == n and redis.call('HSETNX', counters, row, 1) == 1 then
    local rows = redis.call('HINCRBY', counters, '#', 1)
    if rows == 1 then redis.call('EXPIRE', counters, ARGV[1]) end
    if rows > cap then
      redis.call('HDEL', counters, row .. metric, row)
      redis.call('HINCRBY', counters, ARGV[i + 3] .. metric, n)
      overflowed = overflowed + 1
    end
  end
end
return overflowed
