"""The fenced code blocks of the README and docs/, as the tests run them.

A block runs as written unless the line right before its fence is a marker:

    <!-- not-run: why -->     never run here; the reason says why (and what tests it instead)
    <!-- file: NAME -->       a Python block saved as NAME in the working folder (a module
                              the following blocks import or run), not run by itself
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
# Fences that hold no command: manifests, data, usage lines, Redis commands shown as text.
NOT_CODE = {"yaml", "json", "text", "", "dockerfile", "toml", "promql", "lua"}

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(not-run|file):\s*(.*?)\s*-->\s*\Z", re.S)


@dataclass
class Block:
    page: str  # relative to the checkout
    line: int
    lang: str
    code: str
    not_run: str | None = None  # the reason
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.not_run is None and self.file is None and self.lang in SHELL | PYTHON


def pages() -> list[Path]:
    """README.md and every page under docs/, but docs/kubernetes-walkthrough.md: its blocks
    need a cluster, and tests/cluster runs them there, verbatim."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if p.relative_to(ROOT).as_posix() != "docs/kubernetes-walkthrough.md"]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        block = Block(page.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1, m.group(1).lower(),
                      m.group(2))
        if marker and marker.group(1) == "not-run":
            block.not_run = marker.group(2)
        elif marker:
            block.file = marker.group(2)
        found.append(block)
    return found


def environment(redis_url: str, extra_path: list[str] = ()) -> dict[str, str]:
    """What a reader's shell has after the install step: the venv's commands first on
    PATH, the Redis URL in EFFECTMQ_REDIS_URL (the tests' own redis-server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env["PATH"] = os.pathsep.join([*extra_path, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["EFFECTMQ_REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    # This checkout's code, whichever checkout the shared test virtualenv was last installed from.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "operator")])
    return env


class Session:
    """Runs one page's blocks in order in one folder; what a shell block leaves running in
    the background (`cmd &`) lives until close()."""

    def __init__(self, workdir: Path, env: dict[str, str], python: str = sys.executable, timeout: float = 90):
        self.workdir, self.env, self.python, self.timeout = workdir, env, python, timeout
        self.groups: list[int] = []
        self.count = 0

    def run(self, block: Block) -> subprocess.CompletedProcess:
        if block.file is not None:
            (self.workdir / block.file).write_text(block.code)
            return subprocess.CompletedProcess([], 0, "", "")
        self.count += 1
        if block.lang in PYTHON:
            script = self.workdir / f"block_{self.count}.py"
            script.write_text(block.code)
            argv = [self.python, script.name]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", block.code]
        log = self.workdir / f"block_{self.count}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.groups.append(proc.pid)
            try:
                code = proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                code = -1
        output = log.read_text(errors="replace")
        if code == -1:
            output += f"\n(timed out after {self.timeout} s)"
        return subprocess.CompletedProcess(argv, code, output, "")

    def earlier_output(self, chars: int = 1500) -> str:
        """The end of what the earlier blocks wrote, those left running too (a worker that
        failed to start shows here, not in the block that waited for it)."""
        return "".join(f"\n--- block {n} ---\n{(self.workdir / f'block_{n}.log').read_text(errors='replace')[-chars:]}"
                       for n in range(1, self.count))

    def close(self) -> None:
        """SIGTERM to what the blocks left running (workers drain), SIGKILL after 15 s."""
        for group in self.groups:
            _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_group_alive(g) for g in self.groups):
            time.sleep(0.1)
        for group in self.groups:
            _signal_group(group, signal.SIGKILL)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":  # the list the report gives: python -m tests.docs.blocks
    for page in pages():
        for b in blocks(page):
            state = "runs" if b.runs else f"file {b.file}" if b.file else f"not run: {b.not_run}" \
                if b.not_run else f"not code ({b.lang or 'no language'})"
            print(f"{b.where:40} {b.lang or '-':8} {state}")
