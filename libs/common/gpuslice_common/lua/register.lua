-- Register or refresh a node's devices. Usage already reserved is kept; a card
-- that disappears while in use stays (present = 0) until its pods are released.
-- ARGV[1] JSON {devices = [{uuid, index, model, memory_mib, numa, healthy, mig,
--               cap_mem, cap_cores, cap_slots}], config = {...}}
-- Returns the number of cards now listed for the node.
local inv = cjson.decode(ARGV[1])
local seen, order = {}, {}
for _, d in ipairs(inv.devices) do
  local u = d.uuid
  seen[u] = true
  table.insert(order, u)
  redis.call('HSET', GPUS,
    gkey(u, 'index'), d.index, gkey(u, 'model'), d.model, gkey(u, 'memory'), d.memory_mib,
    gkey(u, 'numa'), d.numa, gkey(u, 'healthy'), d.healthy, gkey(u, 'mig'), d.mig,
    gkey(u, 'cap_mem'), d.cap_mem, gkey(u, 'cap_cores'), d.cap_cores,
    gkey(u, 'cap_slots'), d.cap_slots, gkey(u, 'present'), 1)
  for _, field in ipairs({'mem', 'cores', 'slots'}) do
    redis.call('HSETNX', GPUS, gkey(u, field), 0)
  end
  redis.call('HSETNX', GPUS, gkey(u, 'owner'), '')
  redis.call('HSETNX', GPUS, gkey(u, 'cordoned'), 0)
end
local before = cjson.decode(redis.call('HGET', META, 'devices') or '[]')
for _, u in ipairs(before) do
  if not seen[u] then
    if gnum(u, 'slots') > 0 then
      redis.call('HSET', GPUS, gkey(u, 'present'), 0)
      table.insert(order, u)
    else
      for _, field in ipairs({'index', 'model', 'memory', 'numa', 'healthy', 'mig', 'cap_mem',
          'cap_cores', 'cap_slots', 'present', 'mem', 'cores', 'slots', 'owner', 'cordoned'}) do
        redis.call('HDEL', GPUS, gkey(u, field))
      end
    end
  end
end
local now = now_ms()
local devices = '[]'
if #order > 0 then
  devices = cjson.encode(order)
end
redis.call('HSET', META, 'devices', devices, 'heartbeat', now, 'config', cjson.encode(inv.config))
redis.call('HSETNX', META, 'registered', now)
redis.call('HDEL', META, 'unavailable')
bump()
return #order
