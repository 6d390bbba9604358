-- Mark a reserved pod as bound: from now on kubelet may ask to allocate it.
-- ARGV[1] pod uid
-- Returns {'ok', record} | {'absent'} | {'released', record} | {'rebuilding'}
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
  rec.state = 'bound'
  rec.times.bound = now_ms()
  local seq = redis.call('HINCRBY', META, 'bind_seq', 1)
  redis.call('ZADD', PENDING, seq, uid)
  return {'ok', save_pod(uid, rec)}
end
return {'ok', redis.call('HGET', PODS, uid)}
