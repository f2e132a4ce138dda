"""The worker: `Worker` runs handlers for leased tasks, with its slot ledger, prefetch,
heartbeats (`heartbeat`, `lease_keeper`), batched acknowledgements (`acks`,
`batch_timing`), maintenance pacing and metrics. The top layer, built on the client."""
