"""kopf handlers: read the event, call the controller, nothing else.

No handler here needs a finalizer: deleting a Queue garbage-collects its
Deployment through ownerReferences, and the operator does not block deletion
when it is down.
"""

from __future__ import annotations

import asyncio
import logging
import os

import kopf

from .builders import GROUP, VERSION
from .connections import Connections
from .controller import Controller
from .kube import Kube, load_config
from .leader import LeaderElector
from .schedules import ScheduleController


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    # Only warnings and errors of handlers become Kubernetes Events; routine logs stay logs.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "effectmq-operator"
    settings.watching.server_timeout = 300
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="effectmq.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="effectmq.io")
    load_config()
    kube = Kube()
    connections = Connections(kube)
    memo.controller = Controller(kube, connections)
    memo.schedules = ScheduleController(kube, connections, memo.controller)
    memo.controller.extra_passes.append(memo.schedules.tick)
    lease_seconds = float(os.environ.get("EFFECTMQ_OPERATOR_LEASE_SECONDS", "15"))
    memo.elector = LeaderElector(kube, namespace=os.environ.get("POD_NAMESPACE", "default"),
                                 name=os.environ.get("EFFECTMQ_OPERATOR_LEASE", "effectmq-operator"),
                                 lease_seconds=lease_seconds, renew_every=lease_seconds / 3)
    memo.tasks = [
        asyncio.create_task(memo.elector.run(), name="effectmq-leader"),
        asyncio.create_task(memo.controller.run(lambda: memo.elector.is_leader), name="effectmq-loop"),
    ]


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    for task in getattr(memo, "tasks", []):
        task.cancel()
    await asyncio.gather(*getattr(memo, "tasks", []), return_exceptions=True)
    if hasattr(memo, "controller"):
        await memo.schedules.close()
        await memo.controller.stop()
        await memo.elector.release()


def deleted(type: str, **_) -> bool:
    """Only deletions need the raw watch event (the other changes reach the handlers
    below); filtering here keeps status updates from logging a line each."""
    return type == "DELETED"


@kopf.on.event(GROUP, VERSION, "queues", when=deleted)
def queue_event(type: str, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    memo.controller.observe_queue(type, dict(body))


@kopf.on.resume(GROUP, VERSION, "queues")
@kopf.on.create(GROUP, VERSION, "queues")
@kopf.on.update(GROUP, VERSION, "queues", field="spec")
async def reconcile_queue(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    await memo.controller.reconcile_queue(dict(body))


@kopf.on.event(GROUP, VERSION, "schedules", when=deleted)
async def schedule_event(type: str, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    await memo.schedules.observe(type, dict(body))


@kopf.on.resume(GROUP, VERSION, "schedules")
@kopf.on.create(GROUP, VERSION, "schedules")
@kopf.on.update(GROUP, VERSION, "schedules", field="spec")
async def reconcile_schedule(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    await memo.schedules.reconcile(dict(body))
