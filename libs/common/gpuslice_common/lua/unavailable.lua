-- Mark a node whose heartbeats stopped: every card unhealthy, so the scheduler
-- places nothing there; reservations and usage stay until their pods go. The
-- next registration (a heartbeat) brings the cards back with their real health.
-- The heartbeat is compared here, so one that arrives meanwhile is never lost.
-- ARGV[1] the oldest heartbeat (epoch ms) still counted as alive
-- Returns {'marked'} | {'fresh'} | {'already'} | {'absent'}
local heartbeat = redis.call('HGET', META, 'heartbeat')
if not heartbeat then
  return {'absent'}
end
if tonumber(heartbeat) >= tonumber(ARGV[1]) then
  return {'fresh'}
end
if redis.call('HEXISTS', META, 'unavailable') == 1 then
  return {'already'}
end
for _, u in ipairs(cjson.decode(redis.call('HGET', META, 'devices') or '[]')) do
  if (gget(u, 'vendor') or 'nvidia') == 'nvidia' then  -- the agent's cards, not other vendors'
    redis.call('HSET', GPUS, gkey(u, 'healthy'), 0)
  end
end
redis.call('HSET', META, 'unavailable', now_ms())
bump()
return {'marked'}
