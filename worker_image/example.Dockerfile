# syntax=docker/dockerfile:1
# The example application's worker image: the effectmq worker image plus the `shop`
# handler package (examples/shop). Build it from the repository root after the
# worker image:
#
#   docker build -f worker_image/Dockerfile -t effectmq-worker:0.1.0 .
#   docker build -f worker_image/example.Dockerfile -t registry.example/shop-workers:1.4.2 .
#
# (the tag examples/k8s/queue.yaml names; `kind load docker-image` makes it
# available to a kind cluster without a registry).
ARG WORKER_IMAGE=effectmq-worker:0.1.0
FROM ${WORKER_IMAGE}
# Handler code, owned by root and read-only for the worker's user.
COPY examples/shop/ /app/shop/
# Used when no handlers argument is given (the operator passes spec.worker.handlers).
ENV EFFECTMQ_HANDLERS=shop.tasks:app
