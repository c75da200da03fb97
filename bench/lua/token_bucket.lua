-- token_bucket.lua: the bench's anchor for one exact token bucket, as a lean peer writes it.
--
-- GCRA on one key, on the server's clock: TIME, GET the theoretical arrival time, and on an
-- admission SET it back with a PX TTL. Integer microseconds as a decimal string; no usage, no
-- policy terms, no version stamp: what a one-dimension decision costs a peer that does only that.
--
-- KEYS[1]   the bucket
-- ARGV[1]   emission interval (us), ARGV[2] burst capacity (us), ARGV[3] the TTL (ms)
-- Returns {allowed (1/0), wait (us)}.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local interval, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + interval
if new_tat - capacity > now then return {0, new_tat - capacity - now} end
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', ARGV[3])
return {1, 0}
