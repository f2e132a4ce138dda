"""Fault injection for runtime rule 7 (validate before the first write).

`instrument(source)` rewrites a script so that each of its steps (a `redis.call`, a
`redis.pcall`, a cjson encode or decode) goes through a probe first. The probe can
record the steps in a test key (`TRACE_KEY`, trace mode) and can make the k-th step
fail (`fail_at`): a call or codec step raises, as a refusal (an ACL, a full Redis, a
value Lua cannot encode) would; a pcall step answers with an error reply, as a denied
PUBLISH would. `StepTrace` then says whether a run kept the rule: after its first write,
only writes and hints.

Test-only: the rewriting is of the text, so the scripts themselves carry no probe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TRACE_KEY = "effectmq-test:trace"
# The commands the scripts use that write (Redis's own `write` flag).
WRITES = frozenset({
    "HSET", "HSETNX", "HDEL", "HINCRBY", "ZADD", "ZREM", "ZREMRANGEBYRANK", "ZREMRANGEBYSCORE", "ZREMRANGEBYLEX", "DEL",
    "SET", "INCR", "INCRBY", "XADD", "RPUSH", "EXPIRE", "PEXPIRE", "SETEX", "PSETEX", "UNLINK",
})

_PROBE = """\
local __FAIL_AT, __TRACE = {fail_at}, {trace}
local __step_no = 0
local __WRITES = {{{writes}}}
if __TRACE == 1 then redis.call('RPUSH', '{trace_key}', 'begin') end
local function __step(kind)
  __step_no = __step_no + 1
  if __TRACE == 1 then redis.call('RPUSH', '{trace_key}', kind) end
  return __step_no == __FAIL_AT
end
local function __call(command, ...)
  local name = string.upper(command)
  if __step((__WRITES[name] and 'write:' or 'read:') .. name) then
    error('injected fault at step ' .. __step_no .. ' (' .. name .. ')')
  end
  return redis.call(command, ...)
end
local function __pcall(command, ...)
  if __step('hint:' .. string.upper(command)) then
    return redis.error_reply('NOPERM injected fault at step ' .. __step_no)
  end
  return redis.pcall(command, ...)
end
local function __decode(text)
  if __step('codec:decode') then error('injected fault at step ' .. __step_no .. ' (decode)') end
  return cjson.decode(text)
end
local function __encode(value)
  if __step('codec:encode') then error('injected fault at step ' .. __step_no .. ' (encode)') end
  return cjson.encode(value)
