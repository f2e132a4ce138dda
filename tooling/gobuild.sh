# shellcheck shell=bash
# Sourced by the Go builder scripts (tooling/controlplane/build.sh,
# tooling/node/build.sh, tooling/kstatus/build.sh): the code they share, in one
# place so that they key, lock, build and publish alike. Each script keeps only
# which binaries it builds, from which packages, with which ldflags:
#
#   source "$here/../gobuild.sh"
#   gobuild_init NAME "$here" bin   # key, lock $EFFECTMQ_CACHE/NAME/<key>/ ("" = no bin/)
#   all_present X || timed "X vN" build_into_bin MODULE_DIR LDFLAGS PKG...
#   build_kubernetes MODULE_DIR kubelet ...   # k8s.io/kubernetes/cmd/*, kube_ldflags
#   write_manifest X ...; publish_current "$bin_dir"   # last stdout line
#
# It sets here, cache_root, go_version, key, key_dir and bin_dir; logs go to
# stderr as "[NAME] ..."; builds run with CGO_ENABLED=0, GOFLAGS="-mod=readonly
# -buildvcs=false", go build -trimpath. The caller runs under set -euo pipefail.
# <key> hashes `go version`, every go.mod, go.sum, *.go and build.sh under the
# builder dir, and this file (it shapes the build too), so changing a pin, the
# toolchain or the builder code builds into a fresh <key> dir.

gobuild_lib="$(realpath "${BASH_SOURCE[0]}")"

log() { printf '[%s] %s\n' "${gobuild_name:-gobuild}" "$*" >&2; }

gobuild_init() { # name builder_dir bin_subdir
    gobuild_name="$1"
    here="$2"
    cache_root="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}/$1"
    command -v go >/dev/null 2>&1 || { log "go not found on PATH"; exit 1; }
    export CGO_ENABLED=0
    # The builder modules carry complete go.sum files: refuse to edit them.
    export GOFLAGS="-mod=readonly -buildvcs=false"
    go_version="$(go version)"
    key="$(gobuild_key "$here")"
    key_dir="$cache_root/$key"
    bin_dir="$key_dir${3:+/$3}"
    open_key_dir
}

gobuild_key() { # builder_dir: prints the 16-hex-digit cache key
    {
        printf '%s\n' "$go_version"
        (
            cd "$1" || exit 1
            find . -type f \( -name go.mod -o -name go.sum -o -name '*.go' -o -name build.sh \) \
                -not -path './.*' | LC_ALL=C sort | while read -r f; do
                printf '%s  ' "$f"
                sha256sum <"$f"
            done
        )
        printf '%s  ' gobuild.sh
        sha256sum <"$gobuild_lib"
    } | sha256sum | cut -c1-16
}

# One builder at a time per key (a second caller waits, then finds everything
# built); fd 9 holds the lock until the script exits.
open_key_dir() {
    mkdir -p "$bin_dir"
    exec 9>"$key_dir/.lock"
    flock 9
    rm -rf "$key_dir"/tmp.* # left by an interrupted build
}

all_present() {
    local b
    for b in "$@"; do
        [ -x "$bin_dir/$b" ] || return 1
    done
}

# Build packages of one builder module; binaries land in a temp dir and are
# moved into $bin_dir only when the whole `go build` succeeded.
build_into_bin() { # module_dir (relative to $here) ldflags pkg...
    local module_dir="$1" ldflags="$2"
    shift 2
    local tmp f
    tmp="$(mktemp -d "$key_dir/tmp.XXXXXX")"
    (cd "$here/$module_dir" && go build -trimpath -ldflags "$ldflags" -o "$tmp/" "$@")
    for f in "$tmp"/*; do
        mv -f "$f" "$bin_dir/"
    done
    rmdir "$tmp"
}

timed() { # label cmd...
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

# The -ldflags of a builder module that pins k8s.io/kubernetes: stripped, with
# gitVersion, gitMajor, gitMinor, gitTreeState and buildDate set in
# k8s.io/component-base/version and k8s.io/client-go/pkg/version, so that
# `--version`, `/version` and `kubectl version` report the pinned release.
kube_ldflags() { # module_dir
    local version build_date major minor pkg ldflags="-s -w"
    # (`|| return`: set -e does not reach into the $(...) the caller runs this in)
    version="$(mod_field "$1" k8s.io/kubernetes Version)" || return      # v1.34.4
    # buildDate: the release tag's time as the module proxy records it (reproducible)
    build_date="$(cd "$here/$1" && go list -m \
        -f '{{with .Time}}{{.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' k8s.io/kubernetes)" || return
    build_date="${build_date:-1970-01-01T00:00:00Z}"
    major="${version#v}"; major="${major%%.*}"
    minor="${version#v*.}"; minor="${minor%%.*}"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$version"
        ldflags+=" -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean"
        ldflags+=" -X $pkg.buildDate=$build_date"
    done
    printf '%s\n' "$ldflags"
}

# Build those of k8s.io/kubernetes/cmd/BIN that are missing, in one go build (so
# their shared dependencies compile once), with kube_ldflags.
build_kubernetes() { # module_dir bin...
    local module_dir="$1" b version ldflags pkgs=()
    shift
    for b in "$@"; do
        [ -x "$bin_dir/$b" ] || pkgs+=("k8s.io/kubernetes/cmd/$b")
    done
    if [ ${#pkgs[@]} -eq 0 ]; then
        log "kubernetes binaries present"
        return 0
    fi
    version="$(mod_field "$module_dir" k8s.io/kubernetes Version)"
    ldflags="$(kube_ldflags "$module_dir")"
    timed "kubernetes $version (${pkgs[*]##*/})" build_into_bin "$module_dir" "$ldflags" "${pkgs[@]}"
}

write_manifest() { # bin...: key, go version and the binaries' sizes
    local b
    {
        echo "key=$key"
        echo "go=$go_version"
        for b in "$@"; do
            echo "$b=$(du -k "$bin_dir/$b" | cut -f1)KiB"
        done
    } >"$key_dir/manifest.txt"
}

# Point $cache_root/current at TARGET (the bin dir, or one binary) with an
# atomic rename, and print TARGET as the script's last stdout line.
publish_current() { # target
    ln -sfn "$1" "$cache_root/current.tmp.$$"
    mv -Tf "$cache_root/current.tmp.$$" "$cache_root/current"
    if [ -d "$1" ]; then
        log "binaries in $1 (also $cache_root/current)"
    else
        log "binary at $1 (also $cache_root/current)"
    fi
    echo "$1"
}
