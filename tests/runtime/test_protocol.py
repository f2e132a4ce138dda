"""The Lua scripts' headers (ARGV and Returns, in the form lib.lua describes) held against
the dataclasses of effectmq.protocol, and the queue settings' defaults kept in Python only."""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import time
import typing
from pathlib import Path

import pytest

from effectmq.protocol import protocol, scripts
from effectmq.client import queue as queue_module
from effectmq.protocol.keys import FORENSIC_KEYS, GROUP_KEYS, GROUP_RATE_KEYS, RATE_KEYS, QueueKeys
from effectmq.protocol.protocol import SCRIPTS, AcquireStatus, Outcome
from effectmq.protocol.settings import LUA_DEFAULTS as SETTING_DEFAULTS, lua_defaults

LUA = Path(protocol.__file__).parent / "lua"
SEQUENCES = (list, collections.abc.Sequence)


def read(name: str) -> str:
    return (LUA / f"{name}.lua").read_text()


def header_lines(operation: str) -> list[str]:
    """The header's lines, a list continued after a trailing comma or an open brace joined."""
    text = read(operation)
    assert text.startswith("--[["), f"{operation}.lua has no header"
    lines: list[str] = []
    for line in text[4:text.index("]]")].splitlines():
        line = line.strip()
        if lines and (lines[-1].endswith(",") or lines[-1].count("{") > lines[-1].count("}")):
            lines[-1] += " " + line
        else:
            lines.append(line)
    return lines


def names(listed: str) -> list[str]:
    return [name.strip() for name in listed.split(",")]


@dataclasses.dataclass
class Header:
    keys: str  # what the KEYS line says follows the queue keys ("" when nothing does)
    argv: list[str]  # scalar arguments in order, then "name..." for records
    records: dict[str, list[str]]  # "name..." -> the values of one record
    returns: list[str]  # the reply's names ("name..." for what follows)
    table: bool  # the reply is a table (else one value)


def parse_header(operation: str) -> Header:
    h = Header("", [], {}, [], False)
    for line in header_lines(operation):
        if m := re.match(r"KEYS: the queue keys of keys\.lua(?:, then (.*?))?\.?$", line):
            h.keys = m.group(1) or ""
        elif m := re.match(r"ARGV\[(\d+)\.\.\.\] (\w+\.\.\.): (\d+) values each: (.*)$", line):
            index, name, count, values = m.groups()
            assert int(index) == len(h.argv) + 1, f"{operation}: {name} starts at ARGV[{index}]"
            h.argv.append(name)
            h.records[name] = names(values)
            assert len(h.records[name]) == int(count), f"{operation}: {name} lists {values} as {count} values"
        elif found := re.findall(r"ARGV\[(\d+)\] (\w+)", line):
            for index, name in found:
                assert int(index) == len(h.argv) + 1, f"{operation}: ARGV[{index}] {name} out of order"
                h.argv.append(name)
        elif m := re.match(r"Returns: \{(.*?)\}", line):
            h.returns, h.table = names(m.group(1)), True
        elif m := re.match(r"Returns: (\w+)", line):
            h.returns = [m.group(1)]
        elif m := re.match(r"(\w+\.\.\.): (\d+) values each: (.*)$", line):
            name, count, values = m.groups()
            h.records[name] = names(values)
            assert len(h.records[name]) == int(count), f"{operation}: {name} lists {values} as {count} values"
    assert h.returns, f"{operation}.lua: no Returns line"
    return h


def in_keys(f: dataclasses.Field) -> bool:
    """A field that travels as task hashes in KEYS (protocol.declared_keys), not in ARGV."""
    return bool(f.metadata.get("keys"))


