"""kopf's watch streams, made to outlive a deleted or re-created CRD.

The operator uses kopf as its watch pipe; this module guards kopf's watcher where
kopf would end the process or never watch again (see `Watches`).
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from ..api import GROUP, VERSION

try:  # kopf's internals that Watches wraps and calls (where kopf 1.37 to 1.45 has them)
    from kopf._cogs.clients import api as kopf_api
    from kopf._cogs.clients import errors as kopf_errors
    from kopf._core.reactor import queueing as kopf_queueing
except ImportError:  # a kopf that moved them: Watches.install() says it cannot guard the watches
    kopf_api = kopf_errors = kopf_queueing = None  # type: ignore[assignment]

UNSERVED_RECHECK = 5.0  # seconds between looks at a resource whose watch answered 404 (its CRD deleted)
OWN_RESOURCES = (f"queues.{GROUP}", f"schedules.{GROUP}")
CRDS = "customresourcedefinitions.apiextensions.k8s.io"
log = logging.getLogger("effectmq.operator")


class Watches:
    """kopf's watch streams, made to outlive a deleted CRD, and what they can watch now.

    kopf ends the whole operator (exit code 1) when a watch stream answers 404: its
    watcher raises APINotFoundError and the task that runs all watchers re-raises it.
    That happens when a CRD is deleted and the watch reconnects before kopf's own CRD
    observer has stopped it (the observer re-reads API discovery, which lags the
    deletion). Each watcher here runs inside a loop instead: on a 404 it says so,
    looks again every UNSERVED_RECHECK seconds, and watches again (a fresh list) when
    the resource is served again; kopf's observer may stop it meanwhile (and starts a
    new one when the CRD is back). The probe reports which of the operator's own
    resources have no working watch (deleted, or never created), and stays 200: a
    restart cannot bring a CRD back.

    kopf starts the watch of a re-created CRD only if API discovery lists it when kopf
    re-reads discovery, which it does on each CRD event alone. A busy API server can
    list it after the CRD's last event (Established), and then kopf would never watch
    it. So beside kopf's CRD watch, while one of ours has no watch, discovery is read
    every UNSERVED_RECHECK seconds and, once it lists it, a CRD event is replayed to
    kopf's rescan."""

    def __init__(self) -> None:
        self._state: dict[tuple[str, str | None], bool] = {}  # (plural.group, namespace) -> watching

    def install(self) -> None:
        """Wrap kopf's watcher (idempotent: once per process)."""
        if kopf_queueing is None or not hasattr(kopf_queueing, "watcher"):
            log.warning("kopf %s has no watcher where this operator expects it: a deleted CRD will end the "
                        "process (exit 1) as it did before", getattr(kopf, "__version__", "?"))
            return
        current = kopf_queueing.watcher
        if getattr(current, "__wrapped_by__", None) is self:
            return
        original = getattr(current, "__wrapped__", current)

        async def watcher(*, resource, namespace, settings, **kwargs) -> None:
            await self._watch(original, resource=resource, namespace=namespace, settings=settings, **kwargs)

        watcher.__wrapped__ = original  # type: ignore[attr-defined]  # how install() knows its own
        watcher.__wrapped_by__ = self  # type: ignore[attr-defined]
        kopf_queueing.watcher = watcher

    def unserved(self, names: tuple[str, ...] = OWN_RESOURCES) -> list[str]:
        """Those of `names` that no watch stream is watching now."""
        return [name for name in names if not any(on for (n, _), on in self._state.items() if n == name)]

    async def _watch(self, original, *, resource, namespace, settings, **kwargs) -> None:
        name = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        key = (name, namespace)
        where = f"in namespace {namespace}" if namespace else "cluster-wide"
        if name == CRDS:
            await self._watch_crds(original, resource=resource, namespace=namespace, settings=settings, **kwargs)
            return
        self._state[key] = True
        try:
            while True:
                try:
                    return await original(resource=resource, namespace=namespace, settings=settings, **kwargs)
                except kopf_errors.APINotFoundError:
                    self._state[key] = False
                    log.warning("%s are not served (404: their CRD was deleted?); the operator keeps running "
                                "and watches them again %s when they are back", name, where)
                    await self._until_served(resource, namespace, settings)
                    self._state[key] = True
                    log.info("%s are served again: watching them %s", name, where)
        finally:
            self._state.pop(key, None)

    async def _watch_crds(self, original, *, resource, namespace, settings, processor, **kwargs) -> None:
        rediscover = asyncio.create_task(self._rediscover(processor, settings), name="effectmq-rediscover")
        try:
            await original(resource=resource, namespace=namespace, settings=settings, processor=processor, **kwargs)
        finally:
            rediscover.cancel()
            await asyncio.gather(rediscover, return_exceptions=True)

    async def _rediscover(self, rescan, settings) -> None:
        said: set[str] = set()  # said once at INFO, then at DEBUG until watched again
        while True:
            await asyncio.sleep(UNSERVED_RECHECK)
            missing = self.unserved()
            said &= set(missing)
            if not missing:
                continue
            try:
                listed = await kopf_api.get(f"/apis/{GROUP}/{VERSION}", settings=settings, logger=log)
            except Exception as exc:  # 404 while none of the group's CRDs exists; an API server away
                log.debug("reading the discovery of %s/%s: %s", GROUP, VERSION, exc)
                continue
            found = {f"{r.get('name')}.{GROUP}" for r in listed.get("resources") or []} & set(missing)
            if found:
                log.log(logging.DEBUG if found <= said else logging.INFO,
                        "%s listed by API discovery with no watch: asking kopf to look again", ", ".join(sorted(found)))
                said |= found
                await rescan(raw_event={"type": "MODIFIED", "object": {"spec": {"group": GROUP}}})

    async def _until_served(self, resource, namespace, settings) -> None:
        url = resource.get_url(namespace=namespace, params={"limit": "1"})
        while True:
            await asyncio.sleep(UNSERVED_RECHECK)
            try:
                await kopf_api.get(url, settings=settings, logger=log)
                return
            except kopf_errors.APINotFoundError:
                continue
            except Exception as exc:  # an API server away: look again later
                log.debug("looking for %s: %s", url, exc)


WATCHES = Watches()
