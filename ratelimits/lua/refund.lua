-- refund.lua: give back what one slot group of a Redis Cluster decision consumed, when another
-- group of the same request denied it (all or nothing across slots; ratelimits/backends/cluster.py).
--
-- A refund never creates a token that was not consumed: it gives back only the part of the
-- request's own consumption that the state still holds. What has refilled since (a bucket's
-- time passing, a window that ended) is not given back twice, whatever other requests did
-- meanwhile. The price is a brief under-admission, never an over-admission.
--
-- KEYS[1..n]       state keys of the checks the group admitted
-- KEYS[n + 1]      with ARGV[3]: the usage hash the group counted the request in
-- ARGV[1]          packed little-endian: now ('<d', negative: read Redis TIME), then per check
--                  CHECK below
-- ARGV[2]          the request's slot id, or ""
-- ARGV[3]          the usage row the group counted the request in, or "" (nothing to correct)
-- ARGV[4]          the metric it counted: a (allowed), l (limited) or s (shed)
-- ARGV[5]          the metric the request is counted under instead, or "" (it is counted elsewhere:
--                  the engine decides the request again, or without the store)
-- ARGV[6]          the tokens it was counted as spending
-- ARGV[7]          the overflow row (where the row was counted if the minute was full)
--
-- CHECK: algorithm code, limit, period (us), cost, consumed_at (the decide script's now, us), burst,
-- then what the decide call reported for it (REFUNDABLE in decide.lua): a token bucket's arrival
-- time after the request, and what the bucket had been given back until then; a billing period's
-- start (the window its count is in, named by it), and 0; a window's, 0 and 0.
--
-- A state written in other terms than the check's (its policy changed since the request; the
-- decide script converted it) is given nothing back: the request's spend was in the old terms.
--
-- Why a token bucket's refund is safe: the bucket's debt is a queue of spent intervals, each
-- request's stacked on the one before. Time pays the queue off from its front. A refund takes out
-- the request's own interval, but only what time has not yet paid of it: what lies after now.
-- The request's interval ended at spent_tat, unless refunds of requests before it have moved it
-- earlier since; that is at most everything given back to this bucket since the request, which
-- the bucket keeps count of (the us given back, stored with its arrival time). So the request's
-- debt still outstanding is at least min(spent, spent_tat - given back since - now), and no more
-- is given back. Later requests' debts, stacked after it, move earlier by what was given back:
-- exactly as if the request had spent only what time had already paid of it.
--
-- Two limits to that, both bounded. A state deleted between the decide call and its refund (an
-- admin's reset; one round trip apart) is not always told apart from one the request still holds:
-- a bucket given back less than when the request was made was reset, and is owed nothing, but a
-- bucket never given back to, or a window, may have the request's spend taken off what was spent
-- since the reset; a reset gives every token back anyway. And with the app's clock (REDIS['CLOCK'] "app")
-- a refund measures what time has paid by its own worker's clock: the workers' clocks must agree.
--
-- Returns how many checks gave something back.

local TOKEN_BUCKET, SLIDING_WINDOW, FIXED_WINDOW = 1, 2, 3
-- A global policy's bucket state (GLOBAL_STATE in lua/decide.lua): tokens, time, share, rate, burst.
local GLOBAL_STATE, GLOBAL_SIZE = '<ddddd', 40
local NOW, CHECK = '<d', '<Bddddddd'
-- As decide.lua's: the layouts with their terms, and the windows' previous ones, read in the check's terms.
local GCRA_STATE, SLIDING_STATE, FIXED_STATE = '<dd', '<ddddd', '<dddd'
local REFUNDED_STATE, REFUNDED_MARK = '<dddB', 255
local OLD_SLIDING, OLD_FIXED = '<ddd', '<dd'
local unpack_args, pack = struct.unpack, struct.pack
local floor, max, min = math.floor, math.max, math.min

local now, pos = unpack_args(NOW, ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The window that held time t (as decide.lua's split, for any instant).
local function window_of(t, period)
  local window = floor(t / period)
  local elapsed = t - window * period
  if elapsed < 0 then window = window - 1 elseif elapsed >= period then window = window + 1 end
  return window
end

local given = 0
local n = #KEYS
if ARGV[3] ~= '' then n = n - 1 end
for i = 1, n do
  local key = KEYS[i]
  local algorithm, limit, period, cost, consumed_at, burst, spent_tat, given_back
  algorithm, limit, period, cost, consumed_at, burst, spent_tat, given_back, pos = unpack_args(CHECK, ARGV[1], pos)
  if algorithm > FIXED_WINDOW then
    given = given + redis.call('ZREM', key, ARGV[2])
  else
    local value = redis.call('GET', key)
    if value then
      if algorithm == TOKEN_BUCKET and #value == GLOBAL_SIZE then
        -- A global policy's bucket holds tokens (lua/decide.lua): the request's cost goes back, as
        -- of the state's own time, capped at the burst of the share it was spent at. The next
        -- decision refills from there as it would have: nothing that time paid is given twice.
        local held, at, spent_share, full, burst = unpack_args(GLOBAL_STATE, value)
        local back = math.min(held + cost, burst * spent_share)
        if back > held then
          redis.call('SET', key, pack(GLOBAL_STATE, back, at, spent_share, full, burst), 'KEEPTTL')
          given = given + 1
        end
      elseif algorithm == TOKEN_BUCKET then
        local capacity = burst * (period / limit)  -- as decide.lua computes it
        local tat, written, refunded
        if #value == 25 then
          tat, written, refunded = unpack_args(REFUNDED_STATE, value)
        else
          tat, written = unpack_args(GCRA_STATE, value)
          refunded = 0
        end
        local outstanding = min(cost * period / limit, spent_tat - (refunded - given_back) - now)
        if written == capacity and outstanding > 0 and tat > now and refunded >= given_back then
          local new_tat = max(tat - outstanding, now)
          local state = pack(REFUNDED_STATE, new_tat, capacity, refunded + (tat - new_tat), REFUNDED_MARK)
          redis.call('SET', key, state, 'KEEPTTL')
          given = given + 1
        end
      else
        local consumed = window_of(consumed_at, period)
        -- A billing period's window is named by its start, which the decide call reported.
        if algorithm == FIXED_WINDOW and spent_tat > 0 then consumed = spent_tat end
        if algorithm == SLIDING_WINDOW then
          local w, current, previous, written_limit, written_period
          if #value == 24 then
            w, current, previous = unpack_args(OLD_SLIDING, value)
          else
            w, current, previous, written_limit, written_period = unpack_args(SLIDING_STATE, value)
          end
          local terms = written_limit == nil or (written_limit == limit and written_period == period)
          -- The request's count is in the window it was made in, now current or previous.
          if terms and w == consumed then
            redis.call('SET', key, pack(SLIDING_STATE, w, max(current - cost, 0), previous, limit, period), 'KEEPTTL')
            given = given + 1
          elseif terms and w == consumed + 1 then
            redis.call('SET', key, pack(SLIDING_STATE, w, current, max(previous - cost, 0), limit, period), 'KEEPTTL')
            given = given + 1
          end
        else
          local w, count, written_limit, written_period
          if #value == 16 then
            w, count = unpack_args(OLD_FIXED, value)
          else
            w, count, written_limit, written_period = unpack_args(FIXED_STATE, value)
          end
          local terms = written_limit == nil or (written_limit == limit and written_period == period)
          if terms and w == consumed then
            redis.call('SET', key, pack(FIXED_STATE, w, max(count - cost, 0), limit, period), 'KEEPTTL')
            given = given + 1
          end
        end
      end
    end
  end
end

-- The group counted the request as its own checks decided it: count it as it ended. Only in a
-- hash that is still live and holds that count (a drain may have taken the minute meanwhile:
-- then it stays as it was).
local row = ARGV[3]
if row ~= '' then
  local counters = KEYS[#KEYS]
  if redis.call('HEXISTS', counters, row) == 0 then row = ARGV[7] end
  local counted, metric = ARGV[4], ARGV[5]
  if tonumber(redis.call('HGET', counters, row .. counted) or '0') > 0 then
    redis.call('HINCRBY', counters, row .. counted, -1)
    if metric ~= '' then redis.call('HINCRBY', counters, row .. metric, 1) end
    local tokens = tonumber(ARGV[6])
    if counted == 'a' and tokens ~= 1 then redis.call('HINCRBY', counters, row .. 'x', 1 - tokens) end
  end
end
return given
