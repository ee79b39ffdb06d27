"""The Lua scripts of :class:`~sagaguard.idempotency.stores.redis.RedisStore`, one per primitive.

Each works on one record, the hash ``KEYS[1]``, so it runs atomically in one hash slot. ``ARGV[1]``
is the injected clock's reading, or empty for Redis's own ``TIME``. Numbers are written with
``%.17g`` so that Python's ``float()`` reads back the very same double. Each script answers with a
JSON array: a marker (``claimed``, ``took_over``, ``existing``, ``ok``, ``deleted``, or ``lost``
with the state and token that refused a fenced write), then the record's fields in
:data:`FIELDS` order where it has them.
"""

from __future__ import annotations

__all__ = ["CLAIM", "COMPLETE", "FAIL", "FIELDS", "HEARTBEAT", "PURGE", "TAKE_OVER"]

FIELDS = (
    "namespace", "scope", "name", "ordinal", "fingerprint", "state", "token",
    "lease_until", "attempts", "created_at", "updated_at", "expires_at", "result", "error", "holder",
    "result_type",
)  # fmt: skip
"""Hash fields in reply order. The Lua below indexes them from 1: state is r[6], token r[7]..."""

_HMGET_ALL = "redis.call('HMGET', k, " + ", ".join(f"'{f}'" for f in FIELDS) + ")"

# Every script starts here: ``now`` is the injected clock's reading (ARGV[1]) or Redis's TIME,
# and ``f`` prints a number so that Python's float() reads back the very same double (%.17g
# round-trips; Lua's default %.14g would lose the microseconds).
_NOW = """
local k = KEYS[1]
local now = tonumber(ARGV[1])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local function f(x) return string.format('%.17g', x) end
"""

# The fence of every write after the claim: the caller's token must be the record's and the record
# must still be live. Python turns the marker into LostOwnership with the reason.
_FENCE = """
if not (st == 'in_progress' or st == 'in_doubt') or tonumber(tk) ~= tonumber(ARGV[2]) then
  return cjson.encode({'lost', st or false, tk or false})
end
"""

# ARGV: now, lease, namespace, name, fingerprint, scope, ordinal, first_token (random, from Python:
# a new record starts there; a replaced or taken-over one counts on from its own token), holder,
# result_type (empty: none declared; a take-over keeps the recorded one then).
# Tokens stay strings in the reply: cjson prints numbers with 14 digits, which would round a
# 15-digit token.
CLAIM = (
    _NOW
    # A new key (the common case) has no fields to read: EXISTS is cheaper than HMGET's sixteen.
    + f"local r = {{}}\nif redis.call('EXISTS', k) == 1 then r = {_HMGET_ALL} end\n"
    + """
local st = r[6]
if not st or ((st == 'succeeded' or st == 'failed') and r[12] and tonumber(r[12]) <= now) then
  local tok, n, lu = ARGV[8], f(now), f(now + tonumber(ARGV[2]))
  if st and tonumber(r[7]) then tok = f(tonumber(r[7]) + 1) end
  -- DEL drops the old result, error, expires_at and TTL at once: a live record has no TTL.
  if st then redis.call('DEL', k) end
  redis.call('HSET', k, 'namespace', ARGV[3], 'scope', ARGV[6], 'name', ARGV[4],
    'ordinal', ARGV[7], 'fingerprint', ARGV[5], 'state', 'in_progress', 'token', tok,
    'lease_until', lu, 'attempts', 1, 'created_at', n, 'updated_at', n, 'holder', ARGV[9])
  local rt = false
  if ARGV[10] ~= '' then rt = ARGV[10]; redis.call('HSET', k, 'result_type', rt) end
  return cjson.encode({'claimed', ARGV[3], ARGV[6], ARGV[4], ARGV[7], ARGV[5], 'in_progress',
    tok, lu, 1, n, n, false, false, false, ARGV[9], rt})
end
if (st == 'in_progress' or st == 'in_doubt') and tonumber(r[8]) <= now and r[5] == ARGV[5] then
  -- A live record never has a TTL (only finishing sets one), so no PERSIST is needed here.
  r[6], r[7], r[8], r[9], r[11], r[15] = 'in_doubt', f(tonumber(r[7]) + 1),
    f(now + tonumber(ARGV[2])), tonumber(r[9]) + 1, f(now), ARGV[9]
  redis.call('HSET', k, 'state', r[6], 'token', r[7], 'lease_until', r[8], 'attempts', r[9],
    'updated_at', r[11], 'holder', r[15])
  if ARGV[10] ~= '' then r[16] = ARGV[10]; redis.call('HSET', k, 'result_type', r[16]) end
  table.insert(r, 1, 'took_over')
  return cjson.encode(r)
end
table.insert(r, 1, 'existing')
return cjson.encode(r)
"""
)

