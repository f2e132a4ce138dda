"""A KEYS-strict check of Lua scripts on a real redis-server.

While active, `strict_keys(url)` reads the server's MONITOR feed: every script call
(EVAL, EVALSHA, FCALL and their _RO forms) with its declared KEYS, and the commands
the script ran (source ``lua``). Redis itself says which arguments of each inner
command are keys (``COMMAND GETKEYS``); every key a script touched that is not among
its KEYS is a violation, which is what Redis Cluster proxies that route on KEYS
(and the rule that every script declares its keys) forbid.

On Redis 7.0 a script call is logged before the commands it runs, and a script runs
alone, so the ``lua`` lines that follow a call are that call's. When the block ends,
an ``ECHO <uuid>`` is sent and the feed is read up to it: nothing sent inside the
block is missed.

    with strict_keys(redis_url) as check:
        ...  # drive the scripts through the public API
    assert check.violations == []
    assert check.seen >= set(known_scripts().values())
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import unquote, urlparse

import redis

from effectmq.protocol import protocol, scripts
from effectmq.scheduler import store as schedule_store

SCRIPT_CALLS = {"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"}
_LINE = re.compile(r"^\+(\d+\.\d+) \[(\d+) ([^\]]*)\] (.*)$")
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", "\\": "\\", '"': '"'}


def known_scripts() -> dict[str, str]:
    """SHA or function name -> name ("engine:<op>", "scheduler:<op>") of every script the project calls."""
    names = {scripts.sha(op): f"engine:{op}" for op in protocol.SCRIPTS}
    names.update({scripts.function_name(op): f"engine:{op}" for op in protocol.SCRIPTS})
    for op in schedule_store.OPERATIONS:
        names[hashlib.sha1(schedule_store.source(op).encode()).hexdigest()] = f"scheduler:{op}"
    return names


@dataclass(frozen=True)
class Violation:
    script: str  # a known script's name, else its SHA (or "EVAL <first 40 chars>")
    command: tuple[str, ...]  # the inner command, as logged
    key: str  # the key it touched that the call did not declare

    def __str__(self) -> str:
        shown = " ".join(self.command)
        return f"{self.script}: {shown[:160]!r} touches undeclared key {self.key!r}"


@dataclass
class _Call:
    script: str
    keys: frozenset[str]
    commands: list[tuple[str, ...]] = field(default_factory=list)


@dataclass
class StrictKeysReport:
    calls: int = 0  # script calls seen (a NOSCRIPT reply counts too: it ran nothing)
    seen: set[str] = field(default_factory=set)  # names of the scripts that ran
    violations: list[Violation] = field(default_factory=list)


def _unescape(text: str) -> str:
    """An argument as MONITOR quotes it (sdscatrepr) back to its bytes, read as UTF-8."""
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
        elif text[i + 1] == "x":
            out.append(int(text[i + 2:i + 4], 16))
            i += 4
        else:
            out += _ESCAPES[text[i + 1]].encode()
            i += 2
    return out.decode(errors="replace")


def parse_line(line: str) -> tuple[str, tuple[str, ...]]:
    """(source, arguments) of one MONITOR line; source is "lua" for a script's commands."""
    match = _LINE.match(line)
    if match is None:
        raise AssertionError(f"unexpected MONITOR line: {line[:200]!r}")
    return match.group(3), tuple(_unescape(a) for a in _ARG.findall(match.group(4)))


def _script_call(args: tuple[str, ...], names: dict[str, str]) -> _Call:
    command = args[0].upper()
    nkeys = int(args[2])
    if command.startswith("EVALSHA"):
        script = names.get(args[1].lower(), args[1])
    elif command.startswith("EVAL"):
        sha = hashlib.sha1(args[1].encode()).hexdigest()
        script = names.get(sha, f"EVAL {args[1][:40]!r}")
    else:
        script = names.get(args[1], f"FCALL {args[1]}")
    return _Call(script, frozenset(args[3:3 + nkeys]))