def layout(cls: type) -> tuple[list[str], dict[str, list[str]]]:
    """A dataclass's ARGV fields as header names, and the values of its repeated records."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    records: dict[str, list[str]] = {}
    for f in dataclasses.fields(cls):
        if in_keys(f):
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) in SEQUENCES:
            item = typing.get_args(hint)[0]
            out.append(f.name + "...")
            if item is protocol.RawFields:  # decoded per field, by LEASE_FIELDS
                records[f.name + "..."] = list(protocol.LEASE_FIELDS)
            elif hasattr(item, "_fields"):
                records[f.name + "..."] = list(item._fields)
        else:
            out.append(f.name)
    return out, records


def test_every_script_has_its_arguments_and_reply_classes():
    files = {p.stem for p in LUA.glob("*.lua")}
    assert files == set(SCRIPTS) == set(scripts.OPERATIONS)
    for operation, args in SCRIPTS.items():
        assert args.operation == operation
        assert dataclasses.is_dataclass(args) and dataclasses.is_dataclass(args.Reply)
        assert callable(args.Reply.from_reply)


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_header_arguments_match_the_dataclass(operation):
    header = parse_header(operation)
    argv, records = layout(SCRIPTS[operation])
    assert header.argv == argv
    assert {k: v for k, v in header.records.items() if k in argv} == records


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_header_keys_match_the_task_ids(operation):
    """Every script names what follows the queue keys: a field sent as KEYS, or the ids of
    its ARGV; a script that takes no task ids declares none."""
    header = parse_header(operation)
    cls = SCRIPTS[operation]
    key_fields = [f.name for f in dataclasses.fields(cls) if in_keys(f)]
    uses_ids = cls.task_ids is not protocol.ScriptArgs.task_ids
    assert bool(header.keys) == uses_ids, operation
    if key_fields:
        assert header.keys.startswith(f"{key_fields[0]}: the task hashes of ids"), operation
    elif uses_ids:
        assert header.keys.startswith("the task hash of"), operation
    touches_tasks = re.search(r"\b(task_key|owned|outcome_of|promote_if_due|complete_each)\(", read(operation))
    assert bool(touches_tasks) == uses_ids, operation


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_header_last_keys_match_the_dataclass(operation):
    """The queue keys only some scripts touch come last (ScriptArgs.last_keys): the header's
    "Last KEYS" line, the script's declared_last() and the dataclass name the same ones."""
    lines = [line for line in header_lines(operation) if line.startswith("Last KEYS:")]
    named = tuple(names(lines[0][len("Last KEYS:"):])) if lines else ()
    assert named == SCRIPTS[operation].last_keys
    body = read(operation)
    declared = re.search(r"declared_last\((\{.*?\}|\w+)\)", body)
    listed = declared.group(1) if declared else ""
    if listed and not listed.startswith("{"):  # a table named before
        listed = re.search(rf"local {listed} = (\{{.*?\}})", body).group(1)
    assert tuple(re.findall(r"'(\w+)'", listed)) == named
    assert set(named) <= set(FORENSIC_KEYS + RATE_KEYS + GROUP_RATE_KEYS + GROUP_KEYS)


def test_the_queue_keys_are_those_keys_lua_counts():
    lib = read("includes/keys")
    count = int(re.search(r"local QUEUE_KEYS = (\d+)", lib).group(1))
    keys = QueueKeys("emq", "q").script_keys
    assert len(keys) == count
    documented = re.findall(r"^  KEYS\[(\d+)\] +(\w+)", lib, re.M)
    assert [int(i) for i, _ in documented] == list(range(1, count + 1))
    assert [keys[0]] + [keys[0] + name for _, name in documented[1:]] == keys


async def test_a_script_refuses_a_task_hash_it_was_not_given(make_queue):
    """The rule is enforced in Lua: task_key() of an undeclared id is an error reply."""
    q = make_queue("protocol-undeclared")
    await q.offer("job", {}, task_id="t1")
    lease = await q.acquire()
    with pytest.raises(Exception, match="undeclared task key"):
        await q.redis.eval(scripts.source("progress"), len(q.keys.script_keys), *q.keys.script_keys,
                              "t1", lease.token, "1")
    assert (await q.get("t1")).progress is None
    await lease.progress(1)  # the same call, declared by the runner
    assert (await q.get("t1")).progress == 1


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_header_reply_matches_the_dataclass(operation):
    header = parse_header(operation)
    returns, records = layout(SCRIPTS[operation].Reply)
    assert header.returns == returns
    assert {k: v for k, v in header.records.items() if k in returns} == records
    assert header.table == (len(returns) > 1 or returns[0].endswith("..."))


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_argv_follows_the_field_order(operation):
    """argv() gives every field in order, records flattened value by value."""
    cls = SCRIPTS[operation]
    hints = typing.get_type_hints(cls)
    given: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.init or in_keys(f):
            continue
        if typing.get_origin(hints[f.name]) in SEQUENCES:
            item = typing.get_args(hints[f.name])[0]
            given[f.name] = [item(*(f"{f.name}{i}.{v}" for v in item._fields)) for i in range(2)]
        else:
            given[f.name] = f"<{f.name}>"
    args = cls(**given)
    expected: list = []
    for f in dataclasses.fields(cls):
        if in_keys(f):
            continue
        value = getattr(args, f.name)
        if f.name in given and isinstance(value, list):
            expected += [v for record in value for v in record]
        else:
            expected.append(value)
    assert args.argv() == expected


