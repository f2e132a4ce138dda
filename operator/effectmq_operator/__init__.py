"""The EffectMQ operator: Queue and Schedule resources, watched through kopf.

Each side is a pure plan beside a thin reconciler that owns the I/O:
`queue_plan` / `queue_controller` for Queues (with `scaling`, `builders`, `spec`),
`schedule_plan` / `schedule_controller` for Schedules (with the tick loops in
`schedule_ticks` and the status mirror in `schedule_status`), which read the Queue
side through `queue_view` only. `status` builds conditions, `redis_pool` holds the
Redis clients per URL, `runtime` is the operator's own controller runtime (see its
docstring for why kopf is only the watch pipe; it builds only on `api`, the API group,
version, field manager and Event, and `metrics`), and `handlers` wires it to kopf.
"""
