"""Schedules in Redis: key layout, the scheduler's Lua scripts, and reading status.

Every key shares the hash tag ``{<prefix>-sched:<namespace>}`` (one slot on Redis
Cluster); the layout is documented in ``lua/lib.lua``. Schedules are found through
a zset ordered by next fire time, so a pass reads only the due ones. Each script is
given every key it touches: the schedule hashes of a call are known before it is
sent (the due candidates are read first). Every state change of a schedule is
numbered in a change feed, so a status mirror reads only what changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, NamedTuple, Sequence

import redis.asyncio as aioredis

from ..protocol import codec
from ..transport.connection import GIVEN_CLIENT, RedisErrors
from ..errors import InvalidOption
from ..client.discovery import SCAN_COUNT, glob_escape
from ..protocol.keys import QUEUE_NAME, check_queue_name
from .errors import InvalidSchedule
from .model import ScheduleSpec, ScheduleStatus, utc_from_ms

OPERATIONS = ("put", "remove", "due", "advance", "read")


@cache
def source(operation: str) -> str:
    lua = resources.files(__package__) / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{operation}.lua").read_text()


class Row(NamedTuple):
    """A due schedule as stored: its definition (raw JSON), version and cursor."""

    id: str
    spec: str
    version: str
    cursor_ms: int | None  # None: the stored cursor is not a number (reported, never used)
    # The Redis time (ms) decisions from this version and cursor are made with (lua/lib.lua's
    # decided_at): a pass that stopped after its offers is redone with the same ticks and counts.
    decided_ms: int | None = None
    suspended: tuple[int, int] | None = None  # the last suspension, (suspended at, resumed at) ms


class DueBatch(NamedTuple):
    now_ms: int
    next_ms: int | None  # earliest fire time after now (or upto) among schedules not returned
    rows: list[Row]


@dataclass(frozen=True)
class Outcome:
    """What one pass decided for one schedule (an entry of `advance.lua`)."""

    id: str
    version: str
    expect: int | None  # the cursor the decision started from
    cursor: int | None  # the new cursor
    score: int | None  # next fire time (or, with an error, when to retry); None: never again
    last_tick: int | None = None
    task: str = ""  # the last tick's task id
    materialized: int = 0
    skipped: int = 0
    coalesced: int = 0
    backfilled: int = 0
    error: str = ""

    def to_json(self) -> dict:
        """The entry as advance.lua reads it: absent fields mean none / zero."""
        out: dict[str, Any] = {"id": self.id, "version": self.version,
                               "expect": "" if self.expect is None else str(self.expect),
                               "cursor": "" if self.cursor is None else str(self.cursor)}
        if self.score is not None:
            out["score"] = str(self.score)
        if self.last_tick is not None:
            out["last_tick"], out["task"] = str(self.last_tick), self.task
        if self.materialized:
            out["materialized"] = self.materialized
        if self.skipped:
            out["skipped"] = self.skipped
        if self.coalesced:
            out["coalesced"] = self.coalesced
        if self.backfilled:
            out["backfilled"] = self.backfilled
        if self.error:
            out["error"] = self.error
        return out


# How far past the estimate of Redis time `due` reads candidates: a schedule falling
# due meanwhile is among them; an estimate short by more (a clock step) only delays
# those after it to the next call (due.lua reports them as next).
CANDIDATES_AHEAD_MS = 2000

# advance.lua's answers
APPLIED, GONE, CHANGED, LOST, FUTURE = 1, 0, -1, -2, -3

# The scheduler namespace of schedules made by hand (the CLI, Python) when none is named.
# The operator keeps its own (effectmq_operator.redis_pool.SCHEDULER_NAMESPACE) and
# `effectmq local` its own: each removes schedules no resource backs, only in its namespace.
DEFAULT_NAMESPACE = "default"
INDEX = "index"  # the key every namespace with a schedule has (discover_scheduler_namespaces finds them by it)


def store_base(prefix: str, namespace: str) -> str:
    """What every key of a namespace's store starts with: one hash tag, one cluster slot."""
    return f"{{{prefix}-sched:{namespace}}}:"


async def discover_scheduler_namespaces(redis: Any, prefix: str = "emq") -> list[str]:
    """The scheduler namespaces that hold a schedule (their index key), found by SCAN, sorted.
    Keys are read as bytes: one that is not UTF-8 names no namespace of ours, and is skipped."""
    found: set[str] = set()
    head, tail = store_base(prefix, "\0").split("\0")
    pattern = store_base(glob_escape(prefix), "*") + INDEX
    async for raw in redis.scan_iter(match=pattern, count=SCAN_COUNT, NEVER_DECODE=True):
        try:
            key = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            continue
        if key.startswith(head) and key.endswith(tail + INDEX):
            namespace = key[len(head):-len(tail + INDEX)]
            if "}" not in namespace and QUEUE_NAME.match(namespace):  # as ScheduleStore checks them
                found.add(namespace)
    return sorted(found)


