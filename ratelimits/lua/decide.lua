-- decide.lua: evaluate every check of one request atomically; consume only if all allow.
--
-- Mirrors ratelimits/algorithms.py operation for operation, so both agree to the microsecond.
--
-- This file defines decide(KEYS, ARGV) last and stops there; ratelimits/backends/redis.py
-- (Script) makes it two things: a Redis Function's library (FUNCTION LOAD, then FCALL: what is
-- above decide() is made once per library), and a script whose chunk runs decide's body (EVAL:
-- everything made on every call), for a store without Functions (before Redis 7, an ACL without
-- them) and for a cluster's slot groups.
--
-- KEYS[1]          policy version stamp (read only; returned so workers notice policy changes)
-- KEYS[1 + i]      state key of check i, for i = 1..n
-- KEYS[n + 1 + j]  with g global checks (the request's header says how many): the share record of
--                  the j-th (ratelimits/shares.py), read in the same MGET as the states
-- KEYS[n + g + 2]  with global checks: this second's demand hash, which gains each global check's
--                  cost under its state key, admitted or not (what the reconciler reads), and once
--                  a second under <state key>#p the policy's rate, burst and state TTL
-- last             with a usage row (ARGV[2]): this minute's usage hash, which gains <row>a
--                  (allowed), <row>l (limited, 429), <row>s (shed, 503) and <row>x (tokens spent
--                  beyond one per allowed request). A row's first field also sets the field <row>
--                  and adds one to the field "#" (the minute's rows); a row beyond the cap is
--                  counted in the overflow row instead (ratelimits/counters.py, count(), is the
--                  same rule in Python). The minute's first row sets the hash's expiry.
-- ARGV[1]          the request, packed little-endian (ratelimits/backends/codec.py builds it):
--                  a header, REQUEST below, then n records, CHECK below, then the overflow row of
--                  the request's caller kind and endpoint (as long as the header says), then the
--                  request's slot id (for checks of the slot algorithms; none without them): the
--                  two are read only when a request needs them. Numbers travel as IEEE doubles:
--                  unpacking them is a copy, where parsing decimal strings is the costliest thing
--                  a script does. One argument, not one per part: each costs Redis about 1,100
--                  instructions to take in (docs/benchmarks.md).
-- ARGV[2]          the request's usage row, or "" not to count it
-- ARGV[3]          a leasing call's (consume = 3) wants: per check, LEASE packed, the tokens to
--                  take beyond its cost for the worker to spend itself (0: none; token buckets and
--                  fixed windows only: a fixed window's are the current window's, spent in it)
--
-- State values (every key written with a PX TTL) round-trip exactly, at the least cost: packing
-- a double costs a tenth of formatting it in %.17g decimal. Each records the terms it was written
-- in, so that a changed policy reads it by the share already used (ratelimits/algorithms.py):
-- a raised limit never waits longer, a lowered one never admits more than its new burst.
--   GCRA           the theoretical arrival time and the capacity (burst x emission interval), us,
--                  packed (16 bytes), under keys of layout letter c (a previous release's
--                  script, mid-deploy, never meets one). A bucket a refund has given back to
--                  (lua/refund.lua) holds 25: those two, the us given back to it so far, and
--                  255, kept from then on; then 16 per refund time has not reached yet (its
--                  holes), kept as they are until the bucket is full again.
--   sliding window window index, current count, previous count, limit, period (us), packed
--                  (40 bytes; the previous layout's 24, without the last two, carry over, read in
--                  the current policy's terms; the previous release reads a new one's prefix)
--   fixed window   window index, count, limit, period (us), packed (32 bytes; the previous
--                  layout's 16 likewise)
--   global bucket  a global policy's token bucket (layout letter g): tokens, time (us), the
--                  region's share it was last spent at, the limit's rate (tokens per us) and
--                  burst, packed (40 bytes). Tokens, not an arrival time: a share change must
--                  keep the tokens a region holds (lua/reshare.lua converts them when it writes one)
--   slots          a sorted set of slot ids scored by their expiry (us); expired ones are purged
--                  before counting, so a worker killed while holding slots loses them on its own
--
-- Returns {now_us, version or false, then per check: remaining, reset_us, retry_us}. A check
-- allowed exactly when its retry_us is 0 (a denial's wait is at least 1 us); -1: it failed (see
-- phase 1). A refundable call (consume = 2: one slot group of a cluster decision) adds one more
-- string: per check, REFUNDABLE packed, what lua/refund.lua needs to give back exactly what the
-- check spent (a token bucket's arrival time after it, and what the bucket had been given back; a
-- billing period's start, the window it counted in, and 0).
-- A leasing call (consume = 3: refundable, and leasing) adds another: per check, LEASE packed, the
-- tokens taken for the worker beyond its cost (as many of its wants as the bucket held; none
-- unless the request was admitted). They are taken as the request's cost is: really spent here,
-- so however the worker spends them, no more is admitted than the bucket holds.

-- The algorithm codes of ratelimits.algorithms.Algorithm (a test holds the two to the same numbers).
local TOKEN_BUCKET, SLIDING_WINDOW, FIXED_WINDOW = 1, 2, 3
-- Slots in flight per subject (429 when full), and in the fleet's in-flight set (503 when full):
-- the codes after the rate algorithms'.
local CONCURRENCY, FLEET = 4, 5
-- How soon a caller denied a slot should retry (ratelimits.algorithms.SLOT_RETRY_US).
local SLOT_RETRY_US = 1000000
-- The packed layouts (struct formats). REQUEST: now (negative: read the Redis clock, TIME),
-- consume (1; 2: consume, and say what a refund needs) or only report (0), the tokens the request spends (its endpoint's cost, for the
-- usage count), seconds an undrained usage hash lives, the most rows a minute counts, how
-- many checks are of global policies, the overflow row's length, and the call's deadline (us, Redis TIME; 0: none): a call
-- that runs after it does nothing and answers the error LATE, for its worker stopped waiting
-- and decided the request without it (ratelimits/backends/deadline.py).
-- CHECK: algorithm code, flags (1: shadow, reported but never denies; 2: a global policy; 4: a
-- quota by billing period; 8: soft, admitting past its limit), limit (requests per period; slots),
-- period (us; a slot's TTL; a billing period's longest), burst (GCRA capacity in requests), cost
-- (tokens it spends), the state's TTL (ms, for PX); a global policy's adds FALLBACK: its share
-- while it has no record; a billing period's adds PERIOD: three period starts (us) around now, the
-- middle one nearest (ratelimits/periods.py), of which the store's clock picks its period.
local REQUEST, CHECK, FALLBACK, PERIOD = '<dBdddddd', '<BBddddd', '<d', '<ddd'
local GCRA_STATE, SLIDING_STATE, FIXED_STATE = '<dd', '<ddddd', '<dddd'
-- A bucket given back to: arrival time, capacity, us given back so far, and a last byte no
-- decimal has. Also each check's REFUNDABLE part.
local REFUNDED_STATE, REFUNDABLE = '<dddB', '<dd'
local REFUNDED_MARK = 255
-- A token bucket's state with the moment its key expires (us, on Redis TIME; 0: not known, as
-- under the app's clock). An admission whose state the key's expiry still covers, by the slack
-- the state TTL carries (Policy.state_ttl_ms), rewrites it with KEEPTTL: a SET without PX costs
-- Redis about two fifths less, and a bucket a caller keeps below its limit is rewritten with PX
-- about once per burst's refill time. Its first 16 bytes are GCRA_STATE, as a previous release
-- (and lua/refund.lua) reads it; a state written by either carries no expiry, and is written
-- with PX. The expiry recorded is the least the PX can give: the state TTL is the capacity
-- rounded up to the millisecond, plus the slack (Policy.state_ttl_ms), counted from the script's
-- start in whole milliseconds (Redis freezes the clock keys expire by for a script), where TIME
-- may be read a little later: two milliseconds less covers both.
local TIMED_STATE = '<ddd'
local TIMED_SIZE, TTL_SLACK_US, EXPIRY_MARGIN_US = 24, 1000000, 2000
-- The windows' previous layouts, without their terms.
local OLD_SLIDING, OLD_FIXED = '<ddd', '<dd'
local LEASE = '<d'
-- SHARE_SIZE: a record's header (ratelimits/shares.py), before its vector of every region's share.
local GLOBAL_STATE, SHARE, SHARE_SIZE = '<ddddd', '<ddddd', 48
-- A global subject's numbers in the demand hash, under <state key>#p: its rate (tokens per us),
-- burst, and state TTL (ms), for the reconciler's write to convert or make its bucket.
local POLICY = '<ddd'
-- Seconds a second's demand hash lives (ratelimits.backends.layout.DEMAND_TTL_S).
local DEMAND_TTL = 10
-- A global check whose share holds less than its cost is retried after this: the next
-- reconciliation may give it more.
local RESHARE_RETRY_US = 1000000
-- Spent tokens are doubles: a retry computed to the microsecond may leave a rounding error short.
local EPSILON = 1e-9
-- The standard library's functions, bound by the first call: a Redis Function's library is loaded
-- where only `redis` is in reach (Redis 7.0), and a local is cheaper to call than a global's field.
local unpack_args, pack, floor, ceil, max, min
-- The call's clock (us) and what it does, which the algorithms below read: set by decide().
-- server_clock: `now` is Redis TIME, the clock keys expire by.
local now, consume, refundable, leasing, server_clock
-- Set per check, for a quota by billing period (by_period): its starts around now, and whether it
-- is soft (admits past its limit, counting the overage).
local by_period, soft, period_lo, period_mid, period_hi = false, false, 0, 0, 0

-- A TTL (ms, a whole number) as the decimal PX takes. Given a number, Redis formats it on every
-- call (%.17g, about 1,600 instructions); a Redis Function's library keeps each policy's text
-- from call to call. Bounded: emptied when it holds a thousand.
local ttl_texts, ttl_count = {}, 0
local function px(ttl)
  local text = ttl_texts[ttl]
  if text == nil then
    if ttl_count >= 1000 then ttl_texts, ttl_count = {}, 0 end
    text = string.format('%d', ttl)
    ttl_texts[ttl], ttl_count = text, ttl_count + 1
  end
  return text
end

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

-- Each returns allowed, remaining, reset_us, retry_us, new_value. An admitted token bucket also
-- leaves its new arrival time and what it was given back so far here, for a refundable call, and
-- in `keep` whether its new value may keep the key's expiry (KEEPTTL). An admitted token bucket or
-- fixed window takes up to `want` more tokens (a leasing call's), leaving how many in `granted`.
local spent_tat, given_back = 0, 0
local want, granted = 0, 0
local keep = false
-- A state read in other terms than its check's (the policy changed), as the new terms read it:
-- stored by a call that consumes, admitted or not (it spends nothing), so that from then on it
-- drains at the new rate and a denial's wait is the wait there is. Set per check.
local converted = nil
local function token_bucket(value, limit, period, burst, cost)
  local interval = period / limit
  local capacity = burst * interval
  local tat, refunded, expires, holes = now, 0, 0, ''
  if value then
    local written  -- the capacity it was written under
    local size = #value
    if size == TIMED_SIZE then
      tat, written, expires = unpack_args(TIMED_STATE, value)
    elseif size % 16 == 9 then  -- given back to: 25 bytes, then its holes (lua/refund.lua), kept
      tat, written, refunded = unpack_args(REFUNDED_STATE, value)
      if size > 25 then holes = string.sub(value, 26) end
    else
      tat, written = unpack_args(GCRA_STATE, value)
    end
    if tat <= now then
      tat, holes = now, ''  -- full again: time has reached every hole
    elseif written ~= capacity then
      holes = ''  -- converted: refunds in the old terms are past giving back (lua/refund.lua)
      -- Written under another rate or burst: the same share of the burst is spent in the new
      -- terms, at most all of it (a debt rounded past the capacity, algorithms.py).
      tat = now + min(tat - now, written) * capacity / written
      if refunded > 0 then
        converted = pack(REFUNDED_STATE, tat, capacity, refunded, REFUNDED_MARK)
      else
        converted = pack(GCRA_STATE, tat, capacity)
      end
    end
  end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - capacity
  if now < allow_at then
    local remaining = max(floor((now + capacity - tat) / interval), 0)
    return false, remaining, ceil(tat - now), ceil(allow_at - now), nil
  end
  if want > 0 then
    local room = floor((now + capacity - new_tat) / interval)
    if room > 0 then
      granted = min(want, room)
      new_tat = new_tat + granted * interval
    end
  end
  -- Rounded by the % operator, not floor() and ceil(): this is every admission's path, and a call
  -- into the math library costs ten times an operator (x % 1 is x - floor(x), exactly). Clamped
  -- as algorithms.py clamps it: at the edge of an admission, now + capacity - new_tat may round to
  -- a hair below zero in doubles although now >= allow_at.
  local remaining = (now + capacity - new_tat) / interval
  remaining = remaining - remaining % 1
  if remaining < 0 then remaining = 0 end
  local reset = new_tat - now
  local fraction = reset % 1
  if fraction > 0 then reset = reset - fraction + 1 end
  local state
  if refunded > 0 then
    state = pack(REFUNDED_STATE, new_tat, capacity, refunded, REFUNDED_MARK) .. holes
  elseif server_clock and expires >= new_tat + TTL_SLACK_US then
    keep = true
    state = pack(TIMED_STATE, new_tat, capacity, expires)
  else
    if server_clock then expires = now + capacity + TTL_SLACK_US - EXPIRY_MARGIN_US end
    state = pack(TIMED_STATE, new_tat, capacity, expires)
  end
  if refundable then spent_tat, given_back = new_tat, refunded end
  return true, remaining, reset, 0, state
end

-- A window's count under old_limit, as the same share of limit, with another period no more than
-- the count itself: a fixed window's rounded up, never to admit more (algorithms.py, _share), a
-- sliding window's exact (_exact_share).
local function share(count, old_limit, limit, same_period, exact)
  local shared = count * limit / old_limit
  if not exact then shared = ceil(shared) end
  if same_period or shared < count then return shared end
  return count
end

local function sliding_window(value, limit, period, burst, cost)
  local window, elapsed = split(period)
  local current, previous = 0, 0
  if value then
    local w, c, p, old_limit, old_period
    if #value == 24 then
      w, c, p = unpack_args(OLD_SLIDING, value)
      old_limit, old_period = limit, period
    else
      w, c, p, old_limit, old_period = unpack_args(SLIDING_STATE, value)
    end
    if old_limit ~= limit or old_period ~= period then
      -- Written under another limit or window: its windows seen from now in their own terms.
      local old_window, same = split(old_period), old_period == period
      if w == old_window then
        current, previous = share(c, old_limit, limit, same, true), share(p, old_limit, limit, same, true)
      elseif w == old_window - 1 then
        previous = share(c, old_limit, limit, same, true)
      end
      converted = pack(SLIDING_STATE, window, current, previous, limit, period)
    elseif w == window then
      current, previous = c, p
    elseif w == window - 1 then
      previous = c
    end
  end
  local est = estimate(previous, current, elapsed, period)
  local until_next = period - elapsed
  if est + cost <= limit then
    return true, max(floor(limit - est - cost), 0), until_next + period, 0,
      pack(SLIDING_STATE, window, current + cost, previous, limit, period)
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
  local window, until_next
  if by_period then  -- named by its start: [lo, mid) before mid, else [mid, hi)
    if now < period_mid then
      window, until_next = period_lo, period_mid - now
    else
      window, until_next = period_mid, period_hi - now
    end
  else
    local elapsed
    window, elapsed = split(period)
    until_next = period - elapsed
  end
  local count = 0
  if value then
    local w, c, old_limit, old_period
    if #value == 16 then
      w, c = unpack_args(OLD_FIXED, value)
      old_limit, old_period = limit, period
    else
      w, c, old_limit, old_period = unpack_args(FIXED_STATE, value)
    end
    if old_limit ~= limit or old_period ~= period then
      -- Written under another limit or window: the same share, while its window is current (a
      -- billing period's, while it is the same period of the same unit).
      if by_period then
        if w == window and old_period == period then count = share(c, old_limit, limit, true) end
      elseif w == split(old_period) then
        count = share(c, old_limit, limit, old_period == period)
      end
      converted = pack(FIXED_STATE, window, count, limit, period)
    elseif w == window then
      count = c
    end
  end
  if count + cost <= limit then
    if want > 0 and count + cost < limit then
      granted = min(want, limit - count - cost)
    end
    return true, limit - count - cost - granted, until_next, 0, pack(FIXED_STATE, window, count + cost + granted, limit, period)
  end
  if soft then return true, 0, until_next, 0, pack(FIXED_STATE, window, count + cost, limit, period) end
  return false, max(limit - count, 0), until_next, until_next, nil
end

-- A global policy's bucket in this region: its share (`share`, set per check) of the rate and
-- burst. Refilled since it was last spent at the lesser of that spend's share and this one: the
-- share moves up only by a write (which converts the tokens, lua/reshare.lua), and down by a
-- stale share's steady decay, so the lesser end never credits more than the share in force did.
-- A region whose share is zero (the regions out of reach may hold all there is) admits nothing.
local share = 1
local function global_bucket(value, limit, period, burst, cost)
  if share <= 0 then return false, 0, 0, RESHARE_RETRY_US, nil end
  local full = limit / period
  local capacity = burst * share
  local speed = full * share
  local held = capacity
  if value then
    local at, spent_share, _, written_burst
    held, at, spent_share, _, written_burst = unpack_args(GLOBAL_STATE, value)
    -- Written under another burst: the same share of the new one.
    if written_burst ~= burst then held = held * burst / written_burst end
    if now > at then held = held + (now - at) * full * min(share, spent_share) end
    if held > capacity then held = capacity end
  end
  if held + EPSILON >= cost then
    held = max(held - cost, 0)
    return true, floor(held + EPSILON), ceil((capacity - held) / speed), 0,
      pack(GLOBAL_STATE, held, now, share, full, burst)
  end
  local retry = RESHARE_RETRY_US
  if cost <= capacity then retry = max(ceil((cost - held) / speed), 1) end
  return false, floor(held + EPSILON), ceil((capacity - held) / speed), retry, nil
end

-- The share in force of a record (ratelimits/shares.py, ShareRecord.effective): as written, or,
-- once stale, decaying down to the even split (a share below it stays: only a write raises one).
-- A record of another length than a whole one is none (the even split).
local function share_of(record, fallback)
  if not record or #record < SHARE_SIZE or (#record - SHARE_SIZE) % 8 ~= 0 then return fallback end
  local written_share, written, stale, decay, target = unpack_args(SHARE, record)
  if not (written_share >= 0 and written_share <= 1 and target > 0 and target <= 1) then return fallback end
  local age = now - written - stale
  if not (age <= 0 or written_share <= target) then
    if age >= decay then return target end
    written_share = written_share + (target - written_share) * age / decay
  end
  return written_share
end

-- Slots are counted live (a sorted set, not a string), so they take the key, not its value.
-- Purging expired slots is a write even when the request is denied: it removes only what
-- no request holds any more.
local function slots(key, limit, ttl, burst, cost)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local count = redis.call('ZCARD', key)
  if count + cost <= limit then
    return true, limit - count - cost, ttl, 0, nil
  end
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local earliest = now + ttl
  if first[2] then earliest = tonumber(first[2]) end
  return false, max(limit - count, 0), earliest - now, min(earliest - now, SLOT_RETRY_US), nil
end

-- Indexed by code, so in code order (a table constructor with keys would put them in the
-- table's slower hash part).
local algorithms = {token_bucket, sliding_window, fixed_window, slots, slots}

-- Errors a check's own state or arguments cause (a key of another type, a value out of range,
-- a state of another layout), as opposed to the store's trouble (READONLY, OOM, BUSY, ...),
-- which fails the whole call.
local function check_error(err)
  local code = string.match(err or '', '^(%u+)')
  return code == 'WRONGTYPE' or code == 'ERR'
end

-- One call: KEYS and ARGV as the top of this file says. Everything above is made once per library
-- (FUNCTION LOAD), not per call: each closure over this many locals costs a few thousand instructions
-- to make, about a fifth of a decision in all. (The script form, for EVAL, makes them per call.)
local function decide(KEYS, ARGV)
  if not pack then
    unpack_args, pack, floor, ceil, max, min = struct.unpack, struct.pack, math.floor, math.ceil, math.max, math.min
  end
  local tokens, usage_ttl, usage_cap, globals, overflow_size, deadline, pos
  now, consume, tokens, usage_ttl, usage_cap, globals, overflow_size, deadline, pos = unpack_args(REQUEST, ARGV[1])
  server_clock = now < 0
  if now < 0 or deadline > 0 then
    local t = redis.call('TIME')
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if clock > deadline and deadline > 0 then
      return redis.error_reply('LATE the call ran after its deadline; nothing was taken, spent or counted')
    end
    if now < 0 then now = clock end
  end
  leasing = consume == 3
  refundable = consume >= 2
  consume = consume >= 1
  spent_tat, given_back, want, granted, converted, share = 0, 0, 0, 0, nil, 1
  by_period, soft = false, false
  local usage = ARGV[2]
  local n = #KEYS - 1 - globals
  if globals > 0 then n = n - 1 end
  if usage ~= '' then n = n - 1 end

  -- Phase 1: decide every check against current state. A key named twice sees the pending
  -- value of its earlier check, so duplicates cannot double-spend.
  -- One MGET reads the version stamp and every state: each redis.call costs more than the Lua
  -- around it. The reply is filled in place: {now, version, per-check triples}.
  local stored = redis.call('MGET', unpack(KEYS, 1, n + 1 + globals))
  local global_index = 0
  local demand = globals > 0 and KEYS[n + globals + 2]
  -- The reply and the writes are made with room for eight checks: a table grown an item at a
  -- time is reallocated at every power of two, about a twentieth of a decision's instructions.
  -- (The reply ends at its first nil.)
  local reply = {now, stored[1], nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
  local writes = {nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
  local written = 0  -- per admitted check, in writes: its index i (a slot's is negative), new value, and its TTL (false: kept)
  local pending = {}
  local conversions = {}  -- per check whose state was converted: its index i, converted value, TTL, and whether it allowed
  local all_allowed, limited, failed = true, false, false
  local out = 2
  local refunds = refundable and {}  -- per check, REFUNDABLE: for a refundable call
  local wants = leasing and ARGV[3]
  local grants = leasing and {}  -- per check, LEASE: for a leasing call
  for i = 1, n do
    local key = KEYS[i + 1]
    local algorithm, shadow, limit, period, burst, cost, ttl
    algorithm, shadow, limit, period, burst, cost, ttl, pos = unpack_args(CHECK, ARGV[1], pos)
    local holds_slot = algorithm >= CONCURRENCY  -- CONCURRENCY and FLEET, the codes after the rate algorithms
    local evaluate = algorithms[algorithm]
    -- (A billing period's quota is never a global policy: a record has FALLBACK or PERIOD, not both.)
    if shadow >= 4 then  -- a quota by billing period (4), soft (8): its starts around now follow
      soft = shadow >= 8
      if soft then shadow = shadow - 8 end
      by_period, shadow = true, shadow - 4
      period_lo, period_mid, period_hi, pos = unpack_args(PERIOD, ARGV[1], pos)
    elseif by_period then  -- the check before was one
      by_period, soft = false, false
    end
    if shadow >= 2 then  -- a global policy: its region's share of a token bucket
      local fallback
      fallback, pos = unpack_args(FALLBACK, ARGV[1], pos)
      global_index = global_index + 1
      share = share_of(stored[n + 1 + global_index], fallback)
      shadow = shadow - 2
      evaluate = global_bucket
      if consume and redis.call('HINCRBY', demand, key, cost) == cost then
        -- The subject's first demand this second: the hash's TTL, and the policy's numbers, which
        -- the reconciler's write needs to convert (or make) the bucket.
        redis.call('HSET', demand, key .. '#p', pack(POLICY, limit / period, burst, ttl))
        redis.call('EXPIRE', demand, DEMAND_TTL)
      end
    end
    local value = key  -- a slot check takes its key
    if not holds_slot then
      value = pending[key]
      if value == nil then value = stored[i + 1] end
    end
    granted, converted, keep = 0, nil, false
    if leasing and (algorithm == TOKEN_BUCKET or algorithm == FIXED_WINDOW) then
      want = unpack_args(LEASE, wants, 8 * i - 7)
    else
      want = 0
    end
    local ok, allowed, remaining, reset, retry, new_value = pcall(evaluate, value, limit, period, burst, cost)
    if not ok then
      -- This check cannot be decided: its key holds another type, or its arguments are out of range.
      -- (The store's own errors, READONLY, OOM and the like, fail the whole call as ever.) The check
      -- is reported as failed (allowed = 2) and the request denied without consuming anything: the
      -- engine decides it again without that check, by the check's fail mode; other subjects go on.
      if type(allowed) == 'table' and not check_error(allowed.err) then return allowed end
      all_allowed, failed = false, true
      remaining, reset, retry = 0, 0, -1
    elseif allowed then
      if holds_slot then
        writes[written + 1], writes[written + 2], writes[written + 3] = -i, now + period, ttl
      else
        pending[key] = new_value
        writes[written + 1], writes[written + 2], writes[written + 3] = i, new_value, not keep and ttl
      end
      written = written + 3
    elseif converted then
      pending[key] = converted
    end
    if ok and converted then
      local at = #conversions
      conversions[at + 1], conversions[at + 2], conversions[at + 3], conversions[at + 4] = i, converted, ttl, allowed
    end
    if ok and not allowed then
      -- A shadow check reports what it would do; only enforced checks can deny the request.
      if shadow == 0 then
        all_allowed = false
        -- Denied only by the fleet is shed (503); by anything else, limited (429).
        if algorithm ~= FLEET then limited = true end
      end
    end
    reply[out + 1], reply[out + 2], reply[out + 3] = remaining, reset, retry
    out = out + 3
    if refundable then
      if evaluate == token_bucket and retry == 0 then
        refunds[i] = pack(REFUNDABLE, spent_tat, given_back)
      elseif by_period and retry == 0 then
        -- A billing period's count: the period it was counted in, named by its start (lua/refund.lua).
        local counted_in = period_mid
        if now < period_mid then counted_in = period_lo end
        refunds[i] = pack(REFUNDABLE, counted_in, 0)
      else
        refunds[i] = pack(REFUNDABLE, 0, 0)
      end
    end
    if leasing then grants[i] = granted end
  end
  if refundable then reply[out + 1] = table.concat(refunds) end
  if leasing then
    -- Only an admitted request takes anything: a denied one leases nothing either.
    for i = 1, n do
      if not all_allowed then grants[i] = 0 end
      grants[i] = pack(LEASE, grants[i])
    end
    reply[out + 2] = table.concat(grants)
  end

  -- Phase 2: all or nothing. A converted state is kept either way, unless an admission rewrites it.
  if consume then
    for c = 1, #conversions, 4 do
      if not (all_allowed and conversions[c + 3]) then
        redis.call('SET', KEYS[conversions[c] + 1], conversions[c + 1], 'PX', px(conversions[c + 2]))
      end
    end
  end
  if all_allowed and consume then
    local slot  -- the request's slot id, the last part of ARGV[1]
    for w = 1, written, 3 do
      local i, ttl = writes[w], writes[w + 2]
      if i < 0 then
        slot = slot or string.sub(ARGV[1], pos + overflow_size)
        redis.call('ZADD', KEYS[1 - i], writes[w + 1], slot)
        redis.call('PEXPIRE', KEYS[1 - i], px(ttl))
      elseif ttl then
        redis.call('SET', KEYS[i + 1], writes[w + 1], 'PX', px(ttl))
      else
        redis.call('SET', KEYS[i + 1], writes[w + 1], 'KEEPTTL')
      end
    end
  end

  -- Usage counters for the roll-up, in this same round trip. One call in the common case (a row
  -- already counted this minute); tokens beyond one per request are counted only for costlier
  -- endpoints. Only a row's first field does more: the cap on the minute's rows, and for the
  -- minute's first row the hash's expiry (if nothing drains it).
  -- A failed check's request is decided again without it, and counted then.
  if consume and usage ~= '' and not failed then
    local counters = KEYS[#KEYS]
    local metric = 's'
    if all_allowed then
      metric = 'a'
    elseif limited then
      metric = 'l'
    end
    if redis.call('HINCRBY', counters, usage .. metric, 1) == 1 and redis.call('HSETNX', counters, usage, 1) == 1 then
      local rows = redis.call('HINCRBY', counters, '#', 1)
      if rows == 1 then redis.call('EXPIRE', counters, usage_ttl) end
      if rows > usage_cap then
        redis.call('HDEL', counters, usage .. metric, usage)
        usage = string.sub(ARGV[1], pos, pos + overflow_size - 1)  -- the overflow row
        redis.call('HINCRBY', counters, usage .. metric, 1)
      end
    end
    if all_allowed and tokens ~= 1 then redis.call('HINCRBY', counters, usage .. 'x', tokens - 1) end
  end
  return reply
end