def test_record_strides_in_the_scripts_are_the_record_sizes():
    """Where a script walks its records, the step and start are those of the header."""
    for operation in SCRIPTS:
        header, body = parse_header(operation), read(operation)
        for start, step in re.findall(r"for i = (\d+), #ARGV, (\d+) do", body):
            name = header.argv[int(start) - 1]
            assert int(step) == len(header.records[name]), operation
    start, step = re.search(r"local b = (\d+) \+ i \* (\d+)", read("offer")).groups()
    assert (int(start), int(step)) == (parse_header("offer").argv.index("tasks...") + 1, protocol.OFFER_WIDTH)
    acquire = read("acquire")
    # A lease's values: id, token, the new attempt, then fields read from the record (the
    # optional ones by a second HMGET); they are written to the reply in this order.
    reads = {name: re.findall(r"'(\w+)'", fields) for name, fields in
             re.findall(r"(\w+) = redis.call\('HMGET', key, (.*?)\)", acquire, re.S)}
    sent = []
    for values in re.findall(r"out\[n \+ \d+\](?:, out\[n \+ \d+\])* = ([^\n]+)", acquire):
        for value in values.split(", "):
            read_from = re.fullmatch(r"(\w+)\[(\d)\]", value)
            sent.append(reads[read_from[1]][int(read_from[2]) - 1] if read_from else value)
    assert sent == list(protocol.LEASE_FIELDS)
    assert re.search(r"n = n \+ (\d+)", acquire)[1] == str(protocol.LEASE_WIDTH)
    assert re.search(r"for i = first_lease, #out, (\d+) do", acquire)[1] == str(protocol.LEASE_WIDTH)


def test_outcome_codes_and_acquire_statuses_are_named_alike():
    lib = read("includes/outcomes")
    lua_names, lua_codes = re.search(r"local (OUTCOME_\w+(?:, OUTCOME_\w+)*) = ([\d, ]+)\n", lib).groups()
    lua = dict(zip(names(lua_names), map(int, names(lua_codes))))
    assert lua == {f"OUTCOME_{o.name}": int(o) for o in Outcome if o is not Outcome.LOST}
    acquire = read("acquire")
    used = set(re.findall(r"out\[4\] = '(\w+)'", acquire)) | set(re.findall(r"\{now, deadline, 0, '(\w+)'\}", acquire))
    assert used == {s.value for s in AcquireStatus}
    documented = next(line for line in header_lines("acquire") if line.startswith("status:"))
    assert re.findall(r'"(\w+)"', documented) == [s.value for s in AcquireStatus]


def test_no_numeric_default_is_written_in_lua():
    """A fallback is an ARGV value (the caller's) or DEFAULTS (settings.LUA_DEFAULTS)."""
    used = set()
    for path in [*LUA.glob("*.lua"), *LUA.glob("includes/*.lua")]:
        body = path.read_text()
        for field, fallback in re.findall(r"meta_num\('(\w+)', ([^)]*\)?)\)", body):
            if fallback.startswith("DEFAULTS."):
                assert fallback == f"DEFAULTS.{field}", (path.name, field)
                used.add(field)
            else:
                assert re.fullmatch(r"ARGV\[\d+\]", fallback), (path.name, field, fallback)
        for fallback in re.findall(r"task_option\(key, '\w+', '\w+', ([^)]*\]?)\)", body):
            assert re.fullmatch(r"ARGV\[\d+\]", fallback), (path.name, fallback)
        for value in SETTING_DEFAULTS.values():
            if value:
                assert not re.search(rf"\b{value}\b", body), f"{path.name} repeats the default {value}"
    assert used == set(SETTING_DEFAULTS)
    assert set(SETTING_DEFAULTS) <= set(queue_module.SETTINGS.values())
    assert queue_module.DEFAULT_DEDUP_WINDOW * 1000 == SETTING_DEFAULTS["dedup_window_ms"]
    for operation in SCRIPTS:
        assert scripts.source(operation).startswith(lua_defaults())


def test_replies_parse_into_named_fields():
    lease = [b"t1", b"tok:1", 1, b"job", b"{}", b"0", b"0", b"-1", b"", b"0"]
    reply = protocol.AcquireArgs(1, 1000, "p", 10, 32, 16).parse([1000, 2000, -1, b"limited", [b"t2"], [], [1, 0],
                                                                  *lease])
    assert (reply.status, reply.granted, reply.next_due_in) == (AcquireStatus.LIMITED, 1.0, None)
    assert (reply.ready, reply.due, reply.outcomes) == ((b"t2",), (), (Outcome.COMPLETED, Outcome.LOST))
    assert reply.leases[0].values["token"] == "tok:1"
    maintained = protocol.MaintainArgs(1, 1, "", -1, "").parse([1, 2, 3, 4, 5, 1])
    assert maintained == protocol.MaintainReply(1, 2, 3, 4, 5, True)
    assert protocol.FailArgs("t", "k", "{}", -1, 3, -1).parse([3, 1, -1]).outcome is Outcome.FAILED
    assert protocol.CancelArgs("t", "{}", -1).parse("").previous_state is None


