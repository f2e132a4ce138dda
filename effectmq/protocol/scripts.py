"""The Lua scripts of the storage protocol, one per atomic operation, and their runner.

On Redis 7 the scripts in ``lua/`` are one function library (`library`: the helpers of
``lua/includes/`` defined once, each script a function) called with FCALL. Where Redis
has no functions for us (6.2, an ACL), each is called by SHA (EVALSHA), prefixed with the
queue settings' defaults (from `settings.LUA_DEFAULTS`) and the includes it names. When
Redis answers that it lacks one (after a restart, SCRIPT or FUNCTION FLUSH) the runner
loads it and sends the call again. Calls take and give the typed records of `protocol`;
each call declares the queue's keys and then the task hashes of its `task_ids()`
(lua/includes/keys.lua), then its receipts and the queue keys only it touches (`last_keys`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from functools import cache
from importlib import resources
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import redis
import redis.exceptions as redis_errors
from redis.asyncio.connection import Connection
from redis.asyncio.sentinel import SentinelManagedConnection

from ..transport import redispy
from ..transport.clock import server_time_ms
from ..transport.connection import TRANSPORT_ERRORS, RedisErrors, classify_reply
from .protocol import SCRIPTS, ScriptArgs
from .settings import lua_defaults

log = logging.getLogger("effectmq")

_pack: Callable[..., bytes] | None
try:  # hiredis packs commands in C; redis-py's own packer is the fallback
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - hiredis is a declared dependency
    _pack = None

OPERATIONS = tuple(SCRIPTS)
# Safe to send again after a lost connection: each is idempotent for the same
# arguments (explicit or pre-generated task ids, lease tokens). acquire is not:
# a repeat could lease a second task nobody runs, so the worker retries it instead.
RETRY_SAFE = frozenset(OPERATIONS) - {"acquire"}
# redis-py 5.3 deprecated naming the command when taking a pooled connection.
_CONNECTION_ARGS = () if tuple(map(int, redis.__version__.split(".")[:2])) >= (5, 3) else ("EVALSHA",)


def _lua_file(name: str) -> str:
    return (resources.files(__package__) / "lua" / name).read_text()


# A script or include names what it needs, one line each (BullMQ's `--- @include`).
_INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.M)


def _include_file(name: str) -> str:
    return _lua_file(f"includes/{name}.lua")


@cache
def include_names() -> tuple[str, ...]:
    return tuple(sorted(p.name[:-4] for p in (resources.files(__package__) / "lua" / "includes").iterdir()
                        if p.name.endswith(".lua")))


@cache
def includes(operation: str | None = None) -> tuple[str, ...]:
    """The includes a script names, each after the includes it names itself, each once (all
    of them when `operation` is None). Lua sees a local only after its definition, so
    this order is the only one that works; a cycle raises."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"lua includes: a cycle {' -> '.join((*path, name))}")
        if name in order:
            return
        for needed in _INCLUDE.findall(_include_file(name)):
            visit(needed, (*path, name))
        order.append(name)

    roots = include_names() if operation is None else _INCLUDE.findall(_lua_file(f"{operation}.lua"))
    for name in roots:
        visit(name, ())
    return tuple(order)


class Definition(NamedTuple):
    """One top-level definition of an include."""

    names: frozenset[str]  # the local names it defines
    text: str  # the comment lines above it included
    function: bool  # a `local function ... end`; else a one-line `local` statement, its last line


def _definitions(text: str, where: str) -> list[Definition]:
    """An include's top-level definitions in order. Includes are written so that this
    split is exact: after a header comment, every statement is one line that starts with
    `local`, or a `local function` up to the `end` at the start of a line; anything else
    raises, so an edit that breaks the rule is found on the first call."""
    body = text[text.index("]]") + 2:] if text.startswith("--[[") else text
    definitions: list[tuple[frozenset[str], list[str], bool]] = []
    comments: list[str] = []
    in_function = False  # until the `end` at the start of a line
    for line in body.split("\n"):
        if in_function:
            definitions[-1][1].append(line)
            in_function = not line.startswith("end")
        elif line.startswith("local "):
            head = line[len("local "):].split("--")[0]
            function = re.match(r"function ([A-Za-z_]\w*)", head)
            names = [function.group(1)] if function else [n.strip() for n in head.split("=")[0].split(",")]
            in_function = bool(function)
            definitions.append((frozenset(names), comments + [line], in_function))
            comments = []
        elif line.startswith("--") or not line.strip():
            comments.append(line)
        else:
            raise ValueError(f"{where}: a top-level line that is not a local definition: {line!r}")
    return [Definition(names, "\n".join(lines), function) for names, lines, function in definitions]


