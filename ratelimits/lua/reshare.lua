-- reshare.lua: write new shares of global policies into one region's store (the reconciler's).
--
-- KEYS[1], KEYS[2]  subject 1's state key (a global bucket: lua/decide.lua, layout letter g) and
--                   its share record (ratelimits/shares.py, ShareRecord); KEYS[2i - 1], KEYS[2i]
--                   subject i's
-- ARGV[1]           the share records' TTL in milliseconds
-- ARGV[1 + i]       subject i: the epoch the reconciler read here (0: no record), packed '<d', then
--                   the new record
--
-- A record is written only if its epoch is still the one read: of two rounds racing on a subject
-- one writes it, and the other is told (compare and set). Writing a share converts the bucket's
-- state at once: its tokens refilled up to now at the old share, then capped at the new share's
-- burst. So a bucket's share only moves between two of its writes by steady decay, which the
-- decide script's refill (at the lesser share) never over-credits.
--
-- Returns one byte per subject: 'w' written, 'c' its epoch moved on (another round wrote it).

local unpack_args, pack = struct.unpack, struct.pack
local GLOBAL_STATE, SHARE, EPOCH = '<ddddd', '<dddddd', '<d'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = ARGV[1]

local function share_of(record)
  local share, written, stale, decay, target = unpack_args(SHARE, record)
  local age = now - written - stale
  if age <= 0 then return share end
  if age >= decay then return target end
  return share + (target - share) * age / decay
end

local out = {}
for i = 1, #KEYS / 2 do
  local state_key, share_key = KEYS[2 * i - 1], KEYS[2 * i]
  local expected, at = unpack_args(EPOCH, ARGV[1 + i])
  local record = string.sub(ARGV[1 + i], at)
  local new_share, _, _, _, target = unpack_args(SHARE, record)
  local current = redis.call('GET', share_key)
  local epoch, old_share = 0, target
  if current then
    old_share = share_of(current)
    epoch = select(6, unpack_args(SHARE, current))
  end
  if epoch ~= expected then
    out[i] = 'c'
  else
    local state = redis.call('GET', state_key)
    if state and #state == 40 then
      local held, spent_at, spent_share, full, burst = unpack_args(GLOBAL_STATE, state)
      if now > spent_at then held = held + (now - spent_at) * full * math.min(old_share, spent_share) end
      held = math.min(held, burst * old_share, burst * new_share)
      redis.call('SET', state_key, pack(GLOBAL_STATE, held, now, new_share, full, burst), 'KEEPTTL')
    end
    redis.call('SET', share_key, record, 'PX', ttl)
    out[i] = 'w'
  end
end
return table.concat(out)
