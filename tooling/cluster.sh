#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, without Docker, to try the chart
# as on kind: the test control plane plus kube-scheduler, and a node (containerd,
# runc, CNI bridge, kubelet, kube-proxy, CoreDNS) in its own network namespace.
# Builds or reuses everything it needs (binaries from Go modules, the project's
# images), then imports the images into the node. Needs root (network namespace,
# containerd, cgroups).
#
#   bash tooling/cluster.sh up       # prints `export KUBECONFIG=...`
#   bash tooling/cluster.sh status
#   bash tooling/cluster.sh down
set -euo pipefail
EFFECTMQ_APT="containerd=/usr/bin/containerd runc=/usr/sbin/runc \
containernetworking-plugins=/usr/lib/cni/bridge iptables=/usr/sbin/iptables \
gcc=/usr/bin/gcc libc6-dev=/usr/lib/x86_64-linux-gnu/libc.a"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export PATH="$PATH:/usr/local/go/bin"  # where the machine image installs Go

if [ "${1:-}" = up ]; then
    EFFECTMQ_CONTROLPLANE_BIN="${EFFECTMQ_CONTROLPLANE_BIN:-$(bash tooling/controlplane/build.sh | tail -n 1)}"
    EFFECTMQ_NODE_BIN="${EFFECTMQ_NODE_BIN:-$(bash tooling/node/build.sh | tail -n 1)}"
    export EFFECTMQ_CONTROLPLANE_BIN EFFECTMQ_NODE_BIN
    bash tooling/images.sh all >&2
fi
exec "$venv/bin/python" -m tooling.testbed.cluster "$@"