@cache
def lib_definitions() -> tuple[Definition, ...]:
    """Every include's top-level definitions, the includes in dependency order."""
    return tuple(d for name in includes() for d in _definitions(_include_file(name), f"includes/{name}.lua"))


@cache
def prelude(operation: str | None = None) -> str:
    """What a script runs before its own code: the settings' defaults, then the includes
    it names, with those they name (all of them when `operation` is None). Each costs
    every EVAL of the script, whether it uses it or not: defining all the helpers was a
    quarter of an offer's Redis work."""
    parts = [d.text for name in includes(operation) for d in _definitions(_include_file(name), name)]
    return lua_defaults() + "\n".join(parts) + "\n"


@cache
def source(operation: str) -> str:
    return prelude(operation) + _lua_file(f"{operation}.lua")


@cache
def sha(operation: str) -> str:
    return hashlib.sha1(source(operation).encode()).hexdigest()


# The scripts a full Redis (maxmemory, noeviction) must refuse: their first write may
# grow memory. Every other one frees first or writes nothing (includes/writes.lua, FIRST_WRITE_FREES),
# and as a function it says so with allow-oom; Redis refuses the rest before they run.
REFUSED_WHEN_FULL = frozenset({"offer", "progress", "hold"})
# The scripts that write nothing: as functions (no-writes) they run on a read-only replica
# too, as an EVAL that writes nothing does (the dashboard and `effectmq stats` may read there).
READ_ONLY = frozenset({"stats", "live_workers"})


_UNNAMED = "effectmq_unnamed"  # the library's name in its functions' names until it is known


@cache
def library() -> tuple[str, str]:
    """The scripts as one Redis function library (Redis 7): its name, and its source.

    The includes' functions are defined once, when the library loads, where an EVAL defines
    them again on every call (about half of what a call of `return 1` after them
    costs). Its other definitions (the queue's keys, the per-call caches and state) are
    declared once and assigned again at the start of every call (`begin`), so no call
    sees another's. The name carries a hash of the source: versions side by side in a
    rolling upgrade each call their own."""
    definitions = lib_definitions()
    values = [d for d in definitions if not d.function]
    declared = sorted({name for d in values for name in d.names} | {"KEYS", "ARGV"})
    assignments = []
    for d in values:
        code = d.text.rsplit("\n", 1)[-1][len("local "):]
        assignments.append("  " + (code if "=" in code.split("--")[0] else ", ".join(sorted(d.names)) + " = nil"))
    parts = ["local " + ", ".join(declared), lua_defaults(), *(d.text for d in definitions if d.function),
             "local function begin(keys, args)\n  KEYS, ARGV = keys, args\n" + "\n".join(assignments) + "\nend"]
    body = "\n".join(parts) + "\n"
    for operation in OPERATIONS:
        flags = "'no-writes'" if operation in READ_ONLY else "" if operation in REFUSED_WHEN_FULL else "'allow-oom'"
        body += (f"redis.register_function{{function_name = '{function_name(operation, _UNNAMED)}', "
                 f"flags = {{{flags}}}, callback = function(keys, args)\nbegin(keys, args)\n"
                 f"{_lua_file(f'{operation}.lua')}\nend}}\n")
    # The name hashes all of it, every operation's script and flags too: a version that
    # changed only one of them must not call the library of the version before it.
    name = "effectmq_" + hashlib.sha1(body.encode()).hexdigest()[:16]
    return name, f"#!lua name={name}\n" + body.replace(_UNNAMED, name)


# Every version loads its own library (library()), once per Redis, and nothing unloads
# the old ones: each would stay for good (about 170 kB of Redis memory, and its source in
# every RDB and AOF). A client that loads its library after an upgrade records it here
# (library name -> Redis time of its last load, ms) and deletes those not loaded for
# STALE_LIBRARY_MS. One still in use is loaded again at its next call ("Function not
# found"), at the cost of that one load.
LIBRARIES_KEY = "effectmq:libraries"
STALE_LIBRARY_MS = 7 * 86_400_000


class LibraryCleanup(NamedTuple):
    delete: list[str]  # libraries to delete (and drop from the record)
    record: list[str]  # libraries first seen now: recorded as loaded now
    forget: list[str]  # recorded libraries that Redis no longer has


