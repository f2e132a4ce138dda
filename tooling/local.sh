#!/usr/bin/env bash
# Run EffectMQ on this machine: the example application (examples/shop, its manifests
# examples/k8s) or the manifests you name, with `effectmq local`: a local Redis, the
# schedules, workers scaled on backlog, and the dashboard beside them. Installs
# redis-server when missing, and a virtualenv for this checkout with only what the demo
# needs (the operator and dashboard extras), made once and reused until pyproject.toml
# changes.
#
#   bash tooling/local.sh                          # the example, a burst of slow tasks to watch scaling
#   bash tooling/local.sh --burst 0                # ... without the burst
#   bash tooling/local.sh my/manifests/ --pythonpath src   # your own Queues, Schedules and handlers
#
# Options of effectmq local pass through (`bash tooling/local.sh --help`). Without --burst,
# the example gets 300 tasks of 3 s each (send_report): about 6 workers to carry them, so
# the workers scale up, and back down once the queue is idle (the Queue's stabilization
# window and cooldown). --dashboard-port 0 leaves the dashboard out.
set -euo pipefail
here="$PWD"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { printf '[local.sh] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Paths given relative to where you stand are made absolute before the cd below.
args=() burst_given=0 dashboard_port=8080 manifests_given=0
absolute() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$here" "$1" ;; esac; }
while [ $# -gt 0 ]; do
    case "$1" in
        --pythonpath|--data-dir) args+=("$1" "$(absolute "${2:?$1 needs a value}")"); shift 2 ;;
        --pythonpath=*|--data-dir=*) args+=("${1%%=*}=$(absolute "${1#*=}")"); shift ;;
        --burst) burst_given=1; args+=("$1" "${2:?--burst needs a value}"); shift 2 ;;
        --burst=*) burst_given=1; args+=("$1"); shift ;;
        --dashboard-port) dashboard_port="${2:?--dashboard-port needs a value}"; shift 2 ;;
        --dashboard-port=*) dashboard_port="${1#*=}"; shift ;;
        --url|--redis-url|--redis-port|--burst-task|--burst-payload|--log-level|--stop-after)
            args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        -*) args+=("$1"); shift ;;
        *) manifests_given=1; args+=("$(absolute "$1")"); shift ;;
    esac
done
cd "$root"

# 1. redis-server (the Debian package), when missing.
source "$root/tooling/apt.sh"
apt_install_missing redis-server=/usr/bin/redis-server

# 2. A virtualenv per checkout and pyproject.toml (two checkouts never share one), made
#    once: .installed marks it finished, so later runs start at once.
cache="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}"
checkout_key="$(printf '%s' "$root" | sha256sum | cut -c1-8)"
venv="$cache/local-$checkout_key-$(sha256sum pyproject.toml | cut -c1-12)"
for old in "$cache/local-$checkout_key-"*; do  # this checkout's, made for an older pyproject.toml
    if [ "$old" != "$venv" ] && [ -d "$old" ]; then say "removing $old"; rm -rf "$old"; fi
done
if [ ! -f "$venv/.installed" ]; then
    say "first run for this checkout: making $venv (a minute or two)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    say "installing effectmq with the operator and dashboard extras ..."
    # one line per package as it comes, so a slow network shows as progress, not silence
    "$venv/bin/pip" install --progress-bar off -e ".[operator,dashboard]" 2>&1 \
        | sed -un 's/^Collecting \([^ ]*\).*/[local.sh]   \1/p; /^ERROR/p'
    touch "$venv/.installed"
    say "ready"
fi

# 3. The example gets a burst of slow tasks, so scaling shows; the dashboard runs beside it.
if [ "$burst_given" = 0 ] && [ "$manifests_given" = 0 ]; then
    args+=(--burst 300 --burst-task send_report --burst-payload '{"report": "burst", "seconds": 3}')
fi
[ "$dashboard_port" = 0 ] || args+=(--dashboard-port "$dashboard_port")
exec "$venv/bin/effectmq" local "${args[@]}"