end
"""


def instrument(source: str, *, fail_at: int = 0, trace: bool = False) -> str:
    """`source` with every step through the probe; `fail_at` = 0 injects nothing."""
    body = source.replace("redis.pcall(", "__pcall(").replace("redis.call(", "__call(")
    body = re.sub(r"\bcjson\.decode\b", "__decode", body)
    body = re.sub(r"\bcjson\.encode\b", "__encode", body)
    writes = ", ".join(f"{name} = true" for name in sorted(WRITES))
    probe = _PROBE.format(fail_at=int(fail_at), trace=1 if trace else 0, writes=writes, trace_key=TRACE_KEY)
    # A script that starts with a shebang keeps it first.
    if body.startswith("#!"):
        first, rest = body.split("\n", 1)
        return first + "\n" + probe + rest
    return probe + body


@dataclass(frozen=True)
class StepTrace:
    steps: tuple[str, ...]  # "read:HMGET", "write:ZREM", "hint:PUBLISH", "codec:encode", ...

    @classmethod
    def parse(cls, raw: list) -> "StepTrace":
        return cls(tuple(s.decode() if isinstance(s, bytes) else s for s in raw))

    @property
    def first_write(self) -> int:
        """The 1-based step of the first write; len+1 when the run wrote nothing."""
        for i, step in enumerate(self.steps, 1):
            if step.startswith("write:"):
                return i
        return len(self.steps) + 1

    def violations(self) -> list[str]:
        """Steps after the first write that could fail: reads, codecs (hints and writes may come)."""
        return [f"step {i} {step}" for i, step in enumerate(self.steps, 1)
                if i > self.first_write and not step.startswith(("write:", "hint:"))]

    def hints(self) -> list[int]:
        return [i for i, step in enumerate(self.steps, 1) if step.startswith("hint:")]


STATES = ("waiting", "delayed", "active", "completed", "failed", "canceled")


async def snapshot(client) -> dict[bytes, Any]:
    """Every key (but the trace) as its type and contents: equal snapshots mean nothing was
    written. (Not DUMP: a large hash or set dumps in its table's order, which a RESTORE
    may change.)"""
    out: dict[bytes, Any] = {}
    async for key in client.scan_iter(count=1000):
        if key == TRACE_KEY.encode():
            continue
        kind = (await client.type(key)).decode()
        if kind == "hash":
            value: Any = await client.hgetall(key)
        elif kind == "zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == "string":
            value = await client.get(key)
        elif kind == "list":
            value = await client.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(await client.smembers(key))
        elif kind == "stream":
            value = await client.xrange(key)
        else:
            value = await client.dump(key)
        out[key] = (kind, value)
    return out


async def dump_all(client) -> dict[bytes, bytes]:
    """Every key (but the trace) as DUMPed, for `restore`."""
    out = {}
    async for key in client.scan_iter(count=1000):
        if key != TRACE_KEY.encode():
            out[key] = await client.dump(key)
    return out


async def restore(client, dumps: dict[bytes, bytes]) -> None:
    """The keyspace as `dump_all` took it (without TTLs: none taken here matters within a test)."""
    await client.flushdb()
    for key, data in dumps.items():
        await client.restore(key, 0, data, replace=True)


async def queue_invariants(client, base: bytes) -> dict[str, tuple]:
    """Check what every step of the model-based test checks, from Redis alone, and return a
    summary per task (state, attempt, failures, stalls) to compare runs by.

    Every task record is in exactly the index of its state (a waiting task may be parked
    instead: lua/includes/group_caps.lua); every index entry has a record; a token iff
    active; counters are integers >= 0; the history is JSON whose stored entry sizes add
    up; each group's count of waiting tasks, and of attempts running once counting began,
    is what the tasks say."""
    indexes = {s: set(await client.zrange(base + s.encode(), 0, -1)) for s in STATES}
    parked = {m.split(b"\0", 1)[1][16:]: m.split(b"\0", 1)[0] for m in await client.zrange(base + b"backlog", 0, -1)}
    counting_from = await client.hget(base + b"meta", "group_caps")
    waiting_in: dict[bytes, int] = {}
    active_in: dict[bytes, int] = {}
    summary: dict[str, tuple] = {}
    prefix = base + b"t:"
    async for key in client.scan_iter(match=prefix.replace(b"[", b"\\[") + b"*", count=1000):
        tid = key[len(prefix):]
        h = await client.hgetall(key)
        state = h.get(b"state", b"").decode()
        member_of = [s for s in STATES if tid in indexes[s]] + (["parked"] if tid in parked else [])
        if member_of == ["parked"] and state == "waiting":
            assert parked[tid] == h.get(b"group"), f"task {tid!r} parked under {parked[tid]!r}"
        else:
            assert member_of == [state], f"task {tid!r} state {state!r} but in indexes {member_of}"
        group = h.get(b"group")
        if group and tid in indexes["waiting"]:
            waiting_in[group] = waiting_in.get(group, 0) + 1
        token = h.get(b"token") or b""
        if group and state == "active" and counting_from is not None and int(token.rsplit(b":", 1)[1]) > int(
                counting_from):
            active_in[group] = active_in.get(group, 0) + 1
        assert bool(h.get(b"token")) == (state == "active"), f"task {tid!r} {state} token {h.get(b'token')!r}"
        counters = tuple(int(h.get(f, b"0")) for f in (b"attempt", b"handler_failure_count", b"stalled_attempt_count"))
        assert min(counters) >= 0, (tid, counters)
        if b"attempts" in h:
            history = json.loads(h[b"attempts"])
            assert isinstance(history, list)
            if b"attempt_sizes" in h:
                sizes = [int(s) for s in h[b"attempt_sizes"].split()]
                assert len(sizes) == len(history) and sum(sizes) + len(sizes) + 1 == len(h[b"attempts"]), tid
        summary[tid.decode()] = (state, *counters)
    for s in STATES:
        orphans = {t.decode() for t in indexes[s]} - summary.keys()
        assert not orphans, f"{s} index names tasks with no record: {sorted(orphans)[:5]}"
    orphans = {t.decode() for t in parked} - summary.keys()
    assert not orphans, f"backlog names tasks with no record: {sorted(orphans)[:5]}"
    counted = {g: int(n) for g, n in await client.zrange(base + b"groups", 0, -1, withscores=True)}
    assert counted == waiting_in, f"waiting per group: counted {counted}, in the index {waiting_in}"
    running = {f[2:]: int(n) for f, n in (await client.hgetall(base + b"group_ctl")).items() if f.startswith(b"a:")}
    assert running == active_in, f"attempts running per group: counted {running}, active {active_in}"
    return summary
