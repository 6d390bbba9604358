-- A pod's nomination after a preemption, in the one hash of nominations.
-- KEYS[1] <p>:nominations  hash  pod uid -> "<expires ms>|<node>|<token>|<record JSON>"
-- ARGV: uid, node, token, ttl ms, record JSON, the uids of the live nominations
-- on that node the caller counted (comma-separated)
-- Answers {'ok', ''}: stored (new, or the caller's own, same token, replaced);
-- {'held', value}: the pod has a live nomination another call made (use it);
-- {'changed', uid}: a live nomination on the node that the caller did not
-- count (choose again). Expired nominations are removed on the way.
local uid, node, token = ARGV[1], ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function parse(value)
  local expires, on, by = string.match(value, '^(%d+)|([^|]*)|([^|]*)|')
  return tonumber(expires or '0') or 0, on or '', by or ''
end

local existing = redis.call('HGET', KEYS[1], uid)
if existing then
  local expires, _, by = parse(existing)
  if expires > now and by ~= token then
    return {'held', existing}
  end
end
local counted = {}
for seen in string.gmatch(ARGV[6], '[^,]+') do
  counted[seen] = true
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local other, value = all[i], all[i + 1]
  local expires, on = parse(value)
  if expires <= now then
    redis.call('HDEL', KEYS[1], other)
  elseif on == node and other ~= uid and not counted[other] then
    return {'changed', other}
  end
end
redis.call('HSET', KEYS[1], uid, (now + tonumber(ARGV[4])) .. '|' .. node .. '|' .. token .. '|' .. ARGV[5])
return {'ok', ''}
