-- Delete the pod index KEYS[1] only if it still names node ARGV[1].
-- (Runs after the prelude but touches only its own key.)
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
