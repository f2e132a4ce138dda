"""The example application: handlers for the `emails` queue (see examples/k8s/)."""
