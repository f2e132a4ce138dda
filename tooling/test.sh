#!/usr/bin/env bash
# Run the test suite on a fresh machine: installs what is missing (Debian packages,
# a Python virtualenv with the test dependencies), builds or reuses the Kubernetes
# control plane, then runs pytest. Arguments are passed to pytest. The full run then
# runs the Redis-facing tests again against the oldest redis-py major allowed (5.x),
# and against the oldest Redis supported (6.2, built by tooling/redis/build.sh; the
# tests marked redis7, about Redis 7's functions, are left out of that pass).
#
#   bash tooling/test.sh                 # everything
#   bash tooling/test.sh tests/runtime   # a part
#   EFFECTMQ_REDIS_FLOOR=1 bash tooling/test.sh tests/runtime/test_worker.py  # a part, against both
set -euo pipefail
# a real redis-server, libfaketime for the clock-skew tests, and the one-node
# cluster's node side (tooling/testbed/cluster.py), and the browser of the dashboard tests
# (tests/dashboard: Playwright drives Debian's chromium, never a downloaded one)
EFFECTMQ_APT="redis-server=/usr/bin/redis-server libfaketime=/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 \
containerd=/usr/bin/containerd runc=/usr/sbin/runc containernetworking-plugins=/usr/lib/cni/bridge \
iptables=/usr/sbin/iptables gcc=/usr/bin/gcc libc6-dev=/usr/lib/x86_64-linux-gnu/libc.a chromium=/usr/bin/chromium \
make=/usr/bin/make"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# The Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kubectl, helm).
export PATH="$PATH:/usr/local/go/bin"  # where the machine image installs Go
if [ -z "${EFFECTMQ_CONTROLPLANE_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the test control plane"; exit 1; }
    EFFECTMQ_CONTROLPLANE_BIN="$(bash tooling/controlplane/build.sh | tail -n 1)"
    export EFFECTMQ_CONTROLPLANE_BIN
fi
say "control plane binaries: $EFFECTMQ_CONTROLPLANE_BIN"

# The node of the one-node cluster (kubelet, kube-scheduler, kube-proxy, CoreDNS).
if [ -z "${EFFECTMQ_NODE_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the test node"; exit 1; }
    EFFECTMQ_NODE_BIN="$(bash tooling/node/build.sh | tail -n 1)"
    export EFFECTMQ_NODE_BIN
fi
say "node binaries: $EFFECTMQ_NODE_BIN"

# The kstatus helper (sigs.k8s.io/cli-utils kstatus, as Flux judges health).
if [ -z "${EFFECTMQ_KSTATUS_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the kstatus helper"; exit 1; }
    EFFECTMQ_KSTATUS_BIN="$(bash tooling/kstatus/build.sh | tail -n 1)"
    export EFFECTMQ_KSTATUS_BIN
fi
say "kstatus helper: $EFFECTMQ_KSTATUS_BIN"

# The OpenTelemetry Collector (OTLP receiver, file exporter) of the trace tests.
if [ -z "${EFFECTMQ_OTELCOL_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the OpenTelemetry Collector"; exit 1; }
    EFFECTMQ_OTELCOL_BIN="$(bash tooling/otelcol/build.sh | tail -n 1)"
    export EFFECTMQ_OTELCOL_BIN
fi
say "OpenTelemetry Collector: $EFFECTMQ_OTELCOL_BIN"

# The Argo CD health helper (argo-cd's own argocd-cm parsing and Lua health scripts).
if [ -z "${EFFECTMQ_ARGOHEALTH_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the Argo CD health helper"; exit 1; }
    EFFECTMQ_ARGOHEALTH_BIN="$(bash tooling/argohealth/build.sh | tail -n 1)"
    export EFFECTMQ_ARGOHEALTH_BIN
fi
say "Argo CD health helper: $EFFECTMQ_ARGOHEALTH_BIN"

# The promql checker (Prometheus' PromQL parser and rule loader, Grafana's
# dashboard model) for the chart's alerts and Grafana dashboard.
if [ -z "${EFFECTMQ_PROMQL_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the promql checker"; exit 1; }
    EFFECTMQ_PROMQL_BIN="$(bash tooling/promql/build.sh | tail -n 1)"
    export EFFECTMQ_PROMQL_BIN
fi
say "promql checker: $EFFECTMQ_PROMQL_BIN"

# The oldest redis-py major that pyproject.toml allows; the Redis-facing tests run
# against it too, in a second virtualenv (the main one has the newest redis-py).
REDIS_FLOOR='redis[hiredis]>=5.0,<6'
REDIS_TESTS=(tests/runtime tests/scheduler)
# EFFECTMQ_REDIS_FLOOR: auto (default) runs REDIS_TESTS against REDIS_FLOOR after a
# run that names no test paths (the full run, as CI does); 1 always does (with the
# paths given, when there are some); 0 never.
floor="${EFFECTMQ_REDIS_FLOOR:-auto}"
if [ "$floor" = auto ]; then
    floor=1
    for arg in "$@"; do
        if [ -e "${arg%%::*}" ]; then floor=0; break; fi  # a test path: a part of the suite
    done
    floor_args=("$@" "${REDIS_TESTS[@]}")
elif [ "$floor" = 1 ]; then
    floor_args=("$@")
    [ "$#" -gt 0 ] || floor_args=("${REDIS_TESTS[@]}")
elif [ "$floor" != 0 ]; then
    say "EFFECTMQ_REDIS_FLOOR is auto, 1 or 0, not '$floor'"; exit 2
fi
if [ "$floor" = 1 ]; then
    pinned_venv venv_floor redis5 "$REDIS_FLOOR"
    redis_floor_bin="$(bash tooling/redis/build.sh | tail -n 1)"
fi

# Two workers (this machine has 2 cores; much of the suite waits on leases and
# timeouts); a file's tests stay on one worker, so module fixtures are shared.
# `-n 0` among the arguments runs them in this process. Short tracebacks: a failure
# shows its line and message, not the whole source of a long test (CI keeps only a
# part of the output); `--tb=long` among the arguments wins.
pytest_args=(-n "${EFFECTMQ_TEST_WORKERS:-2}" --dist loadfile --tb=short)
status=0
"$venv/bin/python" -m pytest "${pytest_args[@]}" "$@" || status=$?
if [ "$floor" = 1 ]; then
    say "again against $("$venv_floor/bin/python" -c 'import redis; print("redis-py", redis.__version__)'): ${floor_args[*]}"
    PATH="$venv_floor/bin:$PATH" "$venv_floor/bin/python" -m pytest "${pytest_args[@]}" "${floor_args[@]}" \
        || { floor_status=$?; [ "$status" != 0 ] || status=$floor_status; }
    say "again against $("$redis_floor_bin/redis-server" --version | cut -d' ' -f1-3), not the tests marked redis7: ${floor_args[*]}"
    PATH="$redis_floor_bin:$PATH" "$venv/bin/python" -m pytest "${pytest_args[@]}" -m "not redis7" "${floor_args[@]}" \
        || { floor_status=$?; [ "$status" != 0 ] || status=$floor_status; }
fi
exit "$status"
