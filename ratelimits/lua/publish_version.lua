-- publish_version.lua: raise the policy version stamp to at least ARGV[1]; never lower it.
--
-- KEYS[1]  the policy version stamp (an integer, copied from the database's PolicyVersion)
-- ARGV[1]  the version to publish
-- ARGV[2]  the stamp's TTL in seconds
-- Returns the stamp now stored.
local stored = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local wanted = tonumber(ARGV[1])
if wanted > stored then
  stored = wanted
end
redis.call('SET', KEYS[1], string.format('%d', stored), 'EX', ARGV[2])
return stored
