#!/usr/bin/env bash
# Build the kstatus helper (main.go here: one Kubernetes object as JSON on stdin,
# one JSON line {"status","message","conditions"} from
# sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute on stdout) into a per-machine
# cache outside the repository. Idempotent: a binary already in the cache is reused.
#
#   bash tooling/kstatus/build.sh      # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/kstatus/<key>/kstatus   the binary
#   $EFFECTMQ_CACHE/kstatus/current         symlink to the newest <key>/kstatus
# <key> hashes go.mod, go.sum, *.go, this script and `go version`, so changing
# the pin or the toolchain builds into a fresh dir.
#
# Needs: go (>= the module's `go` line), sha256sum, flock. Network: only the Go
# module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}/kstatus"

log() { printf '[kstatus] %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "go not found on PATH"; exit 1; }

export CGO_ENABLED=0
# go.sum is complete: refuse to edit it.
export GOFLAGS="-mod=readonly -buildvcs=false"

go_version="$(go version)"
key="$(
    {
        printf '%s\n' "$go_version"
        cd "$here"
        find . -type f \( -name go.mod -o -name go.sum -o -name '*.go' -o -name build.sh \) \
            -not -path './.*' | LC_ALL=C sort | while read -r f; do
            printf '%s  ' "$f"
            sha256sum <"$f"
        done
    } | sha256sum | cut -c1-16
)"
key_dir="$cache_root/$key"
bin="$key_dir/kstatus"
mkdir -p "$key_dir"

# One builder at a time per key (a second caller waits, then finds the binary built).
exec 9>"$key_dir/.lock"
flock 9
rm -rf "$key_dir"/tmp.* # left by an interrupted build

if [ -x "$bin" ]; then
    log "kstatus present"
else
    cli_utils="$(cd "$here" && go list -m -f '{{.Version}}' sigs.k8s.io/cli-utils)"
    start=$(date +%s)
    log "building kstatus (sigs.k8s.io/cli-utils $cli_utils) ..."
    tmp="$(mktemp -d "$key_dir/tmp.XXXXXX")"
    (cd "$here" && go build -trimpath -ldflags "-s -w" -o "$tmp/kstatus" .)
    mv -f "$tmp/kstatus" "$bin"
    rmdir "$tmp"
    log "built kstatus in $(( $(date +%s) - start ))s"
fi

ln -sfn "$bin" "$cache_root/current.tmp"
mv -Tf "$cache_root/current.tmp" "$cache_root/current"
log "binary at $bin (also $cache_root/current)"
echo "$bin"
