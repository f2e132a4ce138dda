#!/usr/bin/env bash
# Build the test control plane (etcd, kube-apiserver, kube-controller-manager,
# kubectl, helm) from the pinned Go builder modules next to this script, into a
# per-machine cache outside the repository. Idempotent: binaries already in the
# cache are not rebuilt. The keying, locking, building and publishing are
# tooling/gobuild.sh's, shared with tooling/node/build.sh and tooling/kstatus/build.sh.
#
#   bash tooling/controlplane/build.sh      # logs on stderr; last stdout line = bin dir
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/controlplane/<key>/bin/   the binaries
#   $EFFECTMQ_CACHE/controlplane/current      symlink to the newest <key>/bin
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
gobuild_init controlplane "$here" bin

# --- Kubernetes: kube-apiserver, kube-controller-manager, kubectl.
build_kubernetes kubernetes kube-apiserver kube-controller-manager kubectl

# --- etcd, through the tiny main in etcd/cmd/etcd.
if ! all_present etcd; then
    etcd_version="$(mod_field etcd go.etcd.io/etcd/server/v3 Version)"
    timed "etcd $etcd_version" build_into_bin etcd "-s -w" ./cmd/etcd
else
    log "etcd present"
fi

# --- Helm v3, with the version ldflags of Helm's own Makefile.
if ! all_present helm; then
    helm_version="$(mod_field helm helm.sh/helm/v3 Version)"
    client_go="$(mod_field helm k8s.io/client-go Version)"                 # v0.37.0
    k8s_minor="${client_go#v0.}"; k8s_minor="${k8s_minor%%.*}"
    ldflags="-s -w"
    ldflags+=" -X helm.sh/helm/v3/internal/version.version=$helm_version"
    ldflags+=" -X helm.sh/helm/v3/internal/version.metadata="
    ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
    done
    timed "helm $helm_version" build_into_bin helm "$ldflags" helm.sh/helm/v3/cmd/helm
else
    log "helm present"
fi

write_manifest etcd kube-apiserver kube-controller-manager kubectl helm
publish_current "$bin_dir"
