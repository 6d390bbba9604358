-- Claim the pod index KEYS[6], reserve on the node and confirm the claim in one
-- script, for a Redis where the index and the node's keys are on one server (not
-- Redis Cluster): index.lua's claim, reserve.lua (run here as reserve()) and
-- index.lua's confirm, storing the same values and giving the same reply as the
-- three in turn.
-- ARGV[1..4] as reserve.lua, ARGV[5] the claim's token, ARGV[6] the node
-- Returns what reserve.lua returns, or {'fallback'} having changed nothing when the
-- index names another node or cannot be read: the three steps decide those (is
-- the pod live there, a release there to finish, a stale claim to take over).
local INDEX, token, node = KEYS[6], ARGV[5], ARGV[6]
if not string.match(token, '^%w+$') or not string.match(node, '^%w[%w.-]*$') then
  return redis.error_reply('claim_reserve: not a token and a node name a reserve sends')
end
local cur = redis.call('GET', INDEX)
local claim, shared = nil, false  -- the claim this call confirms (nil: a fresh one)
if cur then
  local s, _, their_token, n = parse_index(cur)
  if n ~= node then
    return {'fallback'}
  end
  if s ~= 'released' then  -- this node's claim or reservation: ours if re-sent, else shared
    claim, shared = cur, their_token ~= token
  end
end

local reply = reserve()
if reply[1] ~= 'ok' and reply[1] ~= 'exists' then
  if cur and not shared then
    redis.call('DEL', INDEX)  -- the claim abandoned, as index.lua's abandon
  end
  return reply
end
local t, tok = now_ms(), token
if claim then
  t, tok = select(2, parse_index(claim))
end
redis.call('SET', INDEX, 'live:' .. t .. ':' .. tok .. ':' .. node)
return reply
