"""The event loop a process runs on: the loop choice (`--loop`) with timers that fall due
on time, a watchdog for a blocked loop, and cancellation helpers. Used by the client, the
worker and the operator; depends on nothing else of the runtime."""