class ScheduleStore:
    """The schedules of one namespace, on one Redis client (decode_responses=True).

    `url` (password masked) is how errors name the server."""

    def __init__(self, client: aioredis.Redis, *, namespace: str = DEFAULT_NAMESPACE, prefix: str = "emq",
                 url: str = GIVEN_CLIENT):
        try:
            check_queue_name(namespace)
        except InvalidOption:
            raise InvalidSchedule(f"invalid scheduler namespace {namespace!r}: letters, digits and . _ : / -") from None
        self.client = client
        self.namespace = namespace
        self.base = store_base(prefix, namespace)
        self.due_key, self.index_key, self.changes_key = self.base + "due", self.base + INDEX, self.base + "changes"
        self.keys = [self.due_key, self.index_key, self.changes_key]  # lib.lua's KEYS[1..3]
        self._scripts = {op: client.register_script(source(op)) for op in OPERATIONS}
        self._redis_errors = RedisErrors(client, f"at {url} (scheduler namespace {namespace!r})")
        self._redis_clock_offset_ms: int | None = None  # Redis time less local time, as `due` last saw it

    def key(self, schedule_id: str) -> str:
        return self.base + "s:" + schedule_id

    async def _call(self, operation: str, schedule_ids: Sequence[str], argv: Sequence) -> Any:
        """A script call given the scheduler keys and the hashes of `schedule_ids`."""
        keys = self.keys + [self.key(i) for i in dict.fromkeys(schedule_ids)]
        with self._redis_errors:
            return await self._scripts[operation](keys=keys, args=list(argv))

    async def _read(self, coro) -> Any:
        with self._redis_errors:
            return await coro

    # -- writes ----------------------------------------------------------------

    async def put(self, spec: ScheduleSpec) -> tuple[str, int, int]:
        """Store a definition; returns (version, cursor ms, Redis now ms)."""
        version, cursor, now = await self._call("put", [spec.id], [spec.id, spec.dumps(), spec.timing,
                                                                   int(spec.suspend)])
        return str(version), int(cursor), int(now)

    async def remove(self, schedule_id: str) -> bool:
        return bool(await self._call("remove", [schedule_id], [schedule_id]))

    async def advance(self, outcomes: Sequence[Outcome]) -> list[int]:
        if not outcomes:
            return []
        encoded = codec.dumps([o.to_json() for o in outcomes], "scheduler outcomes")
        return [int(r) for r in await self._call("advance", [o.id for o in outcomes], [encoded])]

    # -- reads -----------------------------------------------------------------

    async def due(self, batch: int, upto_ms: int | None = None) -> DueBatch:
        """Up to `batch` schedules due now (or already at `upto_ms`, when that is earlier).

        The earliest `batch` entries are read first, so that due.lua is given their
        hashes; it keeps those due by Redis time. The read stops at `upto_ms`, else at
        an estimate of Redis time (the last reply's, moved on by the local clock) plus
        CANDIDATES_AHEAD_MS: an idle pass over 50,000 schedules then reads none of
        them instead of a batch (5.7 ms a pass instead of 0.2 here)."""
        bound: int | str = "+inf"
        if upto_ms is not None:
            bound = upto_ms
        elif self._redis_clock_offset_ms is not None:
            bound = _local_ms() + self._redis_clock_offset_ms + CANDIDATES_AHEAD_MS
        candidates = await self._read(self.client.zrangebyscore(self.due_key, "-inf", bound, start=0, num=batch))
        argv = ["" if upto_ms is None else upto_ms, "" if bound == "+inf" else bound, *candidates]
        reply = await self._call("due", candidates, argv)
        self._redis_clock_offset_ms = int(reply[0]) - _local_ms()
        rows = [Row(reply[i], reply[i + 1], reply[i + 2], _int(reply[i + 3]), _int(reply[i + 4]),
                    _suspension(reply[i + 5])) for i in range(2, len(reply), 6)]
        upcoming = int(float(reply[1]))
        return DueBatch(int(reply[0]), None if upcoming < 0 else upcoming, rows)

    async def due_after(self, skip: int, batch: int, upto_ms: int) -> tuple[DueBatch, int]:
        """The next `batch` schedules due at `upto_ms` after the first `skip` ones (read
        by this pass and not advanced yet), and how many due entries that covered: a
        pass reads several slices before it offers their ticks.

        Unlike `due`, the rows are read after their ids (atomically with Redis time): a
        row advanced in between is decided from its new cursor, as with `rows`. An
        entry whose hash is gone or lacks a version or cursor is passed over; the next
        `due` call removes or repairs it.
        """
        ids = await self._read(self.client.zrangebyscore(self.due_key, "-inf", upto_ms, start=skip, num=batch))
        now, hashes = await self._hashes(ids)
        rows = [Row(i, spec, version, _int(cursor), _int(decided), _suspension(suspended))
                for i, (spec, version, cursor, decided, suspended) in zip(ids, hashes)
                if spec is not None and version is not None and cursor is not None]
        return DueBatch(now, None, rows), len(ids)

    async def rows(self, ids: Sequence[str]) -> DueBatch:
        """Chosen schedules, read atomically with Redis time (as `due` would return them)."""
        now, hashes = await self._hashes(ids)
        rows = [Row(i, r[0], r[1] or "", _int(r[2]), _int(r[3]), _suspension(r[4]))
                for i, r in zip(ids, hashes) if r[0] is not None]
        return DueBatch(now, None, rows)

    async def _hashes(self, ids: Sequence[str]) -> tuple[int, list[list[str | None]]]:
        """Redis time (ms) and each schedule's spec, version, cursor, decision time and last
        suspension (see read.lua), read at one instant."""
        now, *hashes = await self._call("read", ids, ids)
        return int(now), hashes

    async def ping(self) -> None:
        await self._read(self.client.ping())

    async def ids(self, *, after: str | None = None, limit: int = 1000) -> list[str]:
        """Schedule ids in lexicographic order, `limit` at a time (page with `after`)."""
        start = "-" if after is None else "(" + after
        return await self._read(self.client.zrangebylex(self.index_key, start, "+", 0, limit))

    async def changes(self, *, after: int = 0, limit: int = 1000) -> list[tuple[str, int]]:
        """(id, change number) of the schedules whose state changed after change `after`,
        in change order, `limit` at a time (page with the last number)."""
        read = self.client.zrangebyscore(self.changes_key, f"({after}", "+inf", start=0, num=limit, withscores=True)
        return [(i, int(n)) for i, n in await self._read(read)]

    async def last_change(self) -> int:
        """The number of the latest change (0: none recorded)."""
        top = await self._read(self.client.zrange(self.changes_key, -1, -1, withscores=True))
        return int(top[0][1]) if top else 0

    async def statuses(self, ids: Sequence[str]) -> list[ScheduleStatus | None]:
        async with self.client.pipeline(transaction=False) as pipe:
            for schedule_id in ids:
                pipe.hgetall(self.key(schedule_id))
            hashes = await self._read(pipe.execute())
        return [parse_status(i, h) if h else None for i, h in zip(ids, hashes)]


