"""What every library's handler calls: one fixed-size record per handler start.

`hit(i)` appends (job number, CLOCK_MONOTONIC ns, worker slot, pid) to
$BENCH_PROBE_DIR/w<slot>.bin with O_APPEND, one write(2) per call. That is atomic
across threads and across the processes of one slot (RQ forks a child per job),
costs a few microseconds, and stays off the Redis being measured. CLOCK_MONOTONIC
is system-wide on Linux, so the producer's offer times compare with these.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

RECORD = struct.Struct("<qqii")  # job number, start ns, worker slot, pid

_fd: int | None = None
_pid: int | None = None
_slot = 0


def hit(i: int) -> None:
    global _fd, _pid, _slot
    now = time.monotonic_ns()
    pid = os.getpid()
    if _pid != pid:  # first call in this process (or a forked child)
        _slot = int(os.environ.get("BENCH_WORKER_ID", "0"))
        path = os.path.join(os.environ["BENCH_PROBE_DIR"], f"w{_slot}.bin")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _pid = pid
    os.write(_fd, RECORD.pack(int(i), now, _slot, pid))


def count(directory: str | Path) -> int:
    """Handler starts recorded so far (cheap: file sizes only)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(".bin"):
                total += entry.stat().st_size // RECORD.size
    return total


def records(directory: str | Path) -> list[tuple[int, int, int, int]]:
    out = []
    for path in sorted(Path(directory).glob("*.bin")):
        data = path.read_bytes()
        usable = len(data) - len(data) % RECORD.size
        out.extend(RECORD.iter_unpack(data[:usable]))
    return out


def clear(directory: str | Path) -> None:
    for path in Path(directory).glob("*.bin"):
        path.unlink()