def stale_libraries(listed: set[str], recorded: dict[str, str], loaded: str, now_ms: int) -> LibraryCleanup:
    """What to do with the effectmq libraries Redis holds (`listed`) after loading `loaded`.
    One without a record (loaded by a version before the record existed) is recorded now,
    so it too is deleted only a week after nobody loaded it."""
    delete, record = [], []
    for name in sorted(listed - {loaded}):
        seen = recorded.get(name)
        if seen is None or not seen.isdigit():
            record.append(name)
        elif now_ms - int(seen) > STALE_LIBRARY_MS:
            delete.append(name)
    return LibraryCleanup(delete, record, sorted(set(recorded) - listed - {loaded}))


def function_name(operation: str, library_name: str | None = None) -> str:
    return f"{library_name or library()[0]}_{operation}"


R = TypeVar("R")


class Confirmation:
    """Replication of a call's writes, confirmed by Redis WAIT (durable offers).

    WAIT counts the replicas that acknowledged the last write of its own connection, so
    it follows the calls of each round trip on their connection, after a write of
    `probe` (a key of the queue's hash tag, on the same node): a replica that acknowledged
    the probe has every earlier write of that node, the calls' included, and those of an
    earlier offer of an id the calls found stored already (which write nothing). `acks`:
    WAIT's answer for each round trip in which a call ran (a call sent again, after
    NOSCRIPT, a MOVED or a lost connection, adds its own); `refusal`: an error reply to the
    probe or to WAIT (a missing ACL right, NOREPLICAS), raised by the runner."""

    __slots__ = ("wanted", "timeout_ms", "packed", "acks", "refusal")

    def __init__(self, wanted: int, timeout_ms: int, probe: str):
        self.wanted = wanted
        self.timeout_ms = timeout_ms
        self.packed = [_pack_command("SET", probe, "1", "PX", PROBE_TTL_MS), _pack_command("WAIT", wanted, timeout_ms)]
        self.acks: list[int] = []
        self.refusal: redis_errors.ResponseError | None = None

    @property
    def acknowledged(self) -> int:
        """The fewest replicas any round trip's WAIT counted (0 when none was counted)."""
        return min(self.acks) if self.acks else 0

    def record(self, replies: Sequence[Any], probe: Any, wait: Any) -> None:
        if all(isinstance(r, redis_errors.ResponseError) for r in replies):
            return  # no call ran on this connection: nothing of theirs to confirm here
        for reply in (probe, wait):
            if isinstance(reply, redis_errors.ResponseError):
                self.refusal = self.refusal or reply
                return
        self.acks.append(int(wait))


# How long a durable offer's probe key lives (one per queue, written again by every offer).
PROBE_TTL_MS = 60_000


def _pack_command(*command: Any) -> list[bytes]:
    if _pack is not None:
        return [_pack(command)]
    return Connection().pack_command(*command)  # packing needs no connected socket