def _local_ms() -> int:
    return time.time_ns() // 1_000_000


def _int(value: str | None) -> int | None:
    """A stored integer, or None when absent or not a number (corrupt values are reported)."""
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _suspension(value: str | None) -> tuple[int, int] | None:
    """(suspended at, resumed at) from lua/lib.lua's suspension(); None when there is none."""
    since, _, until = (value or "").partition(":")
    start, end = _int(since), _int(until)
    return None if start is None or end is None else (start, end)


def parse_status(schedule_id: str, h: dict[str, str]) -> ScheduleStatus:
    """A status from a schedule hash; an unreadable definition is reported, not raised."""
    error = h.get("last_error") or None
    try:
        spec: ScheduleSpec | None = ScheduleSpec.from_json(codec.loads(h.get("spec"), "schedule definition"))
    except Exception as exc:  # corrupt JSON, or a definition this version cannot run
        spec = None
        error = error or f"stored definition unusable: {exc}"
    suspended = h.get("suspended") == "1"
    return ScheduleStatus(
        id=schedule_id, spec=spec, suspended=suspended, cursor=utc_from_ms(_int(h.get("cursor"))),
        last_tick=utc_from_ms(_int(h.get("last_tick"))), last_task_id=h.get("last_task_id") or None,
        next_tick=None if suspended else utc_from_ms(_int(h.get("next_tick"))),
        materialized=_int(h.get("materialized")) or 0, skipped=_int(h.get("skipped")) or 0,
        coalesced=_int(h.get("coalesced")) or 0, backfilled=_int(h.get("backfilled")) or 0,
        last_error=error, last_error_at=utc_from_ms(_int(h.get("last_error_at"))),
        created_at=utc_from_ms(_int(h.get("created_at"))), updated_at=utc_from_ms(_int(h.get("updated_at"))),
    )
