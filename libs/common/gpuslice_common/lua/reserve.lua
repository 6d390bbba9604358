-- Reserve a pod's devices on one node: all or nothing, idempotent by pod UID.
-- ARGV[1] pod uid
-- ARGV[2] placement record (JSON object, without state or times)
-- ARGV[3] footprint: JSON list of [uuid, memory_mib, cores, slots, exclusive(0|1),
--         MIG slices mask (0 on a card not in mode mig)]
-- ARGV[4] optional, restoring a pod's own record: 'allocated' (its containers
--         run) or 'bound'; allowed before the node is rebuilt, and checked for
--         capacity and exclusivity only (not health or cordon: the pod holds the
--         cards already), so two records that claim more than a card holds never
--         both count. Or 'prepared': a ResourceClaim the node's kubelet prepares
--         (DRA), recorded allocated at once, checked as a new reservation, on a
--         node in DRA mode only (reason NodeNotDra), with kube-scheduler's
--         arithmetic: it sums what claims consume, so only the sums of memory and
--         cores must fit each card (no slot count, no exclusive card, no spare
--         cores for a share without them; not health or cordon either: the slice
--         showed the card and the pod is bound to it). A node in DRA mode takes no
--         other new reservation (reason NodeServesDra): a card is never granted
--         by both kubelet's Allocate and a claim.
-- Returns {'ok', record, the node's revision now} | {'exists', record}
--       | {'fail', uuid, reason} | {'rebuilding'}
local uid = ARGV[1]
local existing = load_pod(uid)
if existing and existing.state ~= 'released' then
  return {'exists', redis.call('HGET', PODS, uid)}
end

local mode = ARGV[4] or ''
local restoring = mode == 'allocated' or mode == 'bound'
local prepared = mode == 'prepared'
if mode ~= '' and not restoring and not prepared then
  return {'fail', '', 'InvalidRequest'}
end
if not restoring and not rebuilt() then
  return {'rebuilding'}
end
-- both read before anything is written: what cannot be read changes nothing
local rec, fp = cjson.decode(ARGV[2]), cjson.decode(ARGV[3])
if type(rec) ~= 'table' or type(rec.containers) ~= 'table' or type(fp) ~= 'table' or #fp == 0 then
  return {'fail', '', 'InvalidRequest'}
end
if prepared and (type(rec.claim) ~= 'table' or not dra_node()) then
  return {'fail', '', type(rec.claim) ~= 'table' and 'InvalidRequest' or 'NodeNotDra'}
end
if not restoring and not prepared and dra_node() then
  return {'fail', '', 'NodeServesDra'}
end
-- a claim's record, prepared now or restored, counts as kube-scheduler counts it
local summed = prepared or (restoring and type(rec.claim) == 'table')
local seen = {}
for _, f in ipairs(fp) do
  if type(f) ~= 'table' then
    return {'fail', '', 'InvalidRequest'}
  end
  local u, mem, cores, slots, excl, mask = f[1], f[2], f[3], f[4], f[5], f[6]
  if type(u) ~= 'string' or seen[u] or not is_count(mem) or not is_count(cores)
      or not is_count(slots) or (excl ~= 0 and excl ~= 1)
      or not is_count(mask) or mask >= MIG_MASK_LIMIT then
    return {'fail', tostring(u), 'InvalidRequest'}  -- a card listed twice passes each check alone
  end
  seen[u] = mask
  if summed then
    excl = 0  -- kube-scheduler makes no card exclusive: its cores are summed only
    f[5] = 0
  end
  if gget(u, 'present') ~= '1' then
    return {'fail', u, 'CardNotFound'}
  end
  -- MIG: a card in mode mig is taken by instances only, each inside the card and
  -- on slices free of static instances and of other pods' instances
  local mig = gget(u, 'mode') == 'mig'
  if mig ~= (mask > 0) then
    return {'fail', u, 'InvalidRequest'}
  end
  if mig then
    if bit.band(mask, bit.bnot(gnum(u, 'mig_slices'))) ~= 0 then
      return {'fail', u, 'InvalidRequest'}
    end
    if bit.band(mask, bit.bor(gnum(u, 'mig_used'), gnum(u, 'mig_static'))) ~= 0 then
      return {'fail', u, 'CardMigTopologyInfeasible'}
    end
  end
  if not restoring and not prepared then
    if gget(u, 'healthy') ~= '1' then
      return {'fail', u, 'CardNotHealth'}
    end
    if gget(u, 'cordoned') == '1' then
      return {'fail', u, 'CardCordoned'}
    end
  end
  local owner = gget(u, 'owner') or ''
  if owner ~= '' then
    return {'fail', u, 'ExclusiveDeviceAllocateConflict'}
  end
  local used_slots, used_cores = gnum(u, 'slots'), gnum(u, 'cores')
  local cap_cores = gnum(u, 'cap_cores')
  if not summed and used_slots + slots > gnum(u, 'cap_slots') then
    return {'fail', u, 'CardTimeSlicingExhausted'}
  end
  if gnum(u, 'mem') + mem > gnum(u, 'cap_mem') then
    return {'fail', u, 'CardInsufficientMemory'}
  end
  if used_cores + cores > cap_cores then
    return {'fail', u, 'CardInsufficientCore'}
  end
  if excl == 1 and used_slots > 0 then
    return {'fail', u, 'ExclusiveDeviceAllocateConflict'}
  end
  if not restoring and not prepared and cores == 0 and used_cores >= cap_cores then
    return {'fail', u, 'CardComputeUnitsExhausted'}
  end
end
local bad = mig_grants_invalid(rec, seen)
if bad then
  return {'fail', bad, 'InvalidRequest'}
end
-- each grant is on a card of its container's vendor (NVIDIA when the record names none)
for _, c in ipairs(rec.containers) do
  local want = c.vendor
  if want == nil then
    want = 'nvidia'
  end
  for _, g in ipairs(c.devices) do
    if type(want) ~= 'string' or (gget(g.uuid, 'vendor') or 'nvidia') ~= want then
      return {'fail', g.uuid, 'InvalidRequest'}
    end
  end
end

for _, f in ipairs(fp) do
  local u = f[1]
  if f[6] > 0 then
    redis.call('HSET', GPUS, gkey(u, 'mig_used'), bit.bor(gnum(u, 'mig_used'), f[6]))
  end
  redis.call('HINCRBY', GPUS, gkey(u, 'mem'), f[2])
  redis.call('HINCRBY', GPUS, gkey(u, 'cores'), f[3])
  redis.call('HINCRBY', GPUS, gkey(u, 'slots'), f[4])
  if f[5] == 1 then
    redis.call('HSET', GPUS, gkey(u, 'owner'), uid)
  end
end

rec.state = 'reserved'
rec.footprint = fp
rec.allocated_containers = 0
rec.times = {reserved = now_ms()}
if mode == 'allocated' or prepared then
  -- restored from the pod's own record (its containers already run), or a
  -- claim kubelet prepares: kubelet's Allocate never comes for it
  rec.state = 'allocated'
  rec.allocated_containers = #rec.containers
  rec.times.allocated = rec.times.reserved
end
redis.call('ZREM', RELEASED, uid)
local rev = bump()
return {'ok', save_pod(uid, rec), rev}
