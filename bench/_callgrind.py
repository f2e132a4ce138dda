"""Where a redis-server's instructions went, from a callgrind dump: which commands a script
ran, what handing arguments and replies between Lua and Redis cost, the Lua code itself,
and the FCALL around it. Needs a redis-server with symbols (bench/redis_symbols.sh builds
one from Debian's source package; Debian's own binary is stripped, so its Lua and most of
its internals have no names)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_COMPRESSED = re.compile(r"\((\d+)\)(?: (.*))?")
_COST_LINE = re.compile(r"^[0-9+*-]")


@dataclass
class Profile:
    own: Counter  # function -> instructions spent in its own code
    calls: Counter  # (caller, callee) -> instructions spent in the callee and below
    count: Counter  # (caller, callee) -> how many calls

    def inclusive(self, function: str) -> int:
        """Instructions in `function` and below, over all its callers (not for recursive ones)."""
        return sum(cost for (_, callee), cost in self.calls.items() if callee == function)

    def callees(self, caller_prefix: str, suffix: str) -> Counter:
        """Instructions of the callees named ...`suffix` of callers named `caller_prefix`...
        (callgrind names a recursive call "call'2")."""
        out: Counter = Counter()
        for (caller, callee), cost in self.calls.items():
            if caller.startswith(caller_prefix) and callee.endswith(suffix):
                out[callee] += cost
        return out


def parse(path: str) -> Profile:
    """A callgrind output file (one event, Ir; name compression as callgrind writes it)."""
    names: dict[str, str] = {}
    own: Counter = Counter()
    calls: Counter = Counter()
    count: Counter = Counter()
    function = callee = ""
    pending: int | None = None  # the call count of a calls= line, whose cost line follows

    def name(text: str) -> str:
        match = _COMPRESSED.match(text)
        if not match:
            return text
        if match.group(2):
            names[match.group(1)] = match.group(2)
        return names.get(match.group(1), text)

    with open(path) as lines:
        for line in lines:
            if line.startswith("fn="):
                function = name(line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                callee = name(line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                pending = int(line[6:].split()[0])
            elif _COST_LINE.match(line):
                fields = line.split()
                if len(fields) < 2:
                    continue
                if pending is not None:
                    calls[(function, callee)] += int(fields[1])
                    count[(function, callee)] += pending
                    pending = None
                else:
                    own[function] += int(fields[1])
    return Profile(own, calls, count)


def breakdown(profile: Profile) -> list[tuple[str, int]]:
    """The parts of the FCALLs (or EVALSHAs) in the dump, in instructions, largest first
    within each group; the commands a script ran are listed by name."""
    total = sum(profile.own.values())
    script_call = profile.inclusive("fcallCommand") + profile.inclusive("evalShaCommand")
    lua = profile.inclusive("lua_pcall")
    redis_calls = profile.inclusive("luaRedisGenericCommand")
    commands = profile.callees("call'", "Command")  # the commands scripts ran (the outer call is "call")
    parts = [(f"  {command.removesuffix('Command')}", cost) for command, cost in commands.most_common()]
    run = sum(commands.values())
    return [
        ("all of redis-server", total),
        ("outside the script call (network, parsing, event loop)", total - script_call),
        ("script call around Lua (KEYS/ARGV into Lua, its reply out)", script_call - lua),
        ("Lua code (interpreter, tables, strings, GC)", lua - redis_calls),
        ("redis.call: arguments in, replies into Lua", redis_calls - run),
        ("commands the script ran", run),
        *parts,
    ]
