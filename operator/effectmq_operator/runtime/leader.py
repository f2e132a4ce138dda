"""Leader election on a coordination.k8s.io Lease, with client-go's semantics.

Only the leader runs the periodic loop (scaling, maintenance, schedule ticks), so
two operator replicas never fight over replica counts. The leader renews every
retry_period and stops acting once renew_deadline has passed since its last
confirmed renewal, by its own monotonic clock, even while a renewal call hangs.
A follower takes over only after it has seen the record unchanged for the
Lease's duration by its own monotonic clock (no wall clocks are compared), and
renew_deadline < lease_seconds, so two leaders never overlap. Every API call has
a client-side timeout and runs on the elector's own daemon threads: a blackholed
connection fails fast, never queues behind other work, and never keeps the
process alive after SIGTERM.

Liveness (`healthy()`, `problem()`) fails only for what a restart can cure: the
loop ended, no Lease call came back at all for `stuck_after`, or the API server
refused our credentials for `refused_after`. An API server that is down or
unreachable ends the leadership (at renew_deadline, as above), never the
liveness: restarting cannot bring the server back, and would only delay the
leadership once it is.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import random
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

from .cancellation import raise_if_cancelled
from .kube import api_error, disable_client_retries
from .threads import DaemonThreadPool

log = logging.getLogger("effectmq.operator.leader")

LEASE_SECONDS = 15.0  # how long a leader's Lease lasts unrenewed (kube-controller-manager's default)
# What a Lease call can fail with when the API server is slow, unreachable or
# refuses: retried on the next round, never fatal.
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, asyncio.TimeoutError)
# Liveness bounds. A working loop hears back from a call at least every retry period
# plus one call; stuck: nothing came back for this many lease durations (60 s by default).
STUCK_LEASES = 4
# 401/403 for this long fails liveness. The client re-reads the ServiceAccount token
# file every 60 s, so a rotated token has had two chances to be picked up by then.
REFUSED_AFTER = 120.0
REFUSED = (401, 403)


@dataclass(frozen=True)
class ElectionFacts:
    """What the elector recorded that tells a broken process from an unreachable API server."""

    state: str  # new | running | stopped | died
    answered_at: float  # when a Lease call last came back with any outcome, a connection error or timeout included
    refused_since: float | None  # when the current run of 401/403 answers began (None: not refused)


def liveness_problem(facts: ElectionFacts, now: float, *, stuck_after: float, refused_after: float) -> str | None:
    """Why the process is broken, for the liveness probe; None when it is not.

    A call that failed to connect or timed out still came back: the API server being
    down is not a problem here. Stuck is no call coming back at all (one hung past its
    timeouts, a wedged thread pool, a loop that stopped calling); refused is the API
    server rejecting our token or our permissions for longer than the client's own
    re-reads of the token could mend (a restart starts from the mounted token again)."""
    if facts.state in ("stopped", "died"):
        return f"the leader election {facts.state}"
    silent = now - facts.answered_at
    if silent > stuck_after:
        return f"the leader election is stuck: no Lease call came back for {silent:.0f}s (limit {stuck_after:g}s)"
    if facts.refused_since is not None and now - facts.refused_since > refused_after:
        return (f"the API server refused every Lease call (401/403) for {now - facts.refused_since:.0f}s "
                f"(limit {refused_after:g}s): check the ServiceAccount token and RBAC")
    return None


def coordination_api(configuration: kubernetes.client.Configuration | None = None,
                     ) -> kubernetes.client.CoordinationV1Api:
    """A CoordinationV1Api on its own ApiClient (its own connection pool) for one elector,
    from a copy of `configuration` (default: the one load_*_config() installed)."""
    if configuration is None:
        config = kubernetes.client.Configuration.get_default_copy()
    else:
        config = copy.copy(configuration)
    return kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(config))


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _describe(exc: BaseException) -> str:
    """One line for a log, no traceback."""
    if isinstance(exc, ApiException):
        return api_error(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__}: no answer in time"


class LeaderElector:
    """Campaign for the Lease `namespace/name` as `identity`.

    `coordination` must sit on an ApiClient of its own: the elector turns off
    urllib3's retries on it and bounds every call with `request_timeout`
    ((connect, read) seconds; default (min(2, retry_period), retry_period)).
    Callers read `is_leader` before every action taken as the leader, and wire
    `healthy()` (or `problem()`, which says why not) to the liveness probe;
    `stuck_after` (default STUCK_LEASES lease durations, or twice the longest wait
    for a call if that is longer) and `refused_after` bound it (liveness_problem).
    `on_started_leading` and `on_stopped_leading` are optional plain callables run
    on transitions.
    """

    def __init__(self, coordination: kubernetes.client.CoordinationV1Api, *, namespace: str, name: str,
                 identity: str | None = None, lease_seconds: float = LEASE_SECONDS, renew_deadline: float = 10.0,
                 retry_period: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 request_timeout: tuple[float, float] | None = None, stuck_after: float | None = None,
                 refused_after: float = REFUSED_AFTER):
        if not retry_period > 0:
            raise ValueError(f"retry_period must be positive, not {retry_period}")
        if not renew_deadline < lease_seconds:
            raise ValueError(f"renew_deadline ({renew_deadline}s) must be shorter than lease_seconds "
                             f"({lease_seconds}s), or a stalled leader could still act after a takeover")
        if not retry_period < renew_deadline:
            raise ValueError(f"retry_period ({retry_period}s) must be shorter than renew_deadline "
                             f"({renew_deadline}s), or a single slow renewal would end the leadership")
        if request_timeout is None:
            request_timeout = (min(2.0, retry_period), retry_period)
        if len(request_timeout) != 2 or min(request_timeout) <= 0:
            raise ValueError(f"request_timeout must be (connect, read) seconds, not {request_timeout!r}")
        self.coordination = coordination
        self.namespace = namespace
        self.name = name
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_seconds = float(lease_seconds)
        self.renew_deadline = float(renew_deadline)
        self.retry_period = float(retry_period)
        self.request_timeout = (float(request_timeout[0]), float(request_timeout[1]))
        # The outer bound of one call: the socket timeouts, plus slack for a trickling reply or a queued call.
        self.call_timeout = sum(self.request_timeout) + 1.0
        self.release_timeout = 2 * self.call_timeout  # a read and a replace
        # The longest a working loop waits for a call to come back: a follower's pause, then one call.
        longest_wait = 1.2 * self.retry_period + self.call_timeout
        if stuck_after is None:
            stuck_after = max(STUCK_LEASES * self.lease_seconds, 2 * longest_wait)
        self.stuck_after = float(stuck_after)
        if not self.stuck_after >= 2 * longest_wait:
            raise ValueError(f"stuck_after ({self.stuck_after:g}s) must be at least twice the longest a working "
                             f"election waits for a call ({longest_wait:g}s), or a slow one would restart the process")
        if not refused_after > 0:
            raise ValueError(f"refused_after must be positive, not {refused_after}")
        self.refused_after = float(refused_after)
        self.on_started_leading: Callable[[], Any] | None = None
        self.on_stopped_leading: Callable[[], Any] | None = None

        self._clock = clock
        self._api_client = coordination.api_client
        disable_client_retries(self._api_client)
        self._pool = DaemonThreadPool(2, f"lease-{name}")
        self._state = "new"  # new | running | stopped | died
        self._leading = False
        self._released = False
        self._renewed_at = -math.inf  # when the last confirmed acquire/renew was *sent*
        self._lease: dict | None = None  # the Lease as we last wrote it (for renewals without a read)
        self._observed: tuple | None = None  # (holderIdentity, renewTime) as last seen
        self._observed_at = -math.inf  # when that record was first seen
        self._observed_duration = self.lease_seconds
        self._answered_at = clock()  # when a Lease call last came back, with any outcome (set on its thread)
        self._refused_since: float | None = None  # when the current run of 401/403 answers began
        self._failures = 0
        self._warned_at = -math.inf
        self._deadline_timer: asyncio.TimerHandle | None = None

    # -- what callers read --------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Leading, and the last confirmed renewal is younger than renew_deadline."""
        return self._leading and self._clock() - self._renewed_at < self.renew_deadline

    @property
    def holder(self) -> str | None:
        """The holder as last seen on the Lease ("" when released, None before the first read)."""
        return self._observed[0] if self._observed else None

    def facts(self) -> ElectionFacts:
        return ElectionFacts(self._state, self._answered_at, self._refused_since)

    def problem(self) -> str | None:
        """Why this process is broken (liveness_problem), None while it is not."""
        return liveness_problem(self.facts(), self._clock(), stuck_after=self.stuck_after,
                                refused_after=self.refused_after)

    def healthy(self) -> bool:
        """For the liveness probe: no problem(). True while the API server is unreachable."""
        return self.problem() is None

    # -- the loop -------------------------------------------------------------

    async def run(self) -> None:
        """Campaign and renew until cancelled; returns promptly on cancellation even
        while a call hangs (the thread finishes, or not, on its own)."""
        if self._state == "running":
            raise RuntimeError(f"leader election for Lease {self._ref} is already running")
        self._state = "running"
        self._answered_at = self._clock()
        log.info("%s campaigning for Lease %s (lease %gs, renew deadline %gs, retry %gs)", self.identity,
                 self._ref, self.lease_seconds, self.renew_deadline, self.retry_period)
        loop = asyncio.get_running_loop()
        try:
            while True:
                raise_if_cancelled()
                started = loop.time()
                failed = False
                try:
                    holding = await self._round()
                except API_ERRORS as exc:
                    failed = True
                    self._trouble(exc)
                else:
                    self._recovered()
                    if holding:
                        self._start_leading()
                    elif self._leading:
                        self._stand_down(f"the Lease is held by {self.holder or 'nobody'}")
                if self._leading and not self.is_leader:
                    self._stand_down(f"no renewal within the {self.renew_deadline:g}s renew deadline")
                await asyncio.sleep(self._pause(loop.time() - started, failed))
        except asyncio.CancelledError:
            self._state = "stopped"
            raise
        except BaseException:
            self._state = "died"
            log.exception("leader election for Lease %s died", self._ref)
            raise
        finally:
            if self._state == "running":
                self._state = "stopped"
            self._stand_down("leader election stopped")

    def _pause(self, elapsed: float, failed: bool) -> float:
        """Rounds start every retry_period (a call that failed instantly waits a whole one)."""
        if self._leading or failed:
            return max(0.0, self.retry_period - elapsed)
        pause = self.retry_period * random.uniform(1.0, 1.2) - elapsed  # followers spread out
        if self._observed and self._observed[0] and self._observed[0] != self.identity and not self._released:
            # wake up when the observed lease runs out, not up to a retry period later
            pause = min(pause, self._observed_at + self._observed_duration - self._clock() + 0.05)
        return max(0.1 * self.retry_period, pause)

    async def _round(self) -> bool:
        """One try to acquire or renew; True when the API server confirmed we hold the Lease."""
        if self._leading and self._lease is not None:
            # client-go's fast path: renew from the Lease as we last wrote it; a 409 means it changed.
            sent = self._clock()
            try:
                self._confirm(await self._replace(self._renewal(self._lease)), sent)
                return True
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
        try:
            lease = self._plain(await self._call(self.coordination.read_namespaced_lease, self.name, self.namespace))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return await self._create()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        self._observe(holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if self._released:
            return False  # released for good: observe only
        if holder and holder != self.identity and self._clock() - self._observed_at < self._observed_duration:
            return False  # someone else holds a live lease
        sent = self._clock()
        body = self._renewal(lease) if holder == self.identity else self._takeover(lease)
        try:
            self._confirm(await self._replace(body), sent)
        except ApiException as exc:
            if exc.status in (404, 409):  # deleted, or somebody else wrote first: we lost the race
                return False
            raise
        return True

    async def _create(self) -> bool:
        if self._released:
            return False
        now = _micro_time()
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": math.ceil(self.lease_seconds),
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
        sent = self._clock()
        try:
            created = await self._call(self.coordination.create_namespaced_lease, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # created by somebody else first
                return False
            raise
        self._confirm(self._plain(created), sent)
        return True

    def _renewal(self, lease: dict) -> dict:
        """Same holder: only renewTime moves (and the duration follows our settings)."""
        body = copy.deepcopy(lease)
        spec = body.setdefault("spec", {})
        now = _micro_time()
        spec.update(holderIdentity=self.identity, renewTime=now, leaseDurationSeconds=math.ceil(self.lease_seconds))
        if not spec.get("acquireTime"):
            spec["acquireTime"] = now
        spec["leaseTransitions"] = spec.get("leaseTransitions") or 0
        return body

    def _takeover(self, lease: dict) -> dict:
        """A new holder: acquireTime now, one more transition."""
        body = copy.deepcopy(lease)
        spec = body.setdefault("spec", {})
        now = _micro_time()
        spec.update(holderIdentity=self.identity, acquireTime=now, renewTime=now,
                    leaseDurationSeconds=math.ceil(self.lease_seconds),
                    leaseTransitions=(spec.get("leaseTransitions") or 0) + 1)
        return body

    def _confirm(self, lease: dict, sent: float) -> None:
        """The API server took our write: we hold the Lease until sent + renew_deadline."""
        self._lease = lease
        self._renewed_at = sent
        spec = lease.get("spec") or {}
        self._observe(self.identity, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        delay = max(0.0, sent + self.renew_deadline - self._clock())
        self._deadline_timer = asyncio.get_running_loop().call_later(delay, self._check_deadline)

    def _check_deadline(self) -> None:
        self._deadline_timer = None
        if self._leading and not self.is_leader:
            self._stand_down(f"no renewal within the {self.renew_deadline:g}s renew deadline")

    def _observe(self, holder: str, renew_time: Any, duration: Any) -> None:
        record = (holder, renew_time)
        if record == self._observed:
            return
        previous = self.holder
        self._observed, self._observed_at = record, self._clock()
        self._observed_duration = float(duration) if duration else self.lease_seconds
        if holder != previous and holder != self.identity:
            log.info("%s sees Lease %s held by %s", self.identity, self._ref, holder or "nobody")

    # -- transitions --------------------------------------------------------

    def _start_leading(self) -> None:
        if self._leading:
            return
        self._leading = True
        log.info("%s acquired leadership of Lease %s", self.identity, self._ref)
        self._callback(self.on_started_leading)

    def _stand_down(self, reason: str) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if not self._leading:
            return
        self._leading = False
        self._lease = None
        log.info("%s stopped leading Lease %s: %s", self.identity, self._ref, reason)
        self._callback(self.on_stopped_leading)

    def _callback(self, callback: Callable[[], Any] | None) -> None:
        if callback is None:
            return
        try:
            callback()
        except Exception:  # a caller's bug must not stop the election
            log.exception("leadership callback %r failed", callback)

    def _trouble(self, exc: BaseException) -> None:
        """API trouble: a warning when it starts, then at most one per lease_seconds."""
        self._failures += 1
        now = self._clock()
        if self._failures == 1 or now - self._warned_at >= self.lease_seconds:
            self._warned_at = now
            streak = f" ({self._failures} failures in a row)" if self._failures > 1 else ""
            log.warning("%s: Lease %s call failed%s: %s", self.identity, self._ref, streak, _describe(exc))

    def _recovered(self) -> None:
        if self._failures:
            log.info("%s: Lease %s reachable again after %d failed rounds", self.identity, self._ref,
                     self._failures)
            self._failures = 0

    # -- release ------------------------------------------------------------

    async def release(self, timeout: float | None = None) -> bool:
        """Give the Lease up if the live Lease still names us (call it after cancelling run()).

        Reads the Lease, and only when holderIdentity is ours replaces it (with its
        resourceVersion) with the holder cleared and a 1 s duration, as client-go's
        ReleaseOnCancel does; the elector then never campaigns again. Bounded by
        `timeout` (default release_timeout); never raises. True when released.
        """
        try:
            return await asyncio.wait_for(self._release(), self.release_timeout if timeout is None else timeout)
        except Exception as exc:  # shutting down: report, never raise
            if self._leading:  # cannot tell whether it is still ours: stop acting anyway
                self._released = True
                self._stand_down("releasing the Lease")
            log.warning("%s could not release Lease %s: %s", self.identity, self._ref, _describe(exc))
            return False

    async def _release(self) -> bool:
        for _ in range(3):  # a renewal still in flight can move the resourceVersion once
            try:
                lease = self._plain(await self._call(self.coordination.read_namespaced_lease, self.name,
                                                     self.namespace))
            except ApiException as exc:
                if exc.status == 404:
                    self._stand_down("the Lease is gone")
                    return False
                raise
            spec = lease.setdefault("spec", {})
            holder = spec.get("holderIdentity") or ""
            if holder != self.identity:
                self._stand_down(f"the Lease is held by {holder or 'nobody'}")
                log.info("%s not releasing Lease %s: held by %s", self.identity, self._ref, holder or "nobody")
                return False
            self._released = True
            self._stand_down("releasing the Lease")  # stop acting before the Lease is free
            spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=_micro_time())
            try:
                await self._replace(lease)
            except ApiException as exc:
                if exc.status == 409:
                    continue
                raise
            log.info("%s released leadership of Lease %s", self.identity, self._ref)
            return True
        log.warning("%s could not release Lease %s: it kept changing", self.identity, self._ref)
        return False

    # -- API calls ----------------------------------------------------------

    @property
    def _ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One API call on our own daemon threads, bounded by the client-side timeout."""
        try:
            result = await asyncio.wait_for(self._pool.run(self._answering, fn, *args,
                                                           _request_timeout=self.request_timeout),
                                            self.call_timeout)
        except ApiException as exc:
            self._authorization(exc.status)
            raise
        self._authorization(200)
        return result

    def _answering(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run on a pool thread: records that the call came back, whatever its outcome, even
        when _call stopped waiting for it (a late answer still shows the threads work)."""
        try:
            return fn(*args, **kwargs)
        finally:
            self._answered_at = self._clock()

    def _authorization(self, status: int | None) -> None:
        """A 401/403 starts or continues a refusal; an answer only an authorized caller gets
        (2xx, or a 4xx from the handler: 404, 409, ...) ends it. A 5xx, a 429 or a client-side
        failure (status 0) says nothing about our credentials."""
        if status in REFUSED:
            if self._refused_since is None:
                self._refused_since = self._clock()
        elif status is not None and 200 <= status < 500 and status != 429:
            self._refused_since = None

    async def _replace(self, body: dict) -> dict:
        return self._plain(await self._call(self.coordination.replace_namespaced_lease, self.name, self.namespace,
                                            body))

    def _plain(self, lease: Any) -> dict:
        return self._api_client.sanitize_for_serialization(lease)
