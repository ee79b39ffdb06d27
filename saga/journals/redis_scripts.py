"""The Lua scripts of :class:`~sagaguard.saga.journals.redis.RedisJournal`, one per primitive.

Each works on the keys of one saga (``KEYS``: the saga hash, its steps hash, its signals hash), so
it runs atomically in one hash slot. ``ARGV[1]`` is the injected clock's reading, or empty for
Redis's own ``TIME``. Numbers are written with ``%.17g`` so that Python's ``float()`` reads back the
very same double.
"""

from __future__ import annotations

from sagaguard.saga.lease import KEPT_WITHIN

__all__ = [
    "CANCEL", "CLAIM", "COMMIT", "FIELDS", "INDEX_CAS", "LOAD", "ORPHAN_GRACE", "REOPEN", "SIGNAL",
    "START", "TAKE_OVER",
]  # fmt: skip

FIELDS = (
    "name", "version", "fingerprint", "input", "state", "token", "lease_until", "created_at",
    "updated_at", "error", "deadline", "recoveries", "waiting_for", "wait_until", "cancel", "holder",
)  # fmt: skip
"""Saga hash fields in reply order; the Lua below indexes them from 1 (state is r[5]). A hash
written before holders were recorded has no ``holder``: it reads as None (unknown). START's answer
for a saga it creates lists them by hand: a field added here is added there too (the journal
contract's ``test_every_start_and_commit_answers_what_a_load_reads_back`` fails otherwise)."""

ORPHAN_GRACE = 60.0
"""Seconds an index entry of a saga that does not exist (yet) is kept: a start lowers the entry a
moment before its script creates the saga, so the sweep must not drop it at first sight."""

_HMGET = "redis.call('HMGET', KEYS[1], " + ", ".join(f"'{f}'" for f in FIELDS) + ")"

_PRELUDE = (
    """
local now = tonumber(ARGV[1])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local function f(x) return string.format('%.17g', x) end
local function resumable(st) return st == 'running' or st == 'compensating' or st == 'waiting' end
local function live(st) return st == 'running' or st == 'compensating' end
local function snapshot(marker)
  return {marker, """
    + _HMGET
    + """, redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3])}
end
local function take(r, lease, holder)
  local waking = r[5] == 'waiting'
  redis.call('HSET', KEYS[1], 'token', tonumber(r[6]) + 1, 'lease_until', f(now + lease),
    'updated_at', f(now), 'state', waking and 'running' or r[5],
    'recoveries', tonumber(r[12]) + (waking and 0 or 1), 'holder', holder)
end
local r = """
    + _HMGET
    + "\n"
)

# KEYS: saga, steps, signals. ARGV: now, name, version, fingerprint, input, lease, timeout, holder,
# then optionally the first step's (index, row JSON), written only with a saga this start creates.
START = (
    _PRELUDE
    + """
if not r[5] then
  local timeout, at, steps = tonumber(ARGV[7]), f(now), {}
  local lease_until, deadline = f(now + tonumber(ARGV[6])), timeout > 0 and f(now + timeout) or '0'
  redis.call('HSET', KEYS[1], 'name', ARGV[2], 'version', ARGV[3], 'fingerprint', ARGV[4],
    'input', ARGV[5], 'state', 'running', 'token', '1', 'lease_until', lease_until,
    'created_at', at, 'updated_at', at, 'deadline', deadline, 'recoveries', '0', 'wait_until', '0',
    'cancel', '0', 'holder', ARGV[8])
  if ARGV[9] then
    steps = {ARGV[9], ARGV[10], ARGV[9] .. ':s', at, ARGV[9] .. ':u', at}
    redis.call('HSET', KEYS[2], unpack(steps))
  end
  -- What snapshot('created') would read back, without reading it: the fields just written in
  -- FIELDS order, this step, and no signal (a signal to a saga that does not exist is refused).
  return {'created', {ARGV[2], ARGV[3], ARGV[4], ARGV[5], 'running', '1', lease_until, at, at,
    false, deadline, '0', false, '0', '0', ARGV[8]}, steps, {}}
end
if resumable(r[5]) and tonumber(r[7]) <= now and r[1] == ARGV[2] and r[2] == ARGV[3]
    and r[3] == ARGV[4] then
  take(r, tonumber(ARGV[6]), ARGV[8])
  return snapshot('took_over')
end
return snapshot('existing')
"""
)

# KEYS: saga, steps, signals. ARGV: now, lease, holder.
CLAIM = (
    _PRELUDE
    + """
if r[5] and resumable(r[5]) and tonumber(r[7]) <= now then
  take(r, tonumber(ARGV[2]), ARGV[3])
  return snapshot('claimed')
end
return {'not_due'}
"""
)

# KEYS: saga, steps, signals. ARGV: now, token, lease, holder. A dead holder's live saga, fenced
# on the token the caller read (the lease not looked at: the caller proved the holder dead).
TAKE_OVER = (
    _PRELUDE
    + """
if r[5] and live(r[5]) and tonumber(r[6]) == tonumber(ARGV[2]) then
  take(r, tonumber(ARGV[3]), ARGV[4])
  return snapshot('taken')
end
return {'no'}
"""
)

