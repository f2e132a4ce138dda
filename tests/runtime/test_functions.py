"""The scripts as a Redis function library (FCALL), and the fall back to EVALSHA where
Redis has no functions for us (6.2, or an ACL that forbids them)."""

from __future__ import annotations

import re

import pytest
import redis.exceptions as redis_errors

import effectmq
from effectmq.protocol import scripts
from effectmq.protocol.protocol import SCRIPTS
from tests.fixtures.redis import free_port, has_functions


def test_the_library_registers_every_operation_and_resets_every_definition_per_call():
    name, source = scripts.library()
    assert source.startswith(f"#!lua name={name}\n")
    registered = re.findall(r"function_name = '(\w+)', flags = \{([^}]*)\}", source)
    assert {fn for fn, _ in registered} == {scripts.function_name(op) for op in SCRIPTS}
    # Only the scripts a full Redis must refuse lack allow-oom (includes/writes.lua, FIRST_WRITE_FREES).
    refused = {fn for fn, flags in registered if "allow-oom" not in flags and "no-writes" not in flags}
    assert refused == {scripts.function_name(op) for op in ("offer", "progress", "hold")}
    # Those that write nothing say so, or a read-only replica refuses them (FCALL is a write).
    assert {fn for fn, flags in registered if "no-writes" in flags} == \
        {scripts.function_name(op) for op in ("stats", "live_workers")}
    begin = source[source.index("local function begin("):source.index("\nend\n", source.index("local function begin("))]
    for d in scripts.lib_definitions():
        if not any(line.startswith("local function ") for line in d.text.splitlines()):
            assert re.search(rf"^  [\w, ]*\b{sorted(d.names)[0]}\b[\w, ]* =", begin, re.M), \
                f"{sorted(d.names)} is not assigned again on each call"


def test_a_change_to_any_script_names_a_new_library(monkeypatch):
    """A rolling upgrade that changes one operation's script (not an include) must not call
    the library of the version before it, loaded under the same name: that runs old code."""
    before = scripts.library()
    read = scripts._lua_file

    def changed(name: str) -> str:
        return read(name) + ("-- changed\n" if name == "acquire.lua" else "")

    monkeypatch.setattr(scripts, "_lua_file", changed)
    scripts.library.cache_clear()
    try:
        name, source = scripts.library()
        assert "-- changed" in source
        assert name != before[0]
    finally:
        scripts.library.cache_clear()


@pytest.mark.redis7
async def test_a_call_does_not_see_the_task_keys_an_earlier_call_declared(make_queue):
    """Per-call state lives in the library's upvalues: each call starts from its own."""
    q = make_queue("functions-fresh-state")
    await q.offer("job", {}, task_id="t1")
    lease = await q.acquire()
    await lease.progress(1)  # declares t1's hash: the library keeps its set of declared keys
    keys = q.keys.script_keys
    with pytest.raises(redis_errors.ResponseError, match="undeclared task key"):
        await q.redis.fcall(scripts.function_name("progress"), len(keys), *keys, "t1", lease.token, "2")
    assert (await q.get("t1")).progress == 1


@pytest.mark.redis7  # on 6.2 (no such ACL category), the whole pass against it runs by SHA
async def test_without_functions_the_scripts_run_by_sha(make_redis):
    """An ACL that forbids FCALL and FUNCTION (as on a Redis without them): EVALSHA, all of it."""
    server = make_redis()
    admin = server.client()
    admin.acl_setuser("nofunctions", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-fcall", "-fcall_ro", "-function"])
    url = f"redis://nofunctions:pw@127.0.0.1:{server.port}/0"
    async with effectmq.TaskQueue("by-sha", url=url) as q:
        await q.offer("job", {"n": 1})
        lease = await q.acquire()
        await lease.complete("done")
        assert (await q.stats()).completed == 1
        assert q._scripts.functions is False
    stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] >= 4
    assert stats.get("cmdstat_fcall", {}).get("calls", 0) == 0  # refused by the ACL, never run
    assert admin.function_list() == []


@pytest.mark.parametrize("reply, refused", [
    ("unknown command `FCALL`, with args beginning with: `effectmq_x_offer`, `17`, ", True),  # Redis 6.2
    ("unknown command 'FCALL', with args beginning with: 'effectmq_x_offer' '17' ", True),  # 7's quoting
    ("unknown command 'FUNCTION', with args beginning with: 'LOAD' ", True),
    ("this user has no permissions to run the 'fcall' command", True),
    ("this user has no permissions to run the 'function|load' command", True),
    ("Function not found", False),  # loaded, then sent again
    ("unknown command 'ZMSCORE', with args beginning with: ", False),  # inside a script: not ours to hide
])
def test_which_replies_mean_redis_has_no_functions_for_us(reply, refused):
    assert scripts._functions_refused(redis_errors.ResponseError(reply)) is refused


