#!/usr/bin/env bash
# Build the node side of the one-node test cluster (kubelet, kube-scheduler,
# kube-proxy, CoreDNS) from the pinned Go builder modules next to this script,
# into a per-machine cache outside the repository. Idempotent: binaries already
# in the cache are not rebuilt. The keying, locking, building and publishing are
# tooling/gobuild.sh's, shared with tooling/controlplane/build.sh.
#
#   bash tooling/node/build.sh      # logs on stderr; last stdout line = bin dir
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/node/<key>/bin/   the binaries
#   $EFFECTMQ_CACHE/node/current      symlink to the newest <key>/bin
# <key> hashes every builder file (go.mod, go.sum, *.go, this script),
# tooling/gobuild.sh and `go version`, so changing a pin, the builder code or
# the toolchain builds into a fresh dir.
#
# Needs: go (>= the `go` lines of the builder modules; with the default
# GOTOOLCHAIN=auto an older go fetches the right toolchain as a Go module),
# sha256sum, flock. Network: only the Go module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init node "$here" bin

# --- Kubernetes: kubelet, kube-scheduler, kube-proxy. Same k8s.io/kubernetes pin
# and replace block as tooling/controlplane/kubernetes. Static, as everything
# gobuild.sh builds (CGO_ENABLED=0): upstream's release build (hack/lib/golang.sh)
# links kube-scheduler and kube-proxy that way too, but builds kubelet with cgo
# (it is not in KUBE_STATIC_BINARIES); kubelet builds and runs without cgo as
# well, using Go's own resolver and os/user (see README.md).
build_kubernetes kubernetes kubelet kube-scheduler kube-proxy

# --- CoreDNS: its module root is the main package (tool directive in go.mod).
# ldflags as in CoreDNS's Makefile (GitCommit is empty: no git checkout here).
if ! all_present coredns; then
    coredns_version="$(mod_field coredns github.com/coredns/coredns Version)"
    timed "coredns $coredns_version" build_into_bin coredns \
        "-s -w -X github.com/coredns/coredns/coremain.GitCommit=" github.com/coredns/coredns
else
    log "coredns present"
fi

write_manifest kubelet kube-scheduler kube-proxy coredns
publish_current "$bin_dir"
