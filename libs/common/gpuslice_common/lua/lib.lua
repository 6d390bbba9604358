-- Prelude shared by every ledger script.
-- KEYS[1] <p>:{node}:gpus     hash  "<uuid>|<field>" -> value
-- KEYS[2] <p>:{node}:meta     hash  devices (JSON list), heartbeat, registered, rebuilt,
--                                   epoch, config, bind_seq, rev
-- KEYS[3] <p>:{node}:pods     hash  pod uid -> placement record (JSON)
-- KEYS[4] <p>:{node}:pending  zset  pod uid -> bind order, pods awaiting Allocate
-- KEYS[5] <p>:{node}:released zset  pod uid -> release time (ms), for pruning
local GPUS, META, PODS, PENDING, RELEASED = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function gkey(uuid, field)
  return uuid .. '|' .. field
end

local function gget(uuid, field)
  return redis.call('HGET', GPUS, gkey(uuid, field))
end

local function gnum(uuid, field)
  return tonumber(gget(uuid, field) or '0') or 0
end

local function load_pod(uid)
  local raw = redis.call('HGET', PODS, uid)
  if not raw then
    return nil
  end
  return cjson.decode(raw)
end

local function save_pod(uid, rec)
  local raw = cjson.encode(rec)
  redis.call('HSET', PODS, uid, raw)
  return raw
end

-- Whether a pod record has a container left that kubelet allocates through
-- gpuslice (NVIDIA's: another vendor's plugin allocates its own).
local function awaits_allocate(rec)
  for i = (rec.allocated_containers or 0) + 1, #rec.containers do
    local vendor = rec.containers[i].vendor
    if vendor == nil or vendor == 'nvidia' then
      return true
    end
  end
  return false
end

-- A pod released while kubelet might still be admitting it (bound, a container
-- of ours not yet allocated: deleted before kubelet got to it, as kubelet
-- lagging its watch may still admit it) stays in PENDING this long as a ghost:
-- it holds the node's turn, and an Allocate it could be meant by is ambiguous
local GHOST_MS = 30000

-- Whether a record in PENDING waits for kubelet's Allocate: bound with a
-- container of ours left, or such a pod's ghost (released within GHOST_MS)
local function waits(rec, now)
  if not rec or not awaits_allocate(rec) then
    return false
  end
  if rec.state == 'bound' then
    return true
  end
  return rec.state == 'released' and (rec.times.released or 0) + GHOST_MS > now
end

-- Every change to a node's cards or usage bumps its revision and announces the
-- node's meta key on <p>:changes, so readers that keep a copy re-read only the
-- nodes that changed.
local function bump()
  local rev = redis.call('HINCRBY', META, 'rev', 1)
  local prefix = string.match(META, '^(.*):{[^}]*}:meta$')
  if prefix then
    redis.call('PUBLISH', prefix .. ':changes', META)
  end
  return rev
end

-- A whole number Redis takes as one: Lua prints it in plain digits (not -0, inf,
-- nan, a fraction, nor 1e+14 and up, which it prints with an exponent).
local function is_count(v)
  return type(v) == 'number' and string.match(tostring(v), '^%d+$') ~= nil
end

-- A pod index value "<state>:<ms>:<token>:<node>" (index.lua); all nil when it
-- is not one.
local function parse_index(v)
  local s, t, token, n = string.match(v, '^(%a+):(%d+):([%w]*):(.*)$')
  return s, tonumber(t), token, n
end

-- The ledger's epoch: the replication id of the primary running this script.
-- It changes whenever the data may have lost acknowledged writes: a replica
-- promoted by a failover (replication is asynchronous) or a server restarted
-- (from an append-only file that may miss its last second).
local function epoch()
  return string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or ''
end

-- A node takes reservations, binds and allocations only once a reconciliation
-- pass that started after its registration stamped it ``rebuilt`` in this
-- epoch (rebuilt.lua): after Redis lost data, whole or the last writes, the
-- placements its pods already hold are back first.
local function rebuilt()
  local stamp = redis.call('HMGET', META, 'rebuilt', 'epoch')
  return stamp[1] ~= false and stamp[2] == epoch()
end

-- Whether the node's agent serves kubelet through DRA (register.lua): its cards
-- are then granted by prepared ResourceClaims only, never by kubelet's Allocate.
local function dra_node()
  return redis.call('HGET', META, 'dra') == '1'
end

-- MIG slice masks have at most 16 bits (models.MAX_MIG_SLICES): Lua's bit
-- operations work on signed 32-bit numbers and never see a sign bit here.
local MIG_MASK_LIMIT = 65536

-- The first card (its UUID) on which a reservation record's MIG grants are not
-- what the card makes, or nil when every grant is: each grant on a card in mode
-- mig names a profile of the card at one of its placements, books exactly the
-- profile's memory and cores, and the grants on a card make up its footprint's
-- mask (``masks``: card -> mask from the footprint); a card not in mode mig
-- has no MIG grant.
local function mig_grants_invalid(rec, masks)
  local union = {}
  for _, c in ipairs(rec.containers) do
    if type(c) ~= 'table' or type(c.devices) ~= 'table' then
      return ''
    end
    for _, g in ipairs(c.devices) do
      if type(g) ~= 'table' or type(g.uuid) ~= 'string' or masks[g.uuid] == nil then
        return ''
      end
      local u = g.uuid
      local mig = gget(u, 'mode') == 'mig'
      if (type(g.mig) == 'table') ~= mig then
        return u
      end
      if mig then
        local p = g.mig.placement
        if type(p) ~= 'table' or not is_count(p.start) or not is_count(p.size)
            or p.size < 1 or p.start + p.size > 16 then
          return u
        end
        local found = false
        local ok, profiles = pcall(cjson.decode, gget(u, 'mig_profiles') or '')
        if not ok or type(profiles) ~= 'table' then
          return u
        end
        for _, prof in ipairs(profiles) do
          if prof[1] == g.mig.profile and prof[2] == g.memory_mib and prof[3] == g.cores then
            for _, q in ipairs(prof[5]) do
              if q[1] == p.start and q[2] == p.size then
                found = true
              end
            end
          end
        end
        if not found then
          return u
        end
        local mask = (2 ^ p.size - 1) * 2 ^ p.start
        if bit.band(union[u] or 0, mask) ~= 0 then
          return u
        end
        union[u] = bit.bor(union[u] or 0, mask)
      end
    end
  end
  for u, mask in pairs(masks) do
    if (union[u] or 0) ~= mask then
      return u
    end
  end
  return nil
end