# ARGV: now, token, result, retention, ttl_ms (empty: no TTL). The reply leaves out the result,
# which the caller already holds.
COMPLETE = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
r[6], r[11], r[12] = 'succeeded', f(now), f(now + tonumber(ARGV[4]))
redis.call('HSET', k, 'state', r[6], 'result', ARGV[3], 'expires_at', r[12], 'updated_at', r[11])
if r[14] then redis.call('HDEL', k, 'error') end
if ARGV[5] ~= '' then redis.call('PEXPIRE', k, ARGV[5]) end
r[13], r[14] = false, false
table.insert(r, 1, 'ok')
return cjson.encode(r)
"""
)

# ARGV: now, token, disposition, error, retention, ttl_ms. The reply leaves out the error.
FAIL = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
if ARGV[3] == 'retryable' then redis.call('DEL', k); return '["deleted"]' end
r[11] = f(now)
if ARGV[3] == 'permanent' then
  r[6], r[12] = 'failed', f(now + tonumber(ARGV[5]))
  redis.call('HSET', k, 'state', r[6], 'error', ARGV[4], 'expires_at', r[12], 'updated_at', r[11])
  if ARGV[6] ~= '' then redis.call('PEXPIRE', k, ARGV[6]) end
else
  r[6], r[8] = 'in_doubt', '0'
  redis.call('HSET', k, 'state', r[6], 'error', ARGV[4], 'lease_until', '0', 'updated_at', r[11])
end
r[14] = false
table.insert(r, 1, 'ok')
return cjson.encode(r)
"""
)

# ARGV: now, token, lease, holder. Compare-and-set on the token, the lease not looked at: the caller
# found the holder dead (see RedisStore.take_over). A refusal answers 'lost', and Python None.
TAKE_OVER = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
r[6], r[7], r[8], r[9], r[11], r[15] = 'in_doubt', f(tonumber(r[7]) + 1), f(now + tonumber(ARGV[3])),
  tonumber(r[9]) + 1, f(now), ARGV[4]
redis.call('HSET', k, 'state', r[6], 'token', r[7], 'lease_until', r[8], 'attempts', r[9],
  'updated_at', r[11], 'holder', r[15])
table.insert(r, 1, 'took_over')
return cjson.encode(r)
"""
)

# ARGV: now, token, lease.
HEARTBEAT = (
    _NOW
    + "local st, tk = unpack(redis.call('HMGET', k, 'state', 'token'))\n"
    + _FENCE
    + """
local lu = f(now + tonumber(ARGV[3]))
redis.call('HSET', k, 'lease_until', lu, 'updated_at', f(now))
return cjson.encode({'ok', lu})
"""
)

# ARGV: now. Checks again inside the script: a record claimed afresh since the scan survives.
PURGE = (
    _NOW
    + """
local st, ea = unpack(redis.call('HMGET', k, 'state', 'expires_at'))
if (st == 'succeeded' or st == 'failed') and ea and tonumber(ea) <= now then
  return redis.call('DEL', k)
end
return 0
"""
)

