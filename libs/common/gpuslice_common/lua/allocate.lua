-- Hand the next unallocated container of the oldest bound pod whose next container
-- asks for ARGV[1] devices to kubelet (NVIDIA's containers only: another vendor's
-- plugin allocates its own). Idempotent by request id (KEYS[6]).
-- KEYS[6] <p>:{node}:alloc:<request id>  the answer given to that request
-- ARGV[1] device count, ARGV[2] seconds to remember the answer, ARGV[3] '1' to
-- only look: the container that would be handed out, nothing changed (kubelet's
-- GetPreferredAllocation comes before its Allocate)
-- Returns {'ok', answer JSON {uid, index, record, rivals}} | {'none', pending count}
-- | {'dra'} (the node serves kubelet through DRA: nothing is allocated here)
-- | {'rebuilding'} (the pods bound here may not all be back yet: no choice is safe)
-- | {'ambiguous', JSON list of the pods it could be}: more than one bound pod's next
-- container asks for that many devices, and kubelet's call names no pod, so
-- no answer is known to be right (binds take one pod per node at a time,
-- bind.lua; two wait together only where that was bypassed: a ledger
-- restored after Redis lost data, binds of an older scheduler)
local peek = ARGV[3] == '1'
local prior = (not peek) and redis.call('GET', KEYS[6])
if prior then
  return {'ok', prior}
end
if dra_node() then
  return {'dra'}  -- its cards go to prepared ResourceClaims only
end
if not rebuilt() then
  return {'rebuilding'}
end
local want = tonumber(ARGV[1])
local found, found_rec, found_index
local rivals = {}
local now = now_ms()
for _, uid in ipairs(redis.call('ZRANGE', PENDING, 0, -1)) do
  local rec = load_pod(uid)
  if not waits(rec, now) then
    if not peek then
      redis.call('ZREM', PENDING, uid)
    end
  else
    local index = rec.allocated_containers + 1
    local container = rec.containers[index]
    -- another vendor's container is allocated by that vendor's plugin, never here
    local ours = container and (container.vendor == nil or container.vendor == 'nvidia')
    if ours and #container.devices == want then
      if found or rec.state ~= 'bound' then
        rivals[#rivals + 1] = uid  -- a ghost may be what kubelet admits: never handed out
      else
        found, found_rec, found_index = uid, rec, index
      end
    end
  end
end
if not found then
  return {'none', tostring(redis.call('ZCARD', PENDING))}
end
if #rivals > 0 then
  if peek then
    return {'none', tostring(redis.call('ZCARD', PENDING))}
  end
  table.insert(rivals, 1, found)
  return {'ambiguous', cjson.encode(rivals)}
end
local rec, index = found_rec, found_index
if not peek then
  rec.allocated_containers = index
  if index >= #rec.containers then
    rec.state = 'allocated'
    rec.times.allocated = now_ms()
    redis.call('ZREM', PENDING, found)
  end
  if not awaits_allocate(rec) then
    bump()  -- the node's turn passes (bind.lua): binds waiting for it hear so
  end
  save_pod(found, rec)
end
local answer = cjson.encode({uid = found, index = index - 1, record = rec, rivals = 0})
if not peek then
  redis.call('SET', KEYS[6], answer, 'EX', tonumber(ARGV[2]))
end
return {'ok', answer}
