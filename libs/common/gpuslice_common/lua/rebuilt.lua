-- Stamp a node rebuilt: a reconciliation pass that read the node's registration
-- before listing the pods has restored every placement they record here. From
-- now on the node takes reservations, binds and allocations. register.lua never
-- sets the stamp; only Redis losing the node's keys takes it away.
-- ARGV[1] the node's `registered` value the pass read ('' for any): a node that
--         registered afresh since (Redis lost its data again) is not stamped
-- Returns {'ok'} | {'already'} | {'changed'} | {'absent'}
local registered = redis.call('HGET', META, 'registered')
if not registered then
  return {'absent'}
end
if ARGV[1] ~= '' and ARGV[1] ~= registered then
  return {'changed'}
end
if redis.call('HSETNX', META, 'rebuilt', now_ms()) == 0 then
  return {'already'}
end
bump()
return {'ok'}
