-- noop.lua: the floor of any script call: EVALSHA with no keys and no work.
--
-- KEYS[1] and ARGV[1]: none.
-- Returns 1.
return 1
