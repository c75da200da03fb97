-- reshare.lua: write new shares of global policies into one region's store (the reconciler's).
--
-- KEYS[1], KEYS[2]  subject 1's state key (a global bucket: lua/decide.lua, layout letter g) and
--                   its share record (ratelimits/shares.py, ShareRecord); KEYS[2i - 1], KEYS[2i]
--                   subject i's
-- ARGV[1]           the share records' TTL in milliseconds
-- ARGV[2]           packed '<d': the write's deadline (us, the reconciler's clock)
-- ARGV[2 + i]       subject i, packed: the epoch the reconciler read here (0: no record), '<d';
--                   the policy's rate (tokens per us), burst and state TTL (ms), '<ddd' (0: not
--                   known); then the new record
--
-- A write that runs after its deadline (a store that was stopped, a network that held it) is
-- refused whole: a round whose write may not have landed waits out its deadline before it ends,
-- so a later round may have read this region since, and this write would land under it. Otherwise a record is written only if its epoch is still the one read: of two rounds
-- racing on a subject one writes it, and the other is told (compare and set).
--
-- Writing a share converts the bucket at once: its tokens refilled up to now at the old share,
-- then capped at the new share's burst. A bucket with no state yet (every request of it denied,
-- or none made here) is made, holding the lesser of the two shares' bursts: a missing state reads
-- as a full bucket, and would otherwise be full at the new share. So no share change creates
-- tokens, and between two writes a share only decays, which the decide script's refill (at the
-- lesser share) never over-credits.
--
-- Returns one byte per subject: 'w' written, 'c' its epoch moved on (another round wrote it), or
-- 'l' for every subject: the write ran after its deadline.

local unpack_args, pack = struct.unpack, struct.pack
local GLOBAL_STATE, GLOBAL_SIZE, SHARE, SHARE_SIZE = '<ddddd', 40, '<dddddd', 48
local SUBJECT = '<dddd'  -- epoch read, rate, burst, state TTL (ms)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = ARGV[1]
local n = #KEYS / 2

if now > unpack_args('<d', ARGV[2]) then return string.rep('l', n) end

-- As lua/decide.lua reads a record: decaying down to the even split once stale; a malformed one is none.
local function read(record)
  if not record or #record < SHARE_SIZE or (#record - SHARE_SIZE) % 8 ~= 0 then return nil end
  local share, written, stale, decay, target, epoch = unpack_args(SHARE, record)
  if not (share >= 0 and share <= 1 and target > 0 and target <= 1) then return nil end
  local age = now - written - stale
  if age > 0 and share > target then
    if age >= decay then share = target else share = share + (target - share) * age / decay end
  end
  return share, epoch
end

local out = {}
for i = 1, n do
  local state_key, share_key = KEYS[2 * i - 1], KEYS[2 * i]
  local expected, rate, burst, state_ttl, at = unpack_args(SUBJECT, ARGV[2 + i])
  local record = string.sub(ARGV[2 + i], at)
  local new_share, _, _, _, target = unpack_args(SHARE, record)
  local old_share, epoch = read(redis.call('GET', share_key))
  if not old_share then old_share, epoch = target, 0 end
  if epoch ~= expected then
    out[i] = 'c'
  else
    local state = redis.call('GET', state_key)
    if state and #state == GLOBAL_SIZE then
      local held, spent_at, spent_share, spent_rate, spent_burst = unpack_args(GLOBAL_STATE, state)
      if rate <= 0 then rate, burst = spent_rate, spent_burst end
      -- Written under another burst: the same share of the new one, as decide.lua reads it.
      if spent_burst ~= burst then held = held * burst / spent_burst end
      if now > spent_at then held = held + (now - spent_at) * rate * math.min(old_share, spent_share) end
      held = math.min(held, burst * old_share, burst * new_share)
      redis.call('SET', state_key, pack(GLOBAL_STATE, held, now, new_share, rate, burst), 'KEEPTTL')
    elseif not state and rate > 0 then
      local held = burst * math.min(old_share, new_share)
      redis.call('SET', state_key, pack(GLOBAL_STATE, held, now, new_share, rate, burst), 'PX', math.max(state_ttl, 1))
    end
    redis.call('SET', share_key, record, 'PX', ttl)
    out[i] = 'w'
  end
end
return table.concat(out)
