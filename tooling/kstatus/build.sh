#!/usr/bin/env bash
# Build the kstatus helper (main.go here: one Kubernetes object as JSON on stdin,
# one JSON line {"status","message","conditions"} from
# sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute on stdout) into a per-machine
# cache outside the repository. Idempotent: a binary already in the cache is
# reused. The keying, locking, building and publishing are tooling/gobuild.sh's,
# shared with tooling/controlplane/build.sh.
#
#   bash tooling/kstatus/build.sh      # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/kstatus/<key>/kstatus   the binary (manifest.txt beside it)
#   $EFFECTMQ_CACHE/kstatus/current         symlink to the newest <key>/kstatus
# <key> hashes go.mod, go.sum, *.go, this script, tooling/gobuild.sh and
# `go version`, so changing the pin, the builder code or the toolchain builds
# into a fresh dir.
#
# Needs: go (>= the module's `go` line), sha256sum, flock. Network: only the Go
# module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init kstatus "$here" "" # the binary sits in <key>/ itself

# The module (effectmq.local/tooling/kstatus) is the main package: go build
# names the binary kstatus.
if ! all_present kstatus; then
    cli_utils="$(mod_field . sigs.k8s.io/cli-utils Version)"
    timed "kstatus (sigs.k8s.io/cli-utils $cli_utils)" build_into_bin . "-s -w" .
else
    log "kstatus present"
fi

write_manifest kstatus
publish_current "$bin_dir/kstatus"
