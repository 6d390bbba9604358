-- Stamp a node rebuilt: a reconciliation pass that read the node's registration
-- before listing the pods has restored every placement they record here. From
-- now on the node takes reservations, binds and allocations. register.lua never
-- sets the stamp; Redis losing the node's keys takes it away, and a new epoch
-- (a failover, a restart: see lib.lua) makes it stale.
-- ARGV[1] the node's `registered` value the pass read ('' for any): a node that
--         registered afresh since (Redis lost its data again) is not stamped
-- ARGV[2] the epoch the pass read ('' for any): after a failover during the
--         pass its restores may be lost, so the node is not stamped
-- Returns {'ok'} | {'already'} | {'changed'} | {'absent'}
local registered = redis.call('HGET', META, 'registered')
if not registered then
  return {'absent'}
end
if ARGV[1] ~= '' and ARGV[1] ~= registered then
  return {'changed'}
end
if (ARGV[2] or '') ~= '' and ARGV[2] ~= epoch() then
  return {'changed'}
end
if rebuilt() then
  return {'already'}
end
redis.call('HSET', META, 'rebuilt', now_ms(), 'epoch', epoch())
bump()
return {'ok'}
