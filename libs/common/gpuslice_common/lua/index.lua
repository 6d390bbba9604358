-- The pod index KEYS[1] (pod UID -> node), as "<state>:<ms>:<token>:<node>" with
-- state claimed | live | released and token naming the reserve call that claimed it.
-- Every change is a compare-and-swap on this one key, so of two reserves of one
-- pod on two nodes at most one can confirm.
-- ARGV[1] is the operation:
--   claim    ARGV[2] node, ARGV[3] token -> {'ok', mine, previous} | {'busy', current, age ms}
--   takeover ARGV[2] expected, ARGV[3] node, ARGV[4] token -> like claim
--   confirm  ARGV[2] mine, ARGV[3] node -> 'ok' | current value ('' if none)
--   abandon  ARGV[2] mine -> deletes the index if it still holds mine
--   release  ARGV[2] expected, ARGV[3] ttl seconds -> 'ok' | current value ('' if none)
local op = ARGV[1]
local cur = redis.call('GET', KEYS[1])

local function age(v)
  local _, t = parse_index(v)
  return tostring(now_ms() - (t or 0))
end

local function claim_for(node, token)
  local mine = 'claimed:' .. now_ms() .. ':' .. token .. ':' .. node
  redis.call('SET', KEYS[1], mine)
  return mine
end

if op == 'claim' then
  local node, token = ARGV[2], ARGV[3]
  if not cur then
    return {'ok', claim_for(node, token), ''}
  end
  local s, _, their_token, n = parse_index(cur)
  if s == 'released' then
    return {'ok', claim_for(node, token), cur}
  end
  if n == node then
    if their_token == token then
      return {'ok', cur, ''}  -- a re-sent claim of this very call
    end
    return {'ok', cur, cur}  -- another call for the same node: share its claim
  end
  return {'busy', cur, age(cur)}
elseif op == 'takeover' then
  if cur ~= ARGV[2] then
    if not cur then
      return {'busy', '', '0'}
    end
    return {'busy', cur, age(cur)}
  end
  return {'ok', claim_for(ARGV[3], ARGV[4]), cur}
elseif op == 'confirm' then
  if cur == ARGV[2] then
    local _, t, token, n = parse_index(cur)
    redis.call('SET', KEYS[1], 'live:' .. t .. ':' .. token .. ':' .. n)
    return 'ok'
  end
  if cur then
    local s, _, _, n = parse_index(cur)
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
elseif op == 'release' then
  if cur ~= ARGV[2] then
    return cur or ''
  end
  local _, _, token, n = parse_index(cur)
  redis.call('SET', KEYS[1], 'released:' .. now_ms() .. ':' .. token .. ':' .. n,
    'EX', tonumber(ARGV[3]))
  return 'ok'
end
return redis.error_reply('unknown index operation ' .. tostring(op))