def group_calls(lines: list[str], names: dict[str, str]) -> list[_Call]:
    """Script calls with the commands each ran, in the order they ran."""
    calls: list[_Call] = []
    current: _Call | None = None
    for line in lines:
        source, args = parse_line(line)
        if source == "lua":
            if current is None:
                raise AssertionError(f"a script command without its script call: {args!r}")
            current.commands.append(args)
        elif args and args[0].upper() in SCRIPT_CALLS:
            current = _Call("?", frozenset()) if len(args) < 3 else _script_call(args, names)
            calls.append(current)
        else:
            current = None
    return calls


def _keys_of(client: redis.Redis, commands: list[tuple[str, ...]]) -> dict[tuple[str, ...], list[str]]:
    """The key arguments of each distinct command, as Redis itself parses them."""
    distinct = list(dict.fromkeys(c for c in commands if len(c) > 1))  # a bare TIME names no key
    pipe = client.pipeline(transaction=False)
    for command in distinct:
        pipe.command_getkeys(*command)
    keys: dict[tuple[str, ...], list[str]] = {c: [] for c in commands}
    for command, reply in zip(distinct, pipe.execute(raise_on_error=False)):
        if isinstance(reply, redis.ResponseError):
            if "no key arguments" not in str(reply):  # TIME, PUBLISH: no keys
                raise AssertionError(f"COMMAND GETKEYS {command!r}: {reply}")
            reply = []
        keys[command] = list(reply)
    return keys


def check_calls(client: redis.Redis, calls: list[_Call], report: StrictKeysReport) -> None:
    keys = _keys_of(client, [c for call in calls for c in call.commands])
    for call in calls:
        report.calls += 1
        if call.commands:
            report.seen.add(call.script)
        for command in call.commands:
            for key in keys[command]:
                if key not in call.keys:
                    report.violations.append(Violation(call.script, command, key))


class _Monitor:
    """A raw MONITOR connection read by a thread, line by line, until a sentinel."""

    def __init__(self, host: str, port: int, password: str | None):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.file = self.sock.makefile("rb")
        if password:
            self._command("AUTH", password)
        self._command("MONITOR")
        self.lines: list[str] = []
        self.sentinel = f"strict-keys-end-{uuid.uuid4()}"
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._read, name="strict-keys monitor", daemon=True)
        self.thread.start()

    def _command(self, *args: str) -> None:
        packed = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        self.sock.sendall(packed.encode())
        reply = self.file.readline()
        if not reply.startswith(b"+OK"):
            raise AssertionError(f"{args[0]} refused: {reply!r}")

    def _read(self) -> None:
        try:
            while True:
                raw = self.file.readline()
                if not raw:
                    raise AssertionError("MONITOR connection closed before the sentinel")
                line = raw.decode(errors="replace").rstrip("\r\n")
                if line.endswith(f'"ECHO" "{self.sentinel}"'):
                    return
                self.lines.append(line)
        except BaseException as exc:
            self.failure = exc

    def finish(self, client: redis.Redis) -> list[str]:
        client.echo(self.sentinel)
        self.thread.join(60)
        self.sock.close()
        if self.thread.is_alive():
            raise AssertionError("MONITOR did not deliver the sentinel within 60 s")
        if self.failure is not None:
            raise self.failure
        return self.lines


@contextmanager
def strict_keys(url: str) -> Iterator[StrictKeysReport]:
    """Check every script run on the Redis at `url` inside the block; the report is
    filled when the block ends (also when it raises)."""
    parsed = urlparse(url)
    password = unquote(parsed.password) if parsed.password else None
    client = redis.Redis(host=parsed.hostname or "127.0.0.1", port=parsed.port or 6379, password=password,
                         decode_responses=True)
    monitor = _Monitor(parsed.hostname or "127.0.0.1", parsed.port or 6379, password)
    report = StrictKeysReport()
    try:
        yield report
    finally:
        try:
            lines = monitor.finish(client)
            check_calls(client, group_calls(lines, known_scripts()), report)
        finally:
            client.close()
