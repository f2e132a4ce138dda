#!/usr/bin/env bash
# Run the test suite on a fresh machine: installs what is missing (Debian packages,
# a Python virtualenv with the test dependencies), builds or reuses the Kubernetes
# control plane, then runs pytest. Arguments are passed to pytest.
#
#   bash tooling/test.sh                 # everything
#   bash tooling/test.sh tests/runtime   # a part
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[test.sh] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. System packages: a real redis-server, and libfaketime for the clock-skew tests.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || missing+=(libfaketime)
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# 2. Python: a virtualenv per machine, keyed by pyproject.toml, reused when warm.
cache="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}"
venv="${EFFECTMQ_VENV:-$cache/venv-$(sha256sum pyproject.toml | cut -c1-12)}"
if [ ! -f "$venv/.complete" ]; then
    say "creating $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip setuptools >&2
    "$venv/bin/pip" install -q ".[test,operator]" >&2
    touch "$venv/.complete"
fi
# This checkout, not a cached copy, is what gets tested.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >&2

# 3. The Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kubectl, helm).
export PATH="$PATH:/usr/local/go/bin"  # where the machine image installs Go
if [ -z "${EFFECTMQ_CONTROLPLANE_BIN:-}" ]; then
    command -v go >/dev/null 2>&1 || { say "go is needed to build the test control plane"; exit 1; }
    EFFECTMQ_CONTROLPLANE_BIN="$(bash tooling/controlplane/build.sh | tail -n 1)"
    export EFFECTMQ_CONTROLPLANE_BIN
fi
say "control plane binaries: $EFFECTMQ_CONTROLPLANE_BIN"

export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest "$@"