class ScriptRunner:
    """Calls scripts over a redis-py asyncio pool with as little overhead as possible.

    The hot path packs EVALSHA once (keys pre-encoded) and talks to a pooled
    connection directly; a connection interrupted mid-call is discarded, never
    reused with an unread reply. `run` and `run_many` are where redis-py's errors
    become the project's (through `errors`).
    """

    def __init__(self, client, keys: Sequence[str], errors: RedisErrors):
        self.client = client
        self.errors = errors
        self.keys = [k.encode() for k in keys]  # the queue's; keys[0] is its base
        self.nkeys = len(self.keys)
        # FCALL of library() while Redis has functions (7.0 on); False: EVALSHA, for a
        # Redis without them (6.2) or an ACL that forbids them.
        self.functions = True
        # Whether calls declare their optional keys (ScriptArgs.optional_keys: the group
        # keys), set for good once a script answered that the queue counts its groups:
        # until then calls go without, as two more keys cost every call.
        self.group_keys = False

    def task_keys(self, task_ids: Sequence[str | bytes]) -> list[bytes]:
        """The task hashes of these ids (keys.QueueKeys.task), as the scripts declare them."""
        prefix = self.keys[0] + b"t:"
        return [prefix + (i if isinstance(i, bytes) else i.encode(errors="surrogateescape")) for i in task_ids]

    def receipt_keys(self, receipt_ids: Sequence[str]) -> list[bytes]:
        """The receipts' keys (includes/receipts.lua use_receipts), declared after the task hashes."""
        prefix = self.keys[0] + b"r:"
        return [prefix + i.encode() for i in receipt_ids]

    def last_keys(self, parts: Sequence[str], optional: Sequence[str] = ()) -> list[bytes]:
        """The queue keys a script declares last (ScriptArgs.last_keys), after its receipts;
        its `optional` ones (ScriptArgs.optional_keys, the last) only once `group_keys`."""
        if optional and not self.group_keys:
            parts = parts[:len(parts) - len(optional)]
        return [self.keys[0] + part.encode() for part in parts]

    def _packed(self, operation: str, argv: Sequence[Any], task_keys: Sequence[bytes] = ()) -> list[bytes]:
        head = ("FCALL", function_name(operation)) if self.functions else ("EVALSHA", sha(operation))
        return _pack_command(*head, self.nkeys + len(task_keys), *self.keys, *task_keys, *argv)

    async def _send(self, packed: list, raw: bool, confirm: Confirmation | None = None) -> list:
        """Write every packed call on one pooled connection, then read every reply (errors as values)."""
        pool = self.client.connection_pool
        conn = await pool.get_connection(*_CONNECTION_ARGS)
        try:
            return await exchange(conn, packed, raw, confirm=confirm)
        finally:
            await pool.release(conn)

    async def run(self, args: ScriptArgs[R], confirm: Confirmation | None = None) -> R:
        """One typed script call; its reply parsed."""
        return (await self.run_many([args], confirm))[0]

    async def run_many(self, calls: Sequence[ScriptArgs[R]], confirm: Confirmation | None = None) -> list[R]:
        """Calls of one script in one round trip (each still runs alone in Redis); their
        replies parsed. With the script's `raw`, strings in a reply stay bytes. With
        `confirm`, WAIT follows them on their connection (Confirmation): its answers are
        left in `confirm` for the caller to judge, its refusals raise."""
        first = calls[0]
        with self.errors:
            def packed() -> list[list[bytes]]:  # again after a change of self.functions
                return [self._packed(args.operation, args.argv(),
                                     self.task_keys(args.task_ids()) + self.receipt_keys(args.receipt_ids())
                                     + self.last_keys(args.last_keys, args.optional_keys))
                        for args in calls]
            replies = await self._call(first.operation, packed, first.raw, confirm)
            if confirm is not None and confirm.refusal is not None:
                raise confirm.refusal
        return [args.parse(reply) for args, reply in zip(calls, replies)]

    async def _call(self, operation: str, pack: Callable[[], list[list[bytes]]], raw: bool,
                    confirm: Confirmation | None = None) -> list:
        """Send packed calls of one script: loaded when Redis does not have it, sent again
        once after a lost connection when that is safe; an error reply raises."""
        resent = False
        packed = pack()
        while True:
            try:
                replies = await self._send(packed, raw, confirm)
            except TRANSPORT_ERRORS:
                if resent or operation not in RETRY_SAFE:
                    raise
                resent = True  # once, on a fresh connection
                continue
            # After a restart, SCRIPT or FUNCTION FLUSH: load, send those again (twice: functions
            # refused, then the script by SHA). A queue that counts its groups: with their keys.
            for _ in range(3):
                missing = [_not_loaded(r) for r in replies]
                keys_wanted = [_group_keys_wanted(r) for r in replies]
                if not any(missing) and not any(keys_wanted):
                    break
                if any(missing):
                    await self._load(operation, replies)
                if any(keys_wanted):
                    self.group_keys = True
                again_at = [m or k for m, k in zip(missing, keys_wanted)]
                packed = pack()
                again = await self._send([p for p, a in zip(packed, again_at) if a], raw, confirm)
                it = iter(again)
                replies = [next(it) if a else r for r, a in zip(replies, again_at)]
            for reply in replies:
                if isinstance(reply, redis_errors.ResponseError):
                    raise reply
            return replies

    async def _load(self, operation: str, replies: list) -> None:
        """Load the library, or the script when Redis has no functions for us (then for good).
        A full Redis refuses FUNCTION LOAD (it may grow memory) but not SCRIPT LOAD: the
        work in flight then renews and settles by SHA, as FIRST_WRITE_FREES lets it."""
        if self.functions and not any(_functions_refused(r) for r in replies):
            try:
                await self.client.function_load(library()[1], replace=True)
            except redis_errors.ResponseError as exc:
                if not (_functions_refused(exc) or isinstance(exc, redis_errors.OutOfMemoryError)):
                    raise
            else:
                await self._unload_stale_libraries()
                return
        self.functions = False
        await self.client.script_load(source(operation))

    async def _unload_stale_libraries(self) -> None:
        """After this client loaded its library: record it, delete the stale ones
        (stale_libraries). Best effort: a refusal (an ACL, a full Redis) leaves them."""
        loaded = library()[0]
        try:
            now = await server_time_ms(self.client, LIBRARIES_KEY)
            await self.client.hset(LIBRARIES_KEY, loaded, str(now))
            replies = await self.client.function_list(library="effectmq_*")
            per_node = replies.values() if isinstance(replies, dict) else [replies]  # a cluster: per primary
            listed = {name for reply in per_node for lib in reply if (name := library_name_of(lib))}
            plan = stale_libraries(listed, await self.client.hgetall(LIBRARIES_KEY), loaded, now)
            for name in plan.delete:
                with contextlib.suppress(redis_errors.ResponseError):  # gone already (another client)
                    await self.client.function_delete(name)
            if plan.record:
                await self.client.hset(LIBRARIES_KEY, mapping={name: str(now) for name in plan.record})
            if plan.delete or plan.forget:
                await self.client.hdel(LIBRARIES_KEY, *plan.delete, *plan.forget)
        except (redis_errors.RedisError, *TRANSPORT_ERRORS) as exc:
            log.info("old function libraries left in Redis: %s", type(exc).__name__)


