-- refund.lua: give back what one slot group of a Redis Cluster decision consumed, when another
-- group of the same request denied it (all or nothing across slots; ratelimits/backends/cluster.py);
-- a lease's unused tokens; and, after a response, what its endpoint does not count, or the part
-- of its cost the view trued down. With a negative cost, it charges instead: a true-up beyond the
-- cost the request was admitted at (ratelimits/engine/settling.py).
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
-- ARGV[8]          a settlement's: the tokens the row gains (negative: loses), its counts as they
--                  are (ARGV[4] "a", ARGV[5] ""); never below none for the row
--
-- CHECK: algorithm code, limit, period (us), cost (the tokens to give back; negative: to charge),
-- consumed_at (the decide script's now, us), burst,
-- then what the decide call reported for it (REFUNDABLE in decide.lua): a token bucket's arrival
-- time after the request, and what the bucket had been given back until then; a billing period's
-- start (the window its count is in, named by it), and 0; a window's, 0 and 0.
--
-- A state written in other terms than the check's (its policy changed since the request; the
-- decide script converted it) is given nothing back: the request's spend was in the old terms.
--
-- Why a token bucket's refund is exact: the bucket's debt is a queue of spent intervals, each
-- request's stacked on the one before. Time pays the queue off from its front. A refund takes out
-- the request's own interval, but only what time has not yet paid of it. Seen in coordinates that
-- refunds never shift (the arrival time plus every us given back so far, which the bucket keeps
-- with its arrival time), each interval stays where it was put: the request's ends at spent_tat
-- plus what had been given back when it was made. A refund leaves a hole there; time skips holes.
-- How far time has paid is where the unpaid intervals beyond it, holes left out, add up to the
-- arrival time less now: the bucket keeps the holes time has not reached yet (frontier() below).
-- What lies of the request's interval beyond that point is what it still owes, and exactly that
-- is given back, whichever other refunds came first: later requests' debts move earlier by it,
-- as if the request had spent only what time had already paid of it. (Keeping no holes, a refund
-- would have to take every refund since as one before it, and give back too little.)
--
-- Two limits to that, both bounded. A state deleted between the decide call and its refund (an
-- admin's reset; one round trip apart) is not always told apart from one the request still holds:
-- a bucket given back less than when the request was made was reset, and is owed nothing, but a
-- bucket never given back to, or a window, may have the request's spend taken off what was spent
-- since the reset; a reset gives every token back anyway. And with the app's clock (REDIS['CLOCK'] "app")
-- a refund measures what time has paid by its own worker's clock: the workers' clocks must agree.
--
-- A charge (a negative cost) is made whether or not the limit has room: the view has run. A token
-- bucket's arrival time moves later by it (from now, if the bucket had refilled; a bucket never
-- written, or expired, is a full one), its key living until that time has passed: a debt its
-- next requests wait for. A window's count grows in the window the request was made in, while
-- that window still counts (as current or, sliding, as previous), else in the window now (a
-- billing period's only while its state is of that period or a later one); a global bucket's tokens fall,
-- below none if need be, while its state lives (decide.lua reports no arrival time for one, which
-- tells a global bucket gone from a token bucket's). A slot is never charged. A state in other
-- terms is charged nothing.
--
-- Returns how many checks gave something back (or were charged).

local TOKEN_BUCKET, SLIDING_WINDOW, FIXED_WINDOW = 1, 2, 3
-- A global policy's bucket state (GLOBAL_STATE in lua/decide.lua): tokens, time, share, rate, burst.
local GLOBAL_STATE, GLOBAL_SIZE = '<ddddd', 40
local NOW, CHECK = '<d', '<Bddddddd'
-- As decide.lua's: the layouts with their terms, and the windows' previous ones, read in the check's terms.
local GCRA_STATE, SLIDING_STATE, FIXED_STATE = '<dd', '<ddddd', '<dddd'
local REFUNDED_STATE, REFUNDED_MARK, REFUNDED_SIZE = '<dddB', 255, 25
-- A bucket's holes, after its REFUNDED_STATE: per refund time has not reached yet, its end and
-- length in the queue's coordinates (ratelimits/algorithms.py, frontier), highest first, holes
-- that touch made one; at most MAX_HOLES (the lowest dropped: taken as reached, which gives back
-- less, never more).
local HOLE, HOLE_SIZE, MAX_HOLES = '<dd', 16, 64
local OLD_SLIDING, OLD_FIXED = '<ddd', '<dd'
local unpack_args, pack = struct.unpack, struct.pack
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min

local now, pos = unpack_args(NOW, ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- A token bucket's value read: arrival time, capacity, us given back so far, and its holes (a list
-- of {end, length}, highest first). A value of a layout without them (GCRA_STATE, and decide.lua's
-- TIMED_STATE, whose first 16 bytes are it) has none.
local function read_bucket(value)
  if #value % HOLE_SIZE ~= REFUNDED_SIZE % HOLE_SIZE then
    local tat, written = unpack_args(GCRA_STATE, value)
    return tat, written, 0, {}
  end
  local tat, written, refunded, _, at = unpack_args(REFUNDED_STATE, value)
  local holes = {}
  while at + HOLE_SIZE - 1 <= #value do
    local hole_end, length
    hole_end, length, at = unpack_args(HOLE, value, at)
    holes[#holes + 1] = {hole_end, length}
  end
  return tat, written, refunded, holes
end

local function bucket_value(tat, capacity, refunded, holes)
  if refunded <= 0 then return pack(GCRA_STATE, tat, capacity) end
  local parts = {pack(REFUNDED_STATE, tat, capacity, refunded, REFUNDED_MARK)}
  for i = 1, min(#holes, MAX_HOLES) do parts[i + 1] = pack(HOLE, holes[i][1], holes[i][2]) end
  return table.concat(parts)
end

-- How far time has paid a bucket's queue (its coordinates: arrival time plus every us given back,
-- which refunds never shift), and the holes beyond that point (the list cut there): where the
-- unpaid intervals beyond it, holes left out, add up to `unpaid`. algorithms.py's frontier().
local function frontier(queue_end, unpaid, holes)
  local at, left = queue_end, unpaid
  for i = 1, #holes do
    local gap = max(at - holes[i][1], 0)
    if gap >= left then
      for j = #holes, i, -1 do holes[j] = nil end
      return at - left, holes
    end
    left = left - gap
    at = holes[i][1] - holes[i][2]
  end
  return at - left, holes
end

-- The holes with one more, in its place, holes that touch (within a microsecond) made one:
-- algorithms.py's with_hole().
local function with_hole(holes, hole_end, length)
  holes[#holes + 1] = {hole_end, length}
  table.sort(holes, function(x, y) return x[1] > y[1] end)
  local merged = {}
  for i = 1, #holes do
    local above = merged[#merged]
    if above and above[1] - above[2] - holes[i][1] < 1 then
      above[2] = above[1] - min(above[1] - above[2], holes[i][1] - holes[i][2])
    else
      merged[#merged + 1] = {holes[i][1], holes[i][2]}
    end
  end
  return merged
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
    if cost >= 0 then given = given + redis.call('ZREM', key, ARGV[2]) end
  elseif algorithm == TOKEN_BUCKET and cost < 0 then
    local value = redis.call('GET', key)
    local interval = period / limit
    local capacity = burst * interval
    if value and #value == GLOBAL_SIZE then
      local held, at, spent_share, full, written_burst = unpack_args(GLOBAL_STATE, value)
      redis.call('SET', key, pack(GLOBAL_STATE, held + cost, at, spent_share, full, written_burst), 'KEEPTTL')
      given = given + 1
    elseif value or spent_tat > 0 then  -- none, and no arrival time reported: a global bucket's, gone
      local tat, written, refunded, holes = now, capacity, 0, {}
      if value then tat, written, refunded, holes = read_bucket(value) end
      if written == capacity then
        if tat <= now then holes = {} end  -- the bucket was full: every refund reached
        local new_tat = max(tat, now) - cost * interval
        -- Kept until the debt is paid, and a second more (decide.lua's slack).
        local ttl = string.format('%d', ceil((new_tat - now) / 1000) + 1000)
        redis.call('SET', key, bucket_value(new_tat, capacity, refunded, holes), 'PX', ttl)
        given = given + 1
      end
    end
  elseif cost < 0 then
    -- A window's charge: in the window the request was made in while it counts, else in the
    -- window now (algorithms.py, _window_charged), kept while that window counts.
    local value = redis.call('GET', key)
    local w, count, previous, terms = nil, 0, 0, true
    if value and algorithm == SLIDING_WINDOW then
      local written_limit, written_period
      if #value == 24 then
        w, count, previous = unpack_args(OLD_SLIDING, value)
      else
        w, count, previous, written_limit, written_period = unpack_args(SLIDING_STATE, value)
      end
      terms = written_limit == nil or (written_limit == limit and written_period == period)
    elseif value then
      local written_limit, written_period
      if #value == 16 then
        w, count = unpack_args(OLD_FIXED, value)
      else
        w, count, written_limit, written_period = unpack_args(FIXED_STATE, value)
      end
      terms = written_limit == nil or (written_limit == limit and written_period == period)
    end
    local charge = -cost
    local consumed = window_of(consumed_at, period)
    local now_window = window_of(now, period)
    local state, ends
    if terms and algorithm == SLIDING_WINDOW then
      local charged_window = now_window
      if now_window <= consumed + 1 then  -- the request's window still counts, current or previous
        if w == consumed then
          charged_window = w
          state = pack(SLIDING_STATE, w, count + charge, previous, limit, period)
        elseif w == consumed + 1 then
          charged_window = w
          state = pack(SLIDING_STATE, w, count, previous + charge, limit, period)
        elseif now_window == consumed then  -- its state gone: made afresh
          state = pack(SLIDING_STATE, now_window, charge, 0, limit, period)
        else
          state = pack(SLIDING_STATE, now_window, 0, charge, limit, period)
        end
      elseif w == now_window then  -- over: the window now pays
        state = pack(SLIDING_STATE, w, count + charge, previous, limit, period)
      else
        local carried = 0
        if w == now_window - 1 then carried = count end
        state = pack(SLIDING_STATE, now_window, charge, carried, limit, period)
      end
      ends = (charged_window + 2) * period
    elseif terms and spent_tat > 0 then  -- a billing period's, named by its start: only while its state is
      if w and w >= spent_tat then state = pack(FIXED_STATE, w, count + charge, limit, period) end
    elseif terms then
      if w == now_window then
        state = pack(FIXED_STATE, w, count + charge, limit, period)
      else
        state = pack(FIXED_STATE, now_window, charge, limit, period)
      end
      ends = (now_window + 1) * period
    end
    if state and ends then
      redis.call('SET', key, state, 'PX', string.format('%d', ceil((ends - now) / 1000) + 1000))
      given = given + 1
    elseif state then
      redis.call('SET', key, state, 'KEEPTTL')
      given = given + 1
    end
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
        local tat, written, refunded, holes = read_bucket(value)
        if written == capacity and tat > now and refunded >= given_back then
          local reached
          reached, holes = frontier(tat + refunded, tat - now, holes)
          local spend_end = spent_tat + given_back  -- in the queue's coordinates
          local spend = cost * period / limit
          local outstanding = min(spend, spend_end - reached)
          -- Less than a microsecond paid is the rounding of doubles, not time (algorithms.py).
          if spend - outstanding < 1 then outstanding = spend end
          if outstanding > 0 then
            local new_tat = max(tat - outstanding, now)
            local cut = tat - new_tat
            holes = with_hole(holes, spend_end, cut)
            redis.call('SET', key, bucket_value(new_tat, capacity, refunded + cut, holes), 'KEEPTTL')
            given = given + 1
          end
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
  local settled = ARGV[8]
  if settled then
    -- A settlement: the request stays counted, at other tokens (a row's never below none: the
    -- count it is drained into cannot be negative).
    local allowed = tonumber(redis.call('HGET', counters, row .. 'a') or '0')
    if allowed > 0 then
      local extra = tonumber(redis.call('HGET', counters, row .. 'x') or '0')
      local change = max(tonumber(settled), -(allowed + extra))
      if change ~= 0 then redis.call('HINCRBY', counters, row .. 'x', change) end
    end
  elseif tonumber(redis.call('HGET', counters, row .. counted) or '0') > 0 then
    redis.call('HINCRBY', counters, row .. counted, -1)
    if metric ~= '' then redis.call('HINCRBY', counters, row .. metric, 1) end
    local tokens = tonumber(ARGV[6])
    if counted == 'a' and tokens ~= 1 then redis.call('HINCRBY', counters, row .. 'x', 1 - tokens) end
  end
end
return given
