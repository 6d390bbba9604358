-- Take a card out of scheduling (or back in); reservations it holds stay.
-- ARGV[1] card uuid, ARGV[2] 1 to cordon, 0 to uncordon
-- Returns {'ok'} | {'absent'}
local u = ARGV[1]
if not gget(u, 'index') then
  return {'absent'}
end
redis.call('HSET', GPUS, gkey(u, 'cordoned'), ARGV[2])
bump()
return {'ok'}
