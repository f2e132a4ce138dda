"""The embedded default: Queue and Schedule manifests run on one machine.

A local redis-server, schedules firing, maintenance, and worker processes scaled on
backlog by the operator's own scaling decision, with a live terminal view.
"""