@pytest.mark.redis7
async def test_a_full_redis_that_lost_the_library_still_lets_work_in_flight_settle(make_queue):
    """FUNCTION LOAD is refused while Redis is full (it may grow memory): the attempt in
    flight settles by SHA instead, as it would have before the library (FIRST_WRITE_FREES)."""
    q = make_queue("functions-full")
    await q.offer("job", {}, task_id="t1")
    lease = await q.acquire()
    await q.redis.function_flush()  # as after a restart without persistence
    await q.redis.config_set("maxmemory", 1)
    try:
        with pytest.raises(effectmq.RedisUnavailable, match="OOM"):
            await q.offer("job", {})  # refused, as offers are while Redis is full
        await lease.complete("done")
    finally:
        await q.redis.config_set("maxmemory", 0)
    assert (await q.stats()).completed == 1 and (await q.get("t1")).result == "done"
    assert q._scripts.functions is False  # by SHA from then on, in this client


async def test_a_read_only_replica_answers_the_reads(make_redis):
    """Was: pointed at a replica (a read-only dashboard, `effectmq stats`), stats() and
    workers() failed with READONLY: a function without the no-writes flag is a write to
    a replica, where the same scripts by EVALSHA had run."""
    server = make_redis()
    admin = server.client()
    async with effectmq.TaskQueue("replica-reads", url=server.url) as q:
        await q.offer("job", {}, task_id="t1")
        await q.worker_beat("w1", 0, 4, 60)
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # never reachable: the data stays
    try:
        async with effectmq.TaskQueue("replica-reads", url=server.url) as q:
            assert (await q.stats()).waiting == 1
            assert await q.workers() == {"w1": (0, 4)}
            assert q._scripts.functions is has_functions()
            with pytest.raises(effectmq.RedisUnavailable, match="READONLY"):
                await q.offer("job", {})  # a write still is one
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")


def _fake_library(name: str) -> str:
    return f"#!lua name={name}\nredis.register_function('{name}_noop', function() return 1 end)\n"


DAY_MS = 86_400_000


def test_a_library_nobody_loaded_for_a_week_is_deleted_and_one_never_recorded_is_recorded():
    now = 100 * DAY_MS
    plan = scripts.stale_libraries(
        listed={"effectmq_ours", "effectmq_week_old", "effectmq_day_old", "effectmq_unrecorded"},
        recorded={"effectmq_week_old": str(now - 8 * DAY_MS), "effectmq_day_old": str(now - DAY_MS),
                  "effectmq_gone": str(now - DAY_MS), "effectmq_ours": str(now - 30 * DAY_MS)},
        loaded="effectmq_ours", now_ms=now)
    assert plan == scripts.LibraryCleanup(delete=["effectmq_week_old"], record=["effectmq_unrecorded"],
                                          forget=["effectmq_gone"])


@pytest.mark.redis7
async def test_loading_the_library_unloads_the_versions_nobody_loaded_for_a_week(make_redis):
    """Was: every version's library stayed in Redis for good (about 170 kB each, and in
    every RDB and AOF), one more per upgrade."""
    server = make_redis()
    admin = server.client()
    now = int(admin.time()[0]) * 1000
    for name in ("effectmq_00000000000000aa", "effectmq_00000000000000bb", "effectmq_00000000000000cc"):
        admin.function_load(_fake_library(name))
    admin.function_load(_fake_library("other_library"))  # not ours: never touched
    admin.hset(scripts.LIBRARIES_KEY, mapping={"effectmq_00000000000000aa": now - 8 * DAY_MS,
                                               "effectmq_00000000000000bb": now - DAY_MS})
    async with effectmq.TaskQueue("unload-stale", url=server.url) as q:
        await q.offer("job", {})  # 'Function not found': this version's library is loaded
    names = {scripts.library_name_of(lib) for lib in admin.function_list()}
    ours = scripts.library()[0]
    assert names == {ours, "effectmq_00000000000000bb", "effectmq_00000000000000cc", "other_library"}
    recorded = admin.hgetall(scripts.LIBRARIES_KEY)
    assert set(recorded) == {ours, "effectmq_00000000000000bb", "effectmq_00000000000000cc"}
    assert abs(int(recorded[ours]) - now) < 60_000 and recorded["effectmq_00000000000000cc"] == recorded[ours]
    # A version still in use whose library was deleted loads it again at its next call.
    admin.function_delete(ours)
    async with effectmq.TaskQueue("unload-stale", url=server.url) as q:
        await q.offer("job", {})
        assert (await q.stats()).waiting == 2
