#!/usr/bin/env bash
# Build the CNCF distribution registry (github.com/distribution/distribution/v3,
# cmd/registry, through the tool directive in go.mod) into a per-machine cache
# outside the repository: an OCI registry to push the chart and the images to on
# loopback (tests/fixtures/registry.py), as a release pushes them to a public one.
# Idempotent: a binary already in the cache is reused. The keying, locking,
# building and publishing are tooling/gobuild.sh's.
#
#   bash tooling/registry/build.sh      # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/registry/<key>/registry   the binary (manifest.txt beside it)
#   $EFFECTMQ_CACHE/registry/current          symlink to the newest <key>/registry
# <key> hashes go.mod, go.sum, this script, tooling/gobuild.sh and `go version`.
#
# Needs: go (>= the module's `go` line), sha256sum, flock. Network: only the Go
# module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init registry "$here" "" # the binary sits in <key>/ itself

if ! all_present registry; then
    version="$(mod_field . github.com/distribution/distribution/v3 Version)"
    # ldflags as distribution's Makefile sets them (version.Version, .Revision)
    timed "registry (distribution $version)" build_into_bin . \
        "-s -w -X github.com/distribution/distribution/v3/version.version=$version -X github.com/distribution/distribution/v3/version.revision=" \
        github.com/distribution/distribution/v3/cmd/registry
else
    log "registry present"
fi

write_manifest registry
publish_current "$bin_dir/registry"
