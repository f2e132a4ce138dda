"""The registry of watched objects: the latest version of each, by key.

Fed by the watch streams (through kopf) and healed by a periodic full list, so a
missed or late event costs one relist period at most.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

Key = tuple[str, str]  # (namespace, name)
log = logging.getLogger("effectmq.operator")


def key_of(body: dict) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def newer(incoming: dict, known: dict | None) -> bool:
    """Whether a watched object is at least as new as the one we hold (resourceVersions
    are etcd revisions here; when they do not compare as numbers, trust arrival order)."""
    if known is None:
        return True
    a, b = incoming["metadata"].get("resourceVersion", ""), known["metadata"].get("resourceVersion", "")
    return not (a.isdigit() and b.isdigit()) or int(a) >= int(b)


# The watch streams can start late: the API server answers a watch of a newly created
# CRD with 429 "storage is (re)initializing" until its watch cache is ready, and kopf
# retries after 1, 1, 2, 3, 5, 8, 13 and 21 s. Until a registry's watch has reported
# something, or STARTUP_WINDOW has passed, it lists every STARTUP_RELIST_EVERY seconds,
# so an object created meanwhile waits seconds, not a whole relist period.
STARTUP_WINDOW = 120.0
STARTUP_RELIST_EVERY = 2.0


class Registry:
    """The latest version of each watched object, by key; newer versions win. A full
    list every `relist_every` seconds (more often in the first STARTUP_WINDOW) heals
    whatever the watch stream missed or has not reported yet."""

    def __init__(self, lister: Callable[[], Awaitable[list[dict]]], *, relist_every: float = 60.0,
                 on_listed: Callable[[str, dict, dict | None], Any] | None = None):
        self.items: dict[Key, dict] = {}
        self.synced = asyncio.Event()  # set after the first full list
        self._lister = lister
        # Told of what a list found that the watch had not reported, as a watch event would
        # have: (ADDED or MODIFIED, the listed body, the one held before) or (DELETED, the
        # body held, None).
        self._on_listed = on_listed
        self._relist_every = relist_every
        self._startup_until = time.monotonic() + STARTUP_WINDOW
        self._next_list = 0.0
        self._gone: dict[str, float] = {}  # uids deleted recently: a stale list must not resurrect them
        self._stored_at: dict[Key, float] = {}  # when each held version was stored (monotonic)

    def watch_reported(self) -> None:
        """The watch stream runs: the lists go back to their usual period."""
        self._startup_until = 0.0

    def put(self, body: dict) -> dict | None:
        """Store a watched version; returns the one held before."""
        key = key_of(body)
        if body["metadata"].get("uid") in self._gone:
            return None
        old = self.items.get(key)
        if newer(body, old):
            self.items[key] = body
            self._stored_at[key] = time.monotonic()
        return old

    def drop(self, body: dict) -> dict | None:
        self._gone[body["metadata"].get("uid")] = time.monotonic()
        self._stored_at.pop(key_of(body), None)
        if len(self._gone) > 10_000:
            cutoff = time.monotonic() - 600
            self._gone = {u: t for u, t in self._gone.items() if t > cutoff}
        return self.items.pop(key_of(body), None)

    async def refresh(self, deadline: float, what: str) -> bool:
        """List everything when due; True once the registry has been in sync."""
        if time.monotonic() >= self._next_list:
            started = time.monotonic()
            try:
                listed = await asyncio.wait_for(self._lister(), deadline)
            except Exception as exc:
                log.warning("listing %s failed: %s", what, exc)
                self._next_list = time.monotonic() + 2.0
            else:
                self._replace_all(listed, started)
                now = time.monotonic()
                self._next_list = now + (STARTUP_RELIST_EVERY if now < self._startup_until else self._relist_every)
                self.synced.set()
        return self.synced.is_set()

    def _replace_all(self, bodies: list[dict], started: float) -> None:
        """Hold what a list that began at `started` found. One held but not listed is gone,
        unless it was stored after the list began: the list is a snapshot older than that
        (a watch event of a new object often beats the list it is missing from)."""
        listed = {key_of(b): b for b in bodies if b["metadata"].get("uid") not in self._gone}
        changes: list[tuple[str, dict, dict | None]] = []
        for key in [k for k in self.items if k not in listed and self._stored_at.get(k, 0.0) < started]:
            self._stored_at.pop(key, None)
            changes.append(("DELETED", self.items.pop(key), None))
        for key, body in listed.items():
            old = self.put(body)
            if self.items.get(key) is body:
                changes.append(("ADDED" if old is None else "MODIFIED", body, old))
        if self._on_listed:
            for change in changes:
                self._on_listed(*change)
