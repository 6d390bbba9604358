-- Mark a reserved pod as bound: from now on kubelet may ask to allocate it.
-- ARGV[1] pod uid, ARGV[2] '1' for one pod at a time: refused while another pod
-- bound to the node still waits for kubelet to allocate one of NVIDIA's
-- containers (kubelet's Allocate names no pod: with one such pod, every call is
-- its; with two, a call could be either's), or was released so lately that
-- kubelet may still admit it (a ghost, lib.lua)
-- Returns {'ok', record} | {'absent'} | {'released', record} | {'rebuilding'}
-- | {'busy', uid of the pod the node is taking}
local uid = ARGV[1]
local rec = load_pod(uid)
if not rec then
  if not rebuilt() then
    return {'rebuilding'}  -- Redis lost the reservation; its node is being rebuilt
  end
  return {'absent'}
end
if rec.state == 'released' then
  return {'released', redis.call('HGET', PODS, uid)}
end
if rec.state == 'reserved' then
  if ARGV[2] == '1' and awaits_allocate(rec) then
    local now = now_ms()
    for _, other in ipairs(redis.call('ZRANGE', PENDING, 0, -1)) do
      if other ~= uid and waits(load_pod(other), now) then
        return {'busy', other}
      end
    end
  end
  rec.state = 'bound'
  rec.times.bound = now_ms()
  local seq = redis.call('HINCRBY', META, 'bind_seq', 1)
  redis.call('ZADD', PENDING, seq, uid)
  return {'ok', save_pod(uid, rec)}
end
return {'ok', redis.call('HGET', PODS, uid)}
