#!/usr/bin/env bash
# Run EffectMQ locally on a fresh machine: installs redis-server and a virtualenv
# when missing, then runs the example application (or the manifests you name)
# with `effectmq local`. Arguments are passed to `effectmq local`.
#
#   bash tooling/local.sh                     # the example application
#   bash tooling/local.sh --burst 500         # ... with a burst of tasks to watch scaling
#   bash tooling/local.sh my/manifests/       # your own Queue and Schedule files
set -euo pipefail
EFFECTMQ_APT="redis-server=/usr/bin/redis-server"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$venv/bin/effectmq" local "$@"
