-- decide.lua: evaluate every check of one request atomically; consume only if all allow.
--
-- Mirrors ratelimits/algorithms.py operation for operation, so both agree to the microsecond.
--
-- KEYS[1]          policy version stamp (read only; returned so workers notice policy changes)
-- KEYS[1 + i]      state key of check i, for i = 1..n
-- ARGV[1]          now in integer microseconds, or "" to read the Redis server clock (TIME)
-- ARGV[2]          "1" to consume when every check allows, "0" to only report (peek)
-- ARGV[3]          this request's slot id (for checks of the slot algorithms), or ""
-- ARGV[4]          the request's usage row, or "" not to count it; then the last key is this
--                  minute's usage hash, which gains <row>a (allowed), <row>l (limited, 429),
--                  <row>s (shed, 503) and <row>x (tokens spent beyond one per allowed request).
--                  A row's first field also sets the field <row> and adds one to the field "#"
--                  (the minute's rows); a row beyond the cap is counted in the overflow row
--                  instead (ratelimits/counters.py, count(), is the same rule in Python)
-- ARGV[5]          the tokens this request spends (its endpoint's cost), for the usage count
-- ARGV[6]          seconds an undrained usage hash lives (ratelimits/backends/layout.py)
-- ARGV[7]          the overflow row of the request's caller kind and endpoint
-- ARGV[8]          the most rows a minute counts (USAGE_MAX_SUBJECTS)
-- ARGV[9 + 7(i-1)] check i: algorithm (one of the codes below), limit (requests per period;
--                  slots), period (microseconds; a slot's TTL), burst (GCRA capacity in requests;
--                  ignored by the others), state TTL (milliseconds, passed through to PX as
--                  given: converting numbers to strings is the costliest thing a script does),
--                  shadow ("1": reported but never denies), cost (tokens this request spends)
--
-- State values (plain strings, every key written with a PX TTL):
--   GCRA           "<theoretical arrival time, us, as an exact %.17g double>"
--   sliding window "<window index>:<current count>:<previous count>"
--   fixed window   "<window index>:<count>"
--   slots          a sorted set of slot ids scored by their expiry (us); expired ones are purged
--                  before counting, so a worker killed while holding slots loses them on its own
--
-- Returns {now_us, version or false, all enforced checks allowed (0/1),
--          then per check: allowed (0/1, or 2: failed, see phase 1), remaining, reset_us, retry_us}.

-- The algorithm codes of ratelimits.algorithms.Algorithm (a test holds the two to the same numbers).
local TOKEN_BUCKET, SLIDING_WINDOW, FIXED_WINDOW = 1, 2, 3
-- Slots in flight per subject (429 when full), and in the fleet's in-flight set (503 when full):
-- the codes after the rate algorithms'.
local CONCURRENCY, FLEET = 4, 5
-- How soon a caller denied a slot should retry (ratelimits.algorithms.SLOT_RETRY_US).
local SLOT_RETRY_US = 1000000
-- How many ARGV come before the first check's, and how many each check has.
local HEADER, PER_CHECK = 8, 7

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local consume = ARGV[2] == '1'
local usage = ARGV[4]
local n = #KEYS - 1
if usage ~= '' then n = n - 1 end
local floor, ceil, max = math.floor, math.ceil, math.max

-- Window index and offset without trusting float division near a boundary.
local function split(period)
  local window = floor(now / period)
  local elapsed = now - window * period
  if elapsed < 0 then
    window = window - 1
    elapsed = elapsed + period
  elseif elapsed >= period then
    window = window + 1
    elapsed = elapsed - period
  end
  return window, elapsed
end

local function estimate(previous, current, elapsed, period)
  return previous * (period - elapsed) / period + current
end

local function fits_after(previous, current, elapsed, period, limit, cost, wait)
  local at = elapsed + wait
  if at < period then
    return estimate(previous, current, at, period) + cost <= limit
  end
  at = at - period
  local prior = 0
  if at < period then prior = current end
  return estimate(prior, 0, at % period, period) + cost <= limit
end

local function sliding_retry(previous, current, elapsed, period, limit, cost)
  local until_next = period - elapsed
  local room = limit - current - cost
  local wait
  if room >= 0 and previous > 0 then
    wait = until_next - room * period / previous
  else
    local refill = 0
    if current > 0 then refill = period - (limit - cost) * period / current end
    wait = until_next + max(refill, 0)
  end
  local wait_us = max(ceil(wait), 1)
  while not fits_after(previous, current, elapsed, period, limit, cost, wait_us) do
    wait_us = wait_us + 1
  end
  return wait_us
end

-- Each returns allowed, remaining, reset_us, retry_us, new_value.
local function token_bucket(value, limit, period, burst, cost)
  local interval = period / limit
  local capacity = burst * interval
  local tat = tonumber(value)
  if tat == nil or tat <= now then tat = now end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - capacity
  if now < allow_at then
    local remaining = max(floor((now + capacity - tat) / interval), 0)
    return false, remaining, ceil(tat - now), ceil(allow_at - now), nil
  end
  local remaining = max(floor((now + capacity - new_tat) / interval), 0)
  -- %.17g round-trips a double exactly; Redis would otherwise format it with %.14g.
  return true, remaining, ceil(new_tat - now), 0, string.format('%.17g', new_tat)
end

local function sliding_window(value, limit, period, burst, cost)
  local window, elapsed = split(period)
  local current, previous = 0, 0
  if value then
    local w, c, p = string.match(value, '^(%-?%d+):(%d+):(%d+)$')
    w, c, p = tonumber(w), tonumber(c), tonumber(p)
    if w == window then
      current, previous = c, p
    elseif w == window - 1 then
      previous = c
    end
  end
  local est = estimate(previous, current, elapsed, period)
  local until_next = period - elapsed
  if est + cost <= limit then
    local value_out = string.format('%d:%d:%d', window, current + cost, previous)
    return true, max(floor(limit - est - cost), 0), until_next + period, 0, value_out
  end
  local reset = 0
  if current > 0 then
    reset = until_next + period
  elseif previous > 0 then
    reset = until_next
  end
  local retry = sliding_retry(previous, current, elapsed, period, limit, cost)
  return false, max(floor(limit - est), 0), reset, retry, nil
end

local function fixed_window(value, limit, period, burst, cost)
  local window, elapsed = split(period)
  local until_next = period - elapsed
  local count = 0
  if value then
    local w, c = string.match(value, '^(%-?%d+):(%d+)$')
    if tonumber(w) == window then count = tonumber(c) end
  end
  if count + cost <= limit then
    return true, limit - count - cost, until_next, 0, string.format('%d:%d', window, count + cost)
  end
  return false, max(limit - count, 0), until_next, until_next, nil
end

-- Slots are counted live (a sorted set, not a string), so they take the key, not its value.
-- Purging expired slots is a write even when the request is denied: it removes only what
-- no request holds any more.
local function slots(key, limit, ttl, cost)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local count = redis.call('ZCARD', key)
  if count + cost <= limit then
    return true, limit - count - cost, ttl, 0, nil
  end
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local earliest = now + ttl
  if first[2] then earliest = tonumber(first[2]) end
  return false, max(limit - count, 0), earliest - now, math.min(earliest - now, SLOT_RETRY_US), nil
end

-- Indexed by code, so in code order: TOKEN_BUCKET, SLIDING_WINDOW, FIXED_WINDOW (a table constructor
-- with keys would put them in the table's slower hash part).
local algorithms = {token_bucket, sliding_window, fixed_window}

-- Errors a check's own state or arguments cause (a key of another type, a value out of range),
-- as opposed to the store's trouble (READONLY, OOM, BUSY, ...), which fails the whole call.
local function check_error(err)
  local code = string.match(err or '', '^(%u+)')
  return code == 'WRONGTYPE' or code == 'ERR'
end

-- Phase 1: decide every check against current state. A key named twice sees the pending
-- value of its earlier check, so duplicates cannot double-spend.
-- One MGET reads the version stamp and every state: each redis.call costs more than the Lua
-- around it. The reply is filled in place: {now, version, all allowed, per-check quadruples}.
local stored = redis.call('MGET', unpack(KEYS))
local reply = {now, stored[1], 1}
local pending = {}
local write_keys, write_values, write_ttls, write_slots, writes = {}, {}, {}, {}, 0
local all_allowed = true
local limited = false
local failed = false
local out = 3
for i = 1, n do
  local key = KEYS[i + 1]
  local base = HEADER + 1 + PER_CHECK * (i - 1)
  local algorithm = tonumber(ARGV[base])
  local holds_slot = algorithm >= CONCURRENCY  -- CONCURRENCY and FLEET, the codes after the rate algorithms
  local ok, allowed, remaining, reset, retry, new_value
  if holds_slot then
    ok, allowed, remaining, reset, retry = pcall(
      slots, key, tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 6]))
  else
    local value = pending[key]
    if value == nil then value = stored[i + 1] end
    ok, allowed, remaining, reset, retry, new_value = pcall(algorithms[algorithm],
      value, tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 6]))
  end
  if not ok then
    -- This check cannot be decided: its key holds another type, or its arguments are out of range.
    -- (The store's own errors, READONLY, OOM and the like, fail the whole call as ever.) The check
    -- is reported as failed (allowed = 2) and the request denied without consuming anything: the
    -- engine decides it again without that check, by the check's fail mode; other subjects go on.
    if type(allowed) == 'table' and not check_error(allowed.err) then return allowed end
    all_allowed, failed = false, true
    reply[out + 1], remaining, reset, retry = 2, 0, 0, 0
  elseif allowed then
    pending[key] = new_value
    writes = writes + 1
    write_keys[writes], write_values[writes], write_ttls[writes] = key, new_value, ARGV[base + 4]
    if holds_slot then write_slots[writes] = now + tonumber(ARGV[base + 2]) end
    reply[out + 1] = 1
  else
    -- A shadow check reports what it would do; only enforced checks can deny the request.
    if ARGV[base + 5] ~= '1' then
      all_allowed = false
      -- Denied only by the fleet is shed (503); by anything else, limited (429).
      if algorithm ~= FLEET then limited = true end
    end
    reply[out + 1] = 0
  end
  reply[out + 2], reply[out + 3], reply[out + 4] = remaining, reset, retry
  out = out + 4
end

-- Phase 2: all or nothing.
if all_allowed then
  if consume then
    for i = 1, writes do
      if write_slots[i] then
        redis.call('ZADD', write_keys[i], write_slots[i], ARGV[3])
        redis.call('PEXPIRE', write_keys[i], write_ttls[i])
      else
        redis.call('SET', write_keys[i], write_values[i], 'PX', write_ttls[i])
      end
    end
  end
else
  reply[3] = 0
end

-- Usage counters for the roll-up, in this same round trip. One call in the common case (a row
-- already counted this minute); tokens beyond one per request are counted only for costlier
-- endpoints. Only a field's first increment does more: the hash's expiry (if nothing drains it),
-- and, for a new row, the cap on the minute's rows.
-- A failed check's request is decided again without it, and counted then.
if consume and usage ~= '' and not failed then
  local counters = KEYS[#KEYS]
  local metric = 's'
  if all_allowed then
    metric = 'a'
  elseif limited then
    metric = 'l'
  end
  if redis.call('HINCRBY', counters, usage .. metric, 1) == 1 then
    redis.call('EXPIRE', counters, ARGV[6])
    if redis.call('HSETNX', counters, usage, 1) == 1 and redis.call('HINCRBY', counters, '#', 1) > tonumber(ARGV[8]) then
      redis.call('HDEL', counters, usage .. metric, usage)
      usage = ARGV[7]
      redis.call('HINCRBY', counters, usage .. metric, 1)
    end
  end
  if all_allowed and ARGV[5] ~= '1' then redis.call('HINCRBY', counters, usage .. 'x', tonumber(ARGV[5]) - 1) end
end
return reply
