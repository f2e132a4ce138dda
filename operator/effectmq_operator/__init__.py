"""The EffectMQ operator: Queue and Schedule resources reconciled by kopf.

Decisions (desired Deployment, replicas, status) are pure functions in
`builders`, `scaling` and `status`; `handlers` only reads, calls them and writes.
"""