# KEYS: saga, steps, signals. ARGV: now (or ''), then nothing: a consistent read of the three keys.
LOAD = _PRELUDE + "\nif not r[5] then return {'unknown'} end\nreturn snapshot('ok')\n"

# KEYS: saga, steps, signals. ARGV: now, token, lease, state ('' keeps it), has_error, error,
# waiting_for, wait_until, wake_at, wake_on_cancel, unless_cancelled, then pairs of (step index,
# step row JSON).
COMMIT = (
    _PRELUDE
    + """
if not r[5] or not live(r[5]) or tonumber(r[6]) ~= tonumber(ARGV[2]) then
  return {'lost', r[5] or false, r[6] or false}
end
local lease = tonumber(ARGV[3])
local lease_until = '0'
if lease > 0 then
  -- lease.renewed: a lease already ending in the last fifth of the one asked for is kept
  local held = tonumber(r[7])
  if held > now + lease * """
    + repr(1 - KEPT_WITHIN)
    + """ and held <= now + lease then lease_until = r[7] else lease_until = f(now + lease) end
end
local state = ARGV[4]
if ARGV[11] == '1' then
  -- completing unless a cancellation is pending: then the saga stays RUNNING, its lease renewed
  if r[15] == '1' then state = '' else lease_until = '0' end
end
if state == 'waiting' then
  if (r[15] == '1' and ARGV[10] == '1') or redis.call('HEXISTS', KEYS[3], ARGV[7]) == 1 then
    lease_until = f(now)
  else
    lease_until = ARGV[9]
  end
  r[13], r[14] = ARGV[7], ARGV[8]
  redis.call('HSET', KEYS[1], 'waiting_for', ARGV[7], 'wait_until', ARGV[8])
end
local at = f(now)
r[7], r[9] = lease_until, at
if state == '' then
  redis.call('HSET', KEYS[1], 'lease_until', lease_until, 'updated_at', at)
elseif ARGV[5] == '1' then
  r[5], r[10] = state, ARGV[6]
  redis.call('HSET', KEYS[1], 'lease_until', lease_until, 'updated_at', at, 'state', state,
    'error', ARGV[6])
else
  r[5] = state
  redis.call('HSET', KEYS[1], 'lease_until', lease_until, 'updated_at', at, 'state', state)
  if r[10] then r[10] = false; redis.call('HDEL', KEYS[1], 'error') end
end
for i = 12, #ARGV, 2 do
  local idx = ARGV[i]
  redis.call('HSETNX', KEYS[2], idx .. ':s', at)
  redis.call('HSET', KEYS[2], idx, ARGV[i + 1], idx .. ':u', at)
end
-- the saga's fields as this script left them: r, read above and kept up to date with each write
return {'ok', r}
"""
)

# KEYS: saga, signals. ARGV: now, name, payload.
SIGNAL = (
    _PRELUDE
    + """
if not r[5] then return 'unknown' end
if not resumable(r[5]) then return 'too_late' end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return 'duplicate' end
if r[5] == 'waiting' and r[13] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'lease_until', f(now), 'updated_at', f(now))
end
return 'delivered'
"""
)

# KEYS: saga, steps. ARGV: now, cause. The rule of decisions.cancel_outcome: too late once the pivot
# (or a step after it) has a row not marked not applied.
CANCEL = (
    _PRELUDE
    + """
if not r[5] then return 'unknown' end
if not resumable(r[5]) then return 'too_late' end
if r[15] == '1' or r[5] == 'compensating' then return 'already' end
local rows = redis.call('HGETALL', KEYS[2])
for i = 1, #rows, 2 do
  if not string.find(rows[i], ':', 1, true) then
    local row = cjson.decode(rows[i + 1])
    if row.kind ~= 'compensatable' and not row.not_applied then return 'too_late' end
  end
end
redis.call('HSET', KEYS[1], 'cancel', '1', 'error', ARGV[2], 'updated_at', f(now))
if r[5] == 'waiting' then redis.call('HSET', KEYS[1], 'lease_until', f(now)) end
return 'requested'
"""
)

# KEYS: saga, steps, signals. ARGV: now, token, state, has_error, error, then pairs of (step index,
# step row JSON). An operator's reopen of a saga that needs attention: due at once.
REOPEN = (
    _PRELUDE
    + """
if r[5] ~= 'needs_attention' or tonumber(r[6]) ~= tonumber(ARGV[2]) then return {'no'} end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'token', tonumber(r[6]) + 1, 'lease_until', f(now),
  'updated_at', f(now), 'recoveries', 0)
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'error', ARGV[5])
else redis.call('HDEL', KEYS[1], 'error') end
for i = 6, #ARGV, 2 do
  local idx = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], idx .. ':s') == 0 then
    redis.call('HSET', KEYS[2], idx .. ':s', f(now))
  end
  redis.call('HSET', KEYS[2], idx, ARGV[i + 1], idx .. ':u', f(now))
end
return {'ok', """
    + _HMGET
    + """}
"""
)

# KEYS: due index. ARGV: member, expected score, new score ('' removes). Compare and set.
INDEX_CAS = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then return redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
