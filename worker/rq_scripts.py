"""RQ's records of a batch's start and end, written by two server-side scripts: one command sent a batch.

`rq_batches.py` owns which of RQ's writes a batch makes (and names where in RQ each one comes from);
this module owns sending them. A pipeline of RQ's own calls sends every command over the wire and
makes Python pack each of its arguments (~25 commands and ~170 arguments a job for a start and an
end); the scripts here run the same commands inside Redis, from compact arguments: the job and
execution ids, the batch's shared values (worker name, times, TTLs) once, and per job only what
differs (an end's return value and the job-hash fields whose stored value changes). What RQ keeps is
unchanged, field for field: `tests/service/test_rq_batches.py` compares every record with RQ's own.

Every key a script touches is passed in KEYS (none is built inside), so an ACL key pattern applies to
them as to any command, and every command a script runs is one the worker's ACL user may run
(`deploy/redis/users.acl`: `evalsha` and `script|load`, not `eval`). A script is sent by its SHA
(EVALSHA); a server that does not know it (a restart, SCRIPT FLUSH) is sent the script once
(SCRIPT LOAD) and the call repeated.
"""

from __future__ import annotations

import logging

import redis

from mlxq.worker.server_script import UNPACKED_LUA, ServerScript

log = logging.getLogger(__name__)

# KEYS: started registry, intermediate list, the worker's index of executions; then per job its hash,
# its execution's hash and its executions' registry.
# ARGV: worker name, now (float), now (RQ's date text), heartbeat TTL, execution's registry score and
# TTL, started registry score, the worker's index TTL; then per job its id and its execution's id.
_START = """
local name, at, stamp, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local exec_score, exec_ttl, wip_score, index_ttl = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local composites = {}
local n = (#KEYS - 3) / 3
for i = 1, n do
  local job, execution, executions = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local id, eid = ARGV[7 + 2 * i], ARGV[8 + 2 * i]
  local composite = id .. ':' .. eid
  redis.call('HSET', execution, 'id', eid, 'job_id', id, 'created_at', at, 'last_heartbeat', at,
    'worker_name', name)
  redis.call('EXPIRE', execution, ttl)
  redis.call('ZADD', executions, exec_score, eid)
  redis.call('EXPIRE', executions, exec_ttl)
  redis.call('ZADD', KEYS[1], wip_score, composite)
  redis.call('HSET', job, 'last_heartbeat', stamp, 'status', 'started', 'started_at', stamp,
    'worker_name', name)
  redis.call('PERSIST', job)
  redis.call('LREM', KEYS[2], 1, id)
  composites[i] = composite
end
for from = 1, n, 1000 do
  redis.call('SADD', KEYS[3], unpack(composites, from, math.min(from + 999, n)))
end
redis.call('EXPIRE', KEYS[3], index_ttl)
return n
"""

# KEYS: the worker's hash, its index of executions, started registry, finished registry; then per job
# its hash, its dependents set, its results stream, its execution's hash and its executions' registry.
# ARGV: worker name, now (float), now as a registry score (whole seconds); then per job one argument
# of its values (`server_script.packed`): id, execution id, result TTL, return value (RQ's serialized
# text), execution start (float), working seconds, then the job-hash field/value pairs to write.
# A job with a dependent is left alone (RQ's own end enqueues its dependents): its index is returned.
# A job already `finished` is not ended again: this call sent again after a reply lost on the way, or
# another worker's maintenance that ended it (`end_abandoned`); a second result entry would follow.
_END = (
    UNPACKED_LUA
    + """
local name, at, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local n = (#KEYS - 4) / 5
local ended, working, left = 0, 0, {}
for i = 1, n do
  local k = 4 + 5 * (i - 1)
  local job, dependents, results, execution, executions = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3],
    KEYS[k + 4], KEYS[k + 5]
  local v = unpacked(ARGV[3 + i])
  local id, eid, ttl, value, started, seconds = v[1], v[2], v[3], v[4], v[5], v[6]
  if redis.call('EXISTS', dependents) == 1 then
    left[#left + 1] = i - 1
  elseif redis.call('HGET', job, 'status') ~= 'finished' then
    local composite = id .. ':' .. eid
    if #v > 6 then
      redis.call('HSET', job, unpack(v, 7, #v))
    end
    redis.call('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', name,
      'return_value', value, 'execution_id', eid, 'execution_started_at', started,
      'execution_ended_at', at)
    redis.call('EXPIRE', results, ttl)
    redis.call('ZADD', KEYS[4], now + tonumber(ttl), id)
    redis.call('EXPIRE', job, ttl)
    redis.call('DEL', execution)
    redis.call('ZREM', KEYS[3], composite)
    redis.call('ZREM', executions, eid)
    redis.call('SREM', KEYS[2], composite)
    ended = ended + 1
    working = working + tonumber(seconds)
  end
end
if ended > 0 then
  redis.call('HINCRBY', KEYS[1], 'successful_job_count', ended)
  redis.call('HINCRBYFLOAT', KEYS[1], 'total_working_time', tostring(working))
end
return left
"""
)


START = ServerScript(_START)
END = ServerScript(_END)


def load(conn: redis.Redis) -> None:
    """Send the scripts to the server now, so that a batch's first call is not refused; where Redis is
    not reachable yet, a call loads its script when it is (`ServerScript.run`)."""
    try:
        for script in (START, END):
            conn.script_load(script.source)
    except redis.ConnectionError as e:
        log.warning("could not load the RQ scripts yet error=%s", e)
