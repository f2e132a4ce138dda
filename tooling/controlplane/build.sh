#!/usr/bin/env bash
# Build the test control plane (etcd, kube-apiserver, kube-controller-manager,
# kubectl, helm) from the pinned Go builder modules next to this script, into a
# per-machine cache outside the repository. Idempotent: binaries already in the
# cache are not rebuilt.
#
#   bash tooling/controlplane/build.sh      # logs on stderr; last stdout line = bin dir
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/controlplane/<key>/bin/   the binaries
#   $EFFECTMQ_CACHE/controlplane/current      symlink to the newest <key>/bin
# <key> hashes every builder file (go.mod, go.sum, *.go, this script) and
# `go version`, so changing a pin or the toolchain builds into a fresh dir.
#
# Needs: go (>= the `go` lines of the builder modules; with the default
# GOTOOLCHAIN=auto an older go fetches the right toolchain as a Go module),
# sha256sum, flock. Network: only the Go module proxy, on a cold module cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}/controlplane"

log() { printf '[controlplane] %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "go not found on PATH"; exit 1; }

export CGO_ENABLED=0
# The builder modules carry complete go.sum files: refuse to edit them.
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
bin_dir="$key_dir/bin"
mkdir -p "$bin_dir"

# One builder at a time per key (a second caller waits, then finds everything built).
exec 9>"$key_dir/.lock"
flock 9
rm -rf "$key_dir"/tmp.* # left by an interrupted build

all_present() {
    local b
    for b in "$@"; do
        [ -x "$bin_dir/$b" ] || return 1
    done
}

# Build packages of one builder module; binaries land in a temp dir and are
# moved into bin/ only when the whole `go build` succeeded.
build_into_bin() {
    local module_dir="$1" ldflags="$2"
    shift 2
    local tmp
    tmp="$(mktemp -d "$key_dir/tmp.XXXXXX")"
    (cd "$here/$module_dir" && go build -trimpath -ldflags "$ldflags" -o "$tmp/" "$@")
    local f
    for f in "$tmp"/*; do
        mv -f "$f" "$bin_dir/"
    done
    rmdir "$tmp"
}

timed() {
    local name="$1" start
    shift
    start=$(date +%s)
    log "building $name ..."
    "$@"
    log "built $name in $(( $(date +%s) - start ))s"
}

mod_field() { # module_dir module field
    (cd "$here/$1" && go list -m -f "{{.$3}}" "$2")
}

# --- Kubernetes: kube-apiserver, kube-controller-manager, kubectl (one go build,
# so their shared dependencies compile once).
kube_bins=(kube-apiserver kube-controller-manager kubectl)
if ! all_present "${kube_bins[@]}"; then
    kube_version="$(mod_field kubernetes k8s.io/kubernetes Version)"        # v1.34.4
    # buildDate: the release tag's time as the module proxy records it (reproducible)
    build_date="$(cd "$here/kubernetes" && go list -m \
        -f '{{with .Time}}{{.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' k8s.io/kubernetes)"
    build_date="${build_date:-1970-01-01T00:00:00Z}"
    major="${kube_version#v}"; major="${major%%.*}"
    minor="${kube_version#v*.}"; minor="${minor%%.*}"
    ldflags="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$kube_version"
        ldflags+=" -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean"
        ldflags+=" -X $pkg.buildDate=$build_date"
    done
    pkgs=()
    for b in "${kube_bins[@]}"; do
        [ -x "$bin_dir/$b" ] || pkgs+=("k8s.io/kubernetes/cmd/$b")
    done
    timed "kubernetes $kube_version (${pkgs[*]##*/})" build_into_bin kubernetes "$ldflags" "${pkgs[@]}"
else
    log "kubernetes binaries present"
fi

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

{
    echo "key=$key"
    echo "go=$go_version"
    for b in etcd kube-apiserver kube-controller-manager kubectl helm; do
        echo "$b=$(du -k "$bin_dir/$b" | cut -f1)KiB"
    done
} >"$key_dir/manifest.txt"

ln -sfn "$bin_dir" "$cache_root/current.tmp"
mv -Tf "$cache_root/current.tmp" "$cache_root/current"
log "binaries in $bin_dir (also $cache_root/current)"
echo "$bin_dir"
