#!/usr/bin/env bash
# Build the tests' OpenTelemetry Collector (main.go here: the OTLP receiver and
# contrib's file exporter, at one collector release) into a per-machine cache
# outside the repository. Idempotent: a binary already in the cache is reused.
# The keying, locking, building and publishing are tooling/gobuild.sh's, shared
# with tooling/controlplane/build.sh.
#
#   bash tooling/otelcol/build.sh      # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/otelcol/<key>/otelcol   the binary (manifest.txt beside it)
#   $EFFECTMQ_CACHE/otelcol/current         symlink to the newest <key>/otelcol
# <key> hashes go.mod, go.sum, *.go, this script, tooling/gobuild.sh and
# `go version`, so changing a pin, the main or the toolchain builds into a fresh dir.
#
# Needs: go (>= the module's `go` line), sha256sum, flock. Network: only the Go
# module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init otelcol "$here" "" # the binary sits in <key>/ itself

# The module (effectmq.local/tooling/otelcol) is the main package: go build names
# the binary otelcol.
if ! all_present otelcol; then
    release="$(mod_field . go.opentelemetry.io/collector/otelcol Version)"
    timed "otelcol (collector $release)" build_into_bin . "-s -w" .
else
    log "otelcol present"
fi

write_manifest otelcol
publish_current "$bin_dir/otelcol"
