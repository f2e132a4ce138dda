"""The client: `TaskQueue` (offer, inspect, administer), the lease engine behind its
`acquire` (`engine`), the records it returns (`models`), task definitions on an `App`,
retry schedules, the synchronous facade and queue discovery. Built on the protocol."""
