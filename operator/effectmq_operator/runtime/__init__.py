"""The operator's own runtime: what controller-runtime gives a Go operator, built here.

kopf is used only as a watch pipe (its watch streams, CRD discovery and liveness
endpoint); its handlers and peering do not fit this operator. Its change handlers
are edge-triggered per event and keep their progress in annotations and finalizers
on the object, while a Queue is reconciled level-based from its latest version,
every poll interval as well as on a change (its backlog changes in Redis, not in the
API), and nothing may be added to users' objects (a finalizer would block namespace
deletion whenever the operator is down). So `registry` holds the latest version of
each object, healed by full lists, and `workqueue` runs one reconcile per key at a
time, a bounded number at once, each with a deadline, with backoff and coalesced
nudges. kopf's peering pauses every watch stream of a standby replica (a cold cache
to take over with), needs CRDs of its own installed, and has no renew deadline after
which a leader stops acting: `leader` elects by a coordination.k8s.io Lease with client-go's timing, so two
leaders never act at once, writes are refused once leadership lapses (`kube`), and
standbys keep watching. The kubernetes client is synchronous, so every API call
runs on bounded daemon thread pools (`threads`): a hung connection neither blocks
the loop nor keeps the process alive, and Lease renewals never queue behind status
writes. `watches` guards kopf's watcher where it would exit or stop watching when
a CRD is deleted or re-created, and `cancellation` ends a loop whose cancel was
dropped on its way.
"""
