-- Release a pod's devices. Idempotent: a second call reports 'already'.
-- ARGV[1] pod uid, ARGV[2] reason, ARGV[3] ms to keep released records, ARGV[4]
-- '0' where kubelet cannot be admitting the pod (no Binding was made): no ghost
-- Returns {'ok', record, clamped} | {'already', record} | {'absent'}
local uid = ARGV[1]
local rec = load_pod(uid)
if not rec then
  return {'absent'}
end
if rec.state == 'released' then
  return {'already', redis.call('HGET', PODS, uid)}
end
local clamped = 0
for _, f in ipairs(rec.footprint) do
  local u = f[1]
  for i, field in ipairs({'mem', 'cores', 'slots'}) do
    local left = gnum(u, field) - f[i + 1]
    if left < 0 then
      left = 0
      clamped = clamped + 1
    end
    if gget(u, 'present') then
      redis.call('HSET', GPUS, gkey(u, field), left)
    end
  end
  local mask = tonumber(f[6]) or 0  -- absent in records written before MIG
  if mask > 0 and gget(u, 'present') then
    redis.call('HSET', GPUS, gkey(u, 'mig_used'), bit.band(gnum(u, 'mig_used'), bit.bnot(mask)))
  end
  if gget(u, 'owner') == uid then
    redis.call('HSET', GPUS, gkey(u, 'owner'), '')
  end
end
local now = now_ms()
local ghost = rec.state == 'bound' and awaits_allocate(rec) and ARGV[4] ~= '0'
rec.state = 'released'
rec.times.released = now
rec.release_reason = ARGV[2]
local raw = save_pod(uid, rec)
if not ghost then  -- a ghost stays in PENDING (lib.lua), dropped there once it lapses
  redis.call('ZREM', PENDING, uid)
end
redis.call('ZADD', RELEASED, now, uid)
local old = redis.call('ZRANGEBYSCORE', RELEASED, '-inf', now - tonumber(ARGV[3]), 'LIMIT', 0, 64)
for _, gone in ipairs(old) do
  local r = load_pod(gone)
  if r and r.state == 'released' then
    redis.call('HDEL', PODS, gone)
  end
  redis.call('ZREM', RELEASED, gone)
end
bump()
return {'ok', raw, tostring(clamped)}