def library_name_of(entry: Any) -> str | None:
    """The name in one FUNCTION LIST entry (a flat list under RESP2, a dict under RESP3)."""
    if isinstance(entry, dict):
        return entry.get("library_name")
    if isinstance(entry, list) and "library_name" in entry:
        return entry[entry.index("library_name") + 1]
    return None


def _not_loaded(reply: Any) -> bool:
    """Whether a reply says Redis lacks the script or function called (it ran nothing)."""
    return isinstance(reply, redis_errors.NoScriptError) or _functions_refused(reply) or (
        isinstance(reply, redis_errors.ResponseError) and str(reply).startswith("Function not found"))


def _group_keys_wanted(reply: Any) -> bool:
    """A script's refusal of a call without the group keys on a queue that counts its groups
    (lua/includes/group_caps.lua group_keys_refused): it ran nothing."""
    return isinstance(reply, redis_errors.ResponseError) and str(reply).startswith("GROUPKEYS ")


def _functions_refused(reply: Any) -> bool:
    """A Redis without functions (6.2: unknown command), or an ACL that forbids them."""
    if not isinstance(reply, redis_errors.ResponseError):
        return False
    text = str(reply).lower().replace("`", "'")  # 6.2 quotes the command with backticks, 7 with '
    return (text.startswith("unknown command") and ("'fcall'" in text or "'function'" in text)
            or "no permissions to run the 'fcall'" in text or "no permissions to run the 'function" in text)


def _demoted_primary(conn: Connection, exc: redis_errors.ResponseError) -> bool:
    """A READONLY reply to a script from the primary a Sentinel named, wrapped by Redis 6.2
    ("Error running script ... -READONLY ..."): as redis-py does with the plain READONLY it
    recognizes (SentinelManagedConnection.read_response), the connection is dropped and
    the next one asks the Sentinels again. Else a worker kept calling the demoted one."""
    return (isinstance(conn, SentinelManagedConnection) and conn.connection_pool.is_master
            and not isinstance(exc, redis_errors.ReadOnlyError) and classify_reply(exc).code == "READONLY")


async def exchange(conn: Connection, packed: list, raw: bool, *, asking: bool = False,
                   confirm: Confirmation | None = None) -> list:
    """Write the packed calls on `conn` (each after ASKING when `asking`: a cluster slot
    being migrated), then read every reply, error replies as values; with `confirm`, its
    probe and WAIT follow on the same connection and their replies go to it. A connection
    interrupted mid-call is disconnected: it is never reused with an unread reply."""
    try:
        prefix = conn.pack_command("ASKING") if asking else []
        sent = [*packed, *confirm.packed] if confirm is not None else packed
        await conn.send_packed_command([part for call in sent for part in (*prefix, *call)], check_health=False)
        replies = []
        for _ in sent:
            if asking:
                await conn.read_response()  # OK
            try:
                replies.append(await conn.read_response(disable_decoding=raw))
            except redis_errors.ResponseError as exc:
                if _demoted_primary(conn, exc):
                    raise redis_errors.ConnectionError("The previous master is now a slave") from exc
                replies.append(exc)
        if confirm is not None:
            *replies, probe, wait = replies
            confirm.record(replies, probe, wait)
        return replies
    except BaseException as exc:
        lost = redispy.closed_under_us(conn, exc)
        await conn.disconnect()  # a reply may still be in flight
        if lost:  # the outcome is unknown, as after a reset: a transport error, which callers retry
            raise redis_errors.ConnectionError("the connection was closed while a call was in flight") from exc
        raise
