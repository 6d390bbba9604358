-- Hand the next unallocated container of the oldest bound pod whose next container
-- asks for ARGV[1] devices to kubelet. Idempotent by request id (KEYS[6]).
-- KEYS[6] <p>:{node}:alloc:<request id>  the answer given to that request
-- ARGV[1] device count, ARGV[2] seconds to remember the answer
-- Returns {'ok', answer JSON {uid, index, record}} | {'none', pending count}
local prior = redis.call('GET', KEYS[6])
if prior then
  return {'ok', prior}
end
local want = tonumber(ARGV[1])
local uids = redis.call('ZRANGE', PENDING, 0, -1)
for _, uid in ipairs(uids) do
  local rec = load_pod(uid)
  if not rec or rec.state ~= 'bound' then
    redis.call('ZREM', PENDING, uid)
  else
    local index = rec.allocated_containers + 1
    local container = rec.containers[index]
    if container and #container.devices == want then
      rec.allocated_containers = index
      if index >= #rec.containers then
        rec.state = 'allocated'
        rec.times.allocated = now_ms()
        redis.call('ZREM', PENDING, uid)
      end
      save_pod(uid, rec)
      local answer = cjson.encode({uid = uid, index = index - 1, record = rec})
      redis.call('SET', KEYS[6], answer, 'EX', tonumber(ARGV[2]))
      return {'ok', answer}
    end
  end
end
return {'none', tostring(redis.call('ZCARD', PENDING))}
