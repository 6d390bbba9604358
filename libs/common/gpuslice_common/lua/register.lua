-- Register or refresh a node's devices of one vendor. Usage already reserved is
-- kept; a card that disappears while in use stays (present = 0) until its pods
-- are released. Cards of other vendors on the node are left as they are.
-- ARGV[1] JSON {vendor, devices = [{uuid, index, model, memory_mib, numa, healthy,
--               mig, cap_mem, cap_cores, cap_slots, mode, mig_profiles,
--               mig_instances, mig_slices, mig_static, layers}], config = {...},
--               dra = whether the agent serves kubelet through DRA}
--         (the MIG facts as ledger.py's _mig_fields writes them; mig_used, the
--         slices reservations take, is the reservations' own and kept)
-- Only the node agent's own vendor (nvidia) is its heartbeat and its config.
-- A vendor's registration listing a UUID that is another vendor's card on this
-- node is refused: {'taken', uuid, vendor} (nothing written). The node agent's
-- is not: it found its cards through NVML, while a vendor's come from node
-- annotations, so a vendor card under an NVIDIA UUID becomes the agent's card,
-- or, while a pod holds it, stays the vendor's and the agent's card waits.
-- Returns {the number of cards now listed for the node, the agent's cards that
-- wait, comma-separated}.
local inv = cjson.decode(ARGV[1])
local vendor = inv.vendor or 'nvidia'
local function vendor_of(u)
  return gget(u, 'vendor') or 'nvidia'
end
local before = cjson.decode(redis.call('HGET', META, 'devices') or '[]')
local listed = {}
for _, u in ipairs(before) do
  listed[u] = true
end
local waiting = {}
for _, d in ipairs(inv.devices) do
  if listed[d.uuid] and vendor_of(d.uuid) ~= vendor then
    if vendor ~= 'nvidia' then
      return {'taken', d.uuid, vendor_of(d.uuid)}
    end
    if gnum(d.uuid, 'slots') > 0 then
      waiting[d.uuid] = true
    else
      redis.call('HDEL', GPUS, gkey(d.uuid, 'vendor'))
    end
  end
end
local seen, order = {}, {}
-- the agent's cards that wait are not written (the vendor's card stays listed)
for _, d in ipairs(inv.devices) do
  local u = d.uuid
  if not waiting[u] then
    seen[u] = true
    table.insert(order, u)
    redis.call('HSET', GPUS,
      gkey(u, 'index'), d.index, gkey(u, 'model'), d.model, gkey(u, 'memory'), d.memory_mib,
      gkey(u, 'numa'), d.numa, gkey(u, 'healthy'), d.healthy, gkey(u, 'mig'), d.mig,
      gkey(u, 'cap_mem'), d.cap_mem, gkey(u, 'cap_cores'), d.cap_cores,
      gkey(u, 'cap_slots'), d.cap_slots, gkey(u, 'present'), 1,
      gkey(u, 'mode'), d.mode, gkey(u, 'mig_profiles'), d.mig_profiles,
      gkey(u, 'mig_instances'), d.mig_instances, gkey(u, 'mig_slices'), d.mig_slices,
      gkey(u, 'mig_static'), d.mig_static)
    -- which enforcement layers hold the card's containers (ledger.py's _layers_field)
    redis.call('HSET', GPUS, gkey(u, 'layers'), d.layers or '')
    if vendor ~= 'nvidia' then
      redis.call('HSET', GPUS, gkey(u, 'vendor'), vendor)
    end
    for _, field in ipairs({'mem', 'cores', 'slots', 'mig_used'}) do
      redis.call('HSETNX', GPUS, gkey(u, field), 0)
    end
    redis.call('HSETNX', GPUS, gkey(u, 'owner'), '')
    redis.call('HSETNX', GPUS, gkey(u, 'cordoned'), 0)
  end
end
for _, u in ipairs(before) do
  if not seen[u] then
    if vendor_of(u) ~= vendor then
      table.insert(order, u)
    elseif gnum(u, 'slots') > 0 then
      redis.call('HSET', GPUS, gkey(u, 'present'), 0)
      table.insert(order, u)
    else
      for _, field in ipairs({'index', 'model', 'memory', 'numa', 'healthy', 'mig', 'cap_mem',
          'cap_cores', 'cap_slots', 'present', 'mem', 'cores', 'slots', 'owner', 'cordoned',
          'vendor', 'mode', 'mig_profiles', 'mig_instances', 'mig_slices', 'mig_static',
          'mig_used', 'layers'}) do
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
redis.call('HSET', META, 'devices', devices)
if vendor == 'nvidia' then
  redis.call('HSET', META, 'heartbeat', now, 'config', cjson.encode(inv.config))
  redis.call('HSET', META, 'dra', inv.dra == true and 1 or 0)
  redis.call('HDEL', META, 'unavailable')
end
redis.call('HSETNX', META, 'registered', now)
bump()
local held = {}
for u in pairs(waiting) do
  table.insert(held, u)
end
table.sort(held)
return {#order, table.concat(held, ',')}