async def test_the_python_defaults_reach_the_scripts(make_queue):
    """An explicit id forgotten at once stays reserved for the default dedup window."""
    q = make_queue("protocol-defaults", retention_completed=0)
    await q.want_events()  # events are written while somebody asked for them
    await q.offer("job", {}, task_id="kept")
    lease = await q.acquire()
    before = time.time() * 1000
    await lease.complete("done")
    reserved = await q.redis.zscore(q.keys.key("dedup"), "kept")
    assert before + SETTING_DEFAULTS["dedup_window_ms"] - 5000 < reserved < time.time() * 1000 + \
        SETTING_DEFAULTS["dedup_window_ms"] + 5000
    assert (await q.offer("job", {}, task_id="kept")).created is False
    assert len(await q.redis.xrange(q.keys.key("events"))) > 0  # events_maxlen > 0 by default


def _code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("--")]


def test_the_includes_split_into_their_definitions_without_losing_a_line():
    definitions = scripts.lib_definitions()
    code = []
    for name in scripts.includes():
        text = (LUA / "includes" / f"{name}.lua").read_text()
        code += _code_lines(text[text.index("]]") + 2:] if text.startswith("--[[") else text)
    assert code == [line for d in definitions for line in _code_lines(d.text)]
    names = [name for d in definitions for name in d.names]
    assert len(names) == len(set(names)), "a name is defined by two includes"
    assert {"now_ms", "complete_each", "K_PEEKED", "call"} <= set(names)


def test_an_include_that_breaks_the_split_rule_is_refused(monkeypatch):
    """A top-level statement other than a definition would be dropped or misplaced: refused."""
    read_file = scripts._lua_file

    def broken(name: str) -> str:
        return read_file(name) + ("\nif DEFAULTS then local x = 1 end\n" if name == "includes/time.lua" else "")
    monkeypatch.setattr(scripts, "_lua_file", broken)
    with pytest.raises(ValueError, match="not a local definition: 'if DEFAULTS"):
        scripts.lib_definitions.__wrapped__()


def test_includes_are_named_and_ordered_never_inferred():
    """Each script and include names what it uses (`--- @include`); the order puts every
    include after those it names, and a cycle is refused."""
    order = scripts.includes()
    for name in order:
        for needed in re.findall(r'^--- @include "(\w+)"$', (LUA / "includes" / f"{name}.lua").read_text(), re.M):
            assert order.index(needed) < order.index(name), (needed, name)
    assert scripts.includes("offer")[:2] == ("call", "keys")


def test_an_include_cycle_is_refused(monkeypatch):
    read_file = scripts._lua_file

    def cyclic(name: str) -> str:
        return ('--- @include "writes"\n' if name == "includes/call.lua" else "") + read_file(name)
    monkeypatch.setattr(scripts, "_lua_file", cyclic)
    with pytest.raises(ValueError, match="a cycle"):
        scripts.includes.__wrapped__("offer")


@pytest.mark.parametrize("operation", sorted(SCRIPTS))
def test_each_script_defines_every_lib_helper_it_names(operation):
    """Read off the final source, independently of the includes it names: every helper
    that the script's text uses is defined in that text before the script's own code."""
    source = scripts.source(operation)
    own = read(operation)
    assert source.endswith(own)
    head = source[:-len(own)]
    lib_names = {name for d in scripts.lib_definitions() for name in d.names}
    code = re.sub(r"--[^\n]*", "", source)  # names in comments are no use
    used = set(re.findall(r"[A-Za-z_]\w*", code)) & lib_names
    defined = {name for name in lib_names
               if re.search(rf"^local (function {name}\b|[\w, ]*\b{name}\b)", head, re.M)}
    assert used <= defined, f"{operation}.lua uses {sorted(used - defined)}: name their includes"


def test_a_script_carries_only_the_helpers_it_uses():
    """The point of the split: an offer defines none of the settlement machinery."""
    offer = scripts.source("offer")
    for helper in ("use_receipts", "complete_each", "record_attempt", "settle"):
        assert f"local function {helper}(" in scripts.prelude()
        assert f"local function {helper}(" not in offer
    assert len(scripts.prelude("offer")) < len(scripts.prelude()) / 2
