"""Example handlers. Run them with:

    PYTHONPATH=examples effectmq worker shop.tasks:app --queue emails

Handlers are plain Python: async functions run on the worker's event loop, plain
functions in its thread pool. Make side effects idempotent (key them on the task
id): a task runs at least once, and after a crash it may run again.
"""

import asyncio
import logging
import socket

import effectmq

log = logging.getLogger("shop.tasks")

# Queue name and Redis URL come from EFFECTMQ_QUEUE / EFFECTMQ_REDIS_URL, which the
# operator sets on the worker Deployment; "emails" is the default for local runs.
app = effectmq.App("emails")


class MailboxFull(effectmq.TaskError):
    """The recipient's server said "try later": retried on the queue's schedule."""


class InvalidAddress(effectmq.TaskError):
    """Retrying cannot help: the task fails at once and lands in the dead letters."""

    retryable = False


EMAIL_SCHEMA = {
    "type": "object",
    "required": ["to"],
    "properties": {"to": {"type": "string", "pattern": "^[^@ ]+@[^@ ]+$"}, "subject": {"type": "string"}},
}


@app.task(schema=EMAIL_SCHEMA, max_retries=5, timeout=30)
async def send_email(payload, ctx):
    if payload["to"].endswith("@invalid.example"):
        raise InvalidAddress(f"no such domain for {payload['to']}")
    await asyncio.sleep(0.01)  # stands in for the SMTP call
    log.info("sent %r to %s (task %s, attempt %d)", payload.get("subject", ""), payload["to"],
             ctx.task_id, ctx.attempt)
    # the host name is the pod's name under Kubernetes: shows where the task ran
    return {"delivered_to": payload["to"], "handled_by": socket.gethostname()}


@app.task(timeout=300)
async def send_report(payload, ctx):
    """Offered by the `nightly-report` Schedule; the payload carries the tick."""
    await ctx.progress({"stage": "collecting", "handled_by": socket.gethostname()})
    await asyncio.sleep(payload.get("seconds", 0.05))  # stands in for the real work
    return {"report": payload.get("report", "daily"), "tick": payload.get("tick"), "handled_by": socket.gethostname()}
