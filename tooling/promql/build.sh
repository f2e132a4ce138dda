#!/usr/bin/env bash
# Build the promql checker (main.go here: Prometheus' rule-file loader and PromQL
# parser, github.com/prometheus/prometheus model/rulefmt and promql/parser, and
# Grafana's dashboard model, github.com/grafana/grafana-foundation-sdk/go, decoded
# strictly) into a per-machine cache outside the repository. Idempotent: a binary
# already in the cache is reused. The keying, locking, building and publishing
# are tooling/gobuild.sh's, shared with tooling/kstatus/build.sh.
#
#   bash tooling/promql/build.sh      # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/promql/<key>/promql   the binary (manifest.txt beside it)
#   $EFFECTMQ_CACHE/promql/current        symlink to the newest <key>/promql
# <key> hashes go.mod, go.sum, *.go, this script, tooling/gobuild.sh and
# `go version`.
#
# Needs: go (>= the module's `go` line, which Prometheus v0.316 sets to 1.26.7),
# sha256sum, flock. Network: only the Go module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init promql "$here" "" # the binary sits in <key>/ itself

# The module (effectmq.local/tooling/promql) is the main package: go build
# names the binary promql.
if ! all_present promql; then
    prometheus="$(mod_field . github.com/prometheus/prometheus Version)"
    grafana="$(mod_field . github.com/grafana/grafana-foundation-sdk/go Version)"
    timed "promql (prometheus $prometheus, grafana-foundation-sdk $grafana)" build_into_bin . "-s -w" .
else
    log "promql present"
fi

write_manifest promql
publish_current "$bin_dir/promql"
