"""The Lua scripts of ``cascade.redis_store``: each runs atomically inside Redis.

One user's keys are ``items``, ``ts`` and ``sums`` (packed little-endian 64-bit words, one per
event; ``ts`` only for a timed user) and the namespace's ``users`` list. Redis runs a script
whole with nothing in between, and these never fail part-way (every write is an APPEND or RPUSH
to keys only they write), so no reader sees part of an append. Each script first checks that
the three keys agree (``sums`` as long as ``items``, ``ts`` as long or absent) and returns
``TORN`` where they do not: a key lost to an eviction, expiry or ``DEL`` would otherwise give a
new history the old one's sums, hence its version, under which the relay's cache keeps the old
history's K/V.
"""

from __future__ import annotations

# What a script returns (alone, or first) for a user whose keys disagree.
TORN = -2

# KEYS: items, ts, sums, users. ARGV: expected length (bytes), items, timestamps ('' when
# untimed), sums, user id. Returns -1 (nothing written) unless the length is still the expected
# one, TORN (nothing written) where the keys disagree or the timestamps do not match the
# user's kind, else {new length in bytes, all items, all timestamps or false}.
APPEND = """
local n = redis.call('STRLEN', KEYS[1])
local t = redis.call('STRLEN', KEYS[2])
if redis.call('STRLEN', KEYS[3]) ~= n or (t ~= n and t ~= 0) then return -2 end
if n ~= tonumber(ARGV[1]) then return -1 end
if n > 0 and (t == 0) ~= (ARGV[3] == '') then return -2 end
if n == 0 then redis.call('RPUSH', KEYS[4], ARGV[5]) end
redis.call('APPEND', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('APPEND', KEYS[2], ARGV[3]) end
local m = redis.call('APPEND', KEYS[3], ARGV[4])
return {m, redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}
"""
# KEYS: items, ts, sums. ARGV: event counts k (-1: all). Returns {length in bytes, timed,
# then per k: the sum over the first k events ('' for k = 0 or past the end)}.
SUMS = """
local n = redis.call('STRLEN', KEYS[1])
local t = redis.call('STRLEN', KEYS[2])
if redis.call('STRLEN', KEYS[3]) ~= n or (t ~= n and t ~= 0) then return {-2} end
local out = {n, redis.call('EXISTS', KEYS[2])}
for i = 1, #ARGV do
  local k = tonumber(ARGV[i])
  if k < 0 then k = n / 8 end
  if k >= 1 and 8 * k <= n then
    out[#out + 1] = redis.call('GETRANGE', KEYS[3], 8 * (k - 1), 8 * k - 1)
  else out[#out + 1] = '' end
end
if n > 0 and out[2] == 1 then out[#out + 1] = redis.call('GETRANGE', KEYS[2], n - 8, n - 1) end
return out
"""
# KEYS: items, ts, sums. ARGV: k (-1: all). Returns {length in bytes, timed, the first k items,
# their timestamps, the sum over them} ('' for what k = 0 or past the end leaves out).
READ = """
local n = redis.call('STRLEN', KEYS[1])
local t = redis.call('STRLEN', KEYS[2])
if redis.call('STRLEN', KEYS[3]) ~= n or (t ~= n and t ~= 0) then return {-2} end
local k = tonumber(ARGV[1])
if k < 0 then k = n / 8 end
local timed = redis.call('EXISTS', KEYS[2])
if k < 1 or 8 * k > n then return {n, timed, '', '', ''} end
return {n, timed, redis.call('GETRANGE', KEYS[1], 0, 8 * k - 1),
        redis.call('GETRANGE', KEYS[2], 0, 8 * k - 1),
        redis.call('GETRANGE', KEYS[3], 8 * (k - 1), 8 * k - 1)}
"""
