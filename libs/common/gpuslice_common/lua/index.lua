-- The pod index KEYS[1] (pod UID -> node), as "<state>:<ms>:<node>" with state
-- claimed | live | released. Every change is a compare-and-swap on this one key,
-- so of two reserves of one pod on two nodes at most one can confirm.
-- ARGV[1] is the operation:
--   claim    ARGV[2] node  -> {'ok', mine, previous} | {'busy', current, age ms}
--   takeover ARGV[2] expected value, ARGV[3] node -> {'ok', mine, previous} | {'busy', current, '0'}
--   confirm  ARGV[2] mine, ARGV[3] node -> 'ok' | current value ('' if none)
--   abandon  ARGV[2] mine -> deletes the index if it still holds mine
--   released ARGV[2] node, ARGV[3] ttl seconds -> marks the pod released on node
local op = ARGV[1]
local cur = redis.call('GET', KEYS[1])

local function parse(v)
  local s, t, n = string.match(v, '^(%a+):(%d+):(.*)$')
  return s, tonumber(t), n
end

local function claim_for(node)
  local mine = 'claimed:' .. now_ms() .. ':' .. node
  redis.call('SET', KEYS[1], mine)
  return mine
end

if op == 'claim' then
  local node = ARGV[2]
  if not cur then
    return {'ok', claim_for(node), ''}
  end
  local s, t, n = parse(cur)
  if s == 'released' then
    return {'ok', claim_for(node), cur}
  end
  if n == node then
    return {'ok', cur, cur}
  end
  return {'busy', cur, tostring(now_ms() - t)}
elseif op == 'takeover' then
  if cur ~= ARGV[2] then
    return {'busy', cur or '', '0'}
  end
  return {'ok', claim_for(ARGV[3]), cur}
elseif op == 'confirm' then
  if cur == ARGV[2] then
    local _, t, n = parse(cur)
    redis.call('SET', KEYS[1], 'live:' .. t .. ':' .. n)
    return 'ok'
  end
  if cur then
    local s, _, n = parse(cur)
    if s == 'live' and n == ARGV[3] then
      return 'ok'
    end
  end
  return cur or ''
elseif op == 'abandon' then
  if cur == ARGV[2] then
    redis.call('DEL', KEYS[1])
  end
  return 'ok'
elseif op == 'released' then
  if cur then
    local _, _, n = parse(cur)
    if n == ARGV[2] then
      redis.call('SET', KEYS[1], 'released:' .. now_ms() .. ':' .. n, 'EX', tonumber(ARGV[3]))
    end
  end
  return 'ok'
end
return redis.error_reply('unknown index operation ' .. tostring(op))
