"""A small Dockerfile reader: enough to take the instructions the tests check
(FROM stages, ARG defaults, ENV, COPY, USER, WORKDIR, ENTRYPOINT, CMD, the commands
of RUN) straight from the files that would be built, instead of repeating them in
the tests; and a reader of the pip lock files the Dockerfiles install."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def substitute(self, text: str, extra: dict[str, str] | None = None) -> str:
        values = {**self.global_args, **(extra or {})}
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)

    def stage_args(self, stage: Stage) -> dict[str, str]:
        """ARG defaults visible in a stage (global ones re-declared, and its own)."""
        values: dict[str, str] = {}
        for instr in stage.all("ARG"):
            name, _, default = instr.args.partition("=")
            if default:
                values[name.strip()] = default.strip().strip('"')
            elif name.strip() in self.global_args:
                values[name.strip()] = self.global_args[name.strip()]
        return values

    def exec_form(self, keyword: str, stage: Stage | None = None) -> list[str] | None:
        """ENTRYPOINT/CMD of a stage (default: the final one); must be the JSON form."""
        instr = (stage or self.final).last(keyword)
        if instr is None:
            return None
        value = json.loads(instr.args)  # the shell form would run under /bin/sh and lose signals
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), instr
        return value

    def env(self, stage: Stage | None = None) -> dict[str, str]:
        """ENV of a stage, `key=value` pairs as the shell would split them."""
        stage = stage or self.final
        args = self.stage_args(stage)
        env: dict[str, str] = {}
        for instr in stage.all("ENV"):
            for pair in shlex.split(instr.args):
                key, sep, value = pair.partition("=")
                assert sep, f"{self.path}:{instr.line}: use ENV key=value"
                env[key] = self.substitute(value, args)
        return env

    def commands(self, stage: Stage) -> list[list[str]]:
        """The commands of a stage's RUN instructions (shell form, split at `&&`), as words."""
        return [shlex.split(part) for instr in stage.all("RUN") for part in instr.args.split("&&") if part.strip()]

    def copies(self, stage: Stage) -> list[tuple[list[str], str]]:
        """(sources, destination) of each COPY from the build context (not --from)."""
        result = []
        for instr in stage.all("COPY"):
            words = shlex.split(instr.args)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            result.append((words[:-1], words[-1]))
        return result


def parse(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        logical.append((start, buffer + stripped))
        buffer = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, args = text.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert keyword == "ARG", f"{path}:{number}: only ARG may come before FROM"
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, args, number))
    return Dockerfile(path, global_args, stages)


# The lock each image's build stage installs (tooling/lock.sh writes them), and the
# extras of effectmq it holds the dependencies of.
LOCKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "operator": ("operator/requirements.lock", ("operator", "dashboard", "otel")),
    "worker": ("worker_image/requirements.lock", ("otel",)),
}


@dataclass
class Pin:
    requirement: Requirement
    hashes: list[str]

    @property
    def version(self) -> str:
        (spec,) = self.requirement.specifier  # pip-compile pins each with exactly one `==`
        return spec.version


def read_lock(path: Path) -> dict[str, Pin]:
    """A pip-compile --generate-hashes file: canonical name -> its pin and hashes.
    Option lines (an index, find-links, a trusted host) are refused: a lock names
    packages only, and the index comes from the build's pip settings."""
    pins: dict[str, Pin] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"{path.name}: option line {line.split()[0]!r} in a lock"
        requirement = Requirement(line.split("--hash=", 1)[0].strip())
        pins[canonicalize_name(requirement.name)] = Pin(requirement, re.findall(r"--hash=(\S+)", line))
    return pins
