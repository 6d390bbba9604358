-- Compare-and-swap of the pod index KEYS[1]: if it names node ARGV[1], point it at
-- ARGV[2], or delete it when ARGV[2] is empty. Touches only its own key.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  return redis.call('DEL', KEYS[1])
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
