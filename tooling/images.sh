#!/usr/bin/env bash
# Build the project's container images without a Docker daemon or a registry:
# buildah (chroot isolation, vfs storage) on a Debian bookworm base that
# debootstrap makes from this machine's Debian mirror. Each image lands in an
# OCI archive in a per-machine cache outside the repository; archives already
# built for the same inputs are reused without starting buildah.
#
#   bash tooling/images.sh [operator|worker|example|redis|all]   # default: all
#
# Logs go to stderr; stdout has one line per archive, and its last line is the
# directory with <image>.tar symlinks to the newest archives.
#
# Images (names as the chart and examples/k8s reference them):
#   operator  operator/Dockerfile                effectmq-operator:<appVersion>
#   worker    worker_image/Dockerfile            effectmq-worker:<appVersion>
#   example   worker_image/example.Dockerfile    the image examples/k8s/queue.yaml names
#   redis     tooling/images/redis.Dockerfile    values.yaml redis.image (Debian's redis-server)
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/images/storage/         buildah's storage (vfs) and run root
#   $EFFECTMQ_CACHE/images/<image>/<key>.tar   the OCI archives
#   $EFFECTMQ_CACHE/images/current/<image>.tar symlinks to the newest archives
# <key> hashes the Dockerfile, every file the build copies in, the build args,
# the image name and the base's key (the example image: the worker's key).
#
# Builds reach PyPI with this machine's CA bundle and pip configuration mounted
# read-only (never copied into a layer); the base reaches only the Debian mirror
# of this machine's apt sources, and so do the apt-get steps of the worker image
# (tini, PID 1 in front of the worker: worker_image/effectmq-pid1.sh) and of the
# Redis image. Needs root (or sudo) for debootstrap and buildah.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

target="${1:-all}"
case "$target" in
    operator|worker|example|redis) wanted=("$target") ;;
    all) wanted=(operator worker example redis) ;;
    *) say "usage: $0 [operator|worker|example|redis|all]"; exit 2 ;;
esac

cache="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}/images"
mkdir -p "$cache/current"

# --- Names and tags, read from where they are used.
app_version="$(sed -n 's/^appVersion:[[:space:]]*"\{0,1\}\([^"[:space:]]*\)"\{0,1\}.*/\1/p' charts/effectmq/Chart.yaml)"
redis_ref="$(awk '
    /^redis:/ {in_redis=1; next}
    in_redis && /^[^[:space:]#]/ {in_redis=0}
    in_redis && /^  image:/ {in_image=1; next}
    in_image && /^  [^[:space:]]/ {in_image=0}
    in_image && $1 == "repository:" {repo=$2}
    in_image && $1 == "tag:" {tag=$2}
    END {gsub(/"/, "", repo); gsub(/"/, "", tag); print repo ":" tag}' charts/effectmq/values.yaml)"
example_ref="$(awk '$1 == "image:" {gsub(/"/, "", $2); print $2; exit}' examples/k8s/queue.yaml)"
declare -A ref=(
    [operator]="effectmq-operator:$app_version"
    [worker]="effectmq-worker:$app_version"
    [example]="$example_ref"
    [redis]="$redis_ref"
)
declare -A dockerfile=(
    [operator]=operator/Dockerfile
    [worker]=worker_image/Dockerfile
    [example]=worker_image/example.Dockerfile
    [redis]=tooling/images/redis.Dockerfile
)
# What each build copies from the repository (its COPY lines; the ignore files
# drop __pycache__ and *.pyc, and so does the hash).
declare -A inputs=(
    [operator]="pyproject.toml README.md LICENSE effectmq operator/effectmq_operator operator/Dockerfile.dockerignore"
    [worker]="pyproject.toml README.md LICENSE effectmq operator/effectmq_operator worker_image/effectmq-pid1.sh worker_image/Dockerfile.dockerignore"
    [example]="examples/shop worker_image/example.Dockerfile.dockerignore"
    [redis]="tooling/images/redis.Dockerfile.dockerignore"
)

hash_files() { # paths... -> one line per file: path and content hash
    find "$@" -type f -not -path '*/__pycache__/*' -not -name '*.pyc' 2>/dev/null \
        | LC_ALL=C sort | while read -r f; do printf '%s  ' "$f"; sha256sum <"$f"; done
}

# --- The base: Debian bookworm, minbase plus Python, from this machine's mirror.
# (Only the mirror's hash goes into keys and logs, never its address.)
mirror="$(
    {
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -f "$f" ] && awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm([[:space:]]|$)/ && /Types:[^\n]*deb([[:space:]]|$)/ {
                if (match($0, /URIs:[[:space:]]*[^[:space:]]+/)) { s=substr($0, RSTART, RLENGTH); sub(/URIs:[[:space:]]*/, "", s); print s } }' "$f"
        done
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" { i=2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i+1) == "bookworm") print $i }'
    } | grep -v -- '-security' | head -n1 || true
)"
masked() { if [ -n "$mirror" ]; then sed "s|$mirror|<debian-mirror>|g"; else cat; fi; }
base_packages="python3,python3-venv,python-is-python3,ca-certificates"
base_key="$(printf 'debootstrap --variant=minbase --include=%s bookworm\nmirror=%s\nrecipe=2\n' \
    "$base_packages" "$(printf '%s' "$mirror" | sha256sum | cut -c1-16)" | sha256sum | cut -c1-16)"
base_image="localhost/effectmq-base:$base_key"

compute_key() { # image -> key
    local image="$1"
    {
        printf 'ref=%s\n' "${ref[$image]}"
        printf 'dockerfile  '; sha256sum <"${dockerfile[$image]}"
        # shellcheck disable=SC2086
        [ -z "${inputs[$image]}" ] || hash_files ${inputs[$image]}
        case "$image" in
            example) printf 'worker=%s\n' "${keys[worker]}" ;;
            *) printf 'base=%s\n' "$base_key" ;;
        esac
    } | sha256sum | cut -c1-16
}
declare -A keys
for image in worker operator example redis; do # the worker before the example
    keys[$image]="$(compute_key "$image")"
done
key_of() { printf '%s\n' "${keys[$1]}"; }
archive_of() { printf '%s/%s/%s.tar\n' "$cache" "$1" "$(key_of "$1")"; }

# --- Warm path: every wanted archive exists -> no buildah, no apt.
need_build=0
for image in "${wanted[@]}"; do
    [ -s "$(archive_of "$image")" ] || need_build=1
done

if [ "$need_build" = 1 ]; then
    # 1. Tools, from Debian's packages when missing.
    source "$root/tooling/apt.sh"
    apt_install_missing buildah=/usr/bin/buildah debootstrap=/usr/sbin/debootstrap runc=/usr/sbin/runc \
        containernetworking-plugins=/usr/lib/cni/bridge
    [ "$(id -u)" = 0 ] || { say "needs root (debootstrap, buildah with chroot isolation)"; exit 1; }

    # One builder at a time (a second caller waits, then finds the archives).
    exec 9>"$cache/.lock"
    flock 9
    rm -rf "$cache"/tmp.*

    storage="$cache/storage"
    mkdir -p "$storage/root" "$storage/runroot"
    policy="$cache/policy.json"
    [ -f "$policy" ] || printf '{"default": [{"type": "insecureAcceptAnything"}]}\n' >"$policy"
    export BUILDAH_ISOLATION=chroot
    bah() { buildah --root "$storage/root" --runroot "$storage/runroot" --storage-driver vfs "$@"; }

    # 2. Build-time access to PyPI: this machine's CA bundle and pip settings,
    #    mounted read-only for the RUN steps only, over paths the base image already
    #    has (the Debian CA bundle; the empty /etc/xdg/pip, pip's site config dir).
    ca_bundle="${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}"
    ca_bundle="${ca_bundle:-/etc/ssl/certs/ca-certificates.crt}"
    mkdir -p "$cache/build-pip"
    pip_conf="$cache/build-pip/pip.conf"
    (
        umask 077
        {
            echo "[global]"
            echo "cert = /etc/ssl/certs/ca-certificates.crt"
            echo "disable-pip-version-check = true"
            [ -z "${PIP_INDEX_URL:-}" ] || echo "index-url = $PIP_INDEX_URL"
            [ -z "${PIP_EXTRA_INDEX_URL:-}" ] || echo "extra-index-url = $PIP_EXTRA_INDEX_URL"
            [ -z "${PIP_TRUSTED_HOST:-}" ] || echo "trusted-host = $PIP_TRUSTED_HOST"
            [ -z "${PIP_DEFAULT_TIMEOUT:-}" ] || echo "timeout = $PIP_DEFAULT_TIMEOUT"
            for f in /etc/pip.conf /etc/xdg/pip/pip.conf; do
                [ -f "$f" ] && grep -E '^[[:space:]]*(index-url|extra-index-url|trusted-host|timeout|proxy)[[:space:]]*=' "$f" || true
            done
        } >"$pip_conf.tmp"
        mv -f "$pip_conf.tmp" "$pip_conf"
    )
    build_volumes=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro"
                   --volume "$cache/build-pip:/etc/xdg/pip:ro")

    have_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

    ensure_base() {
        have_image "$base_image" && return 0
        [ -n "$mirror" ] || { say "no Debian bookworm mirror in this machine's apt sources"; exit 1; }
        local tmp ctr mnt start=$SECONDS
        tmp="$(mktemp -d "$cache/tmp.XXXXXX")"
        say "debootstrap bookworm (minbase + $base_packages) ..."
        debootstrap --variant=minbase --include="$base_packages" bookworm "$tmp/rootfs" "$mirror" \
            >"$tmp/debootstrap.log" 2>&1 || { tail -n 20 "$tmp/debootstrap.log" | masked >&2; exit 1; }
        rm -rf "$tmp/rootfs"/var/cache/apt/archives/*.deb "$tmp/rootfs"/var/lib/apt/lists/* \
               "$tmp/rootfs"/var/log/* "$tmp/rootfs"/debootstrap
        ctr="$(bah from --signature-policy "$policy" scratch)"
        mnt="$(bah mount "$ctr")"
        tar -C "$tmp/rootfs" -cf - . | tar -C "$mnt" -xpf - --numeric-owner
        # An empty directory that builds mount the pip settings on: a mount on a
        # path missing from the image would leave its mountpoint in the layer.
        mkdir -p "$mnt/etc/xdg/pip"
        bah umount "$ctr" >/dev/null
        bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 --cmd /bin/bash \
            --label org.opencontainers.image.title=effectmq-base \
            --label org.opencontainers.image.description="Debian bookworm minbase with python3, for tooling/images.sh" \
            "$ctr"
        bah commit --quiet --rm "$ctr" "$base_image" >/dev/null
        rm -rf "$tmp"
        say "base $base_image in $((SECONDS - start))s"
    }

    # Make sure an already-archived image is in storage too (the example builds FROM it).
    ensure_in_storage() { # image
        local image="$1" tag
        tag="localhost/effectmq-build-$image:$(key_of "$image")"
        if ! have_image "$tag"; then
            local id
            id="$(bah pull --quiet --signature-policy "$policy" "oci-archive:$(archive_of "$image")")"
            bah tag "$id" "$tag"
        fi
        echo "$tag"
    }

    build() { # image
        local image="$1" key archive tag start=$SECONDS args=()
        key="$(key_of "$image")"
        archive="$cache/$image/$key.tar"
        [ -s "$archive" ] && return 0
        tag="localhost/effectmq-build-$image:$key"
        case "$image" in
            operator|worker) ensure_base; args=(--build-arg "PYTHON_IMAGE=$base_image") ;;
            redis) ensure_base; args=(--build-arg "BASE_IMAGE=$base_image") ;;
            example) args=(--build-arg "WORKER_IMAGE=$(ensure_in_storage worker)") ;;
        esac
        say "building $image (${ref[$image]}) from ${dockerfile[$image]} ..."
        bah bud --quiet --isolation chroot --pull=never --format oci --layers=false \
            --signature-policy "$policy" "${build_volumes[@]}" "${args[@]}" \
            --ignorefile "${dockerfile[$image]}.dockerignore" \
            -f "${dockerfile[$image]}" -t "$tag" . >/dev/null 2>"$cache/$image.build.log" \
            || { tail -n 30 "$cache/$image.build.log" | masked >&2; say "building $image failed (log: $cache/$image.build.log)"; exit 1; }
        mkdir -p "$cache/$image"
        rm -f "$archive.tmp"
        bah push --quiet --signature-policy "$policy" "$tag" "oci-archive:$archive.tmp:${ref[$image]}" >&2
        mv -f "$archive.tmp" "$archive"
        # keep only this key's archive for the image
        find "$cache/$image" -maxdepth 1 -name '*.tar' ! -name "$key.tar" -delete
        say "built $image in $((SECONDS - start))s ($(du -h "$archive" | cut -f1))"
    }
    for image in "${wanted[@]}"; do
        build "$image"
    done
    # Drop images of older keys from buildah's storage (the archives stay).
    bah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | LC_ALL=C sort -r | while read -r name; do
        case "$name" in
            localhost/effectmq-base:*) [ "$name" = "$base_image" ] || bah rmi "$name" >/dev/null 2>&1 || true ;;
            localhost/effectmq-build-*:*)
                image="${name#localhost/effectmq-build-}"; image="${image%%:*}"
                [ -z "${keys[$image]:-}" ] || [ "${name##*:}" = "${keys[$image]}" ] \
                    || bah rmi "$name" >/dev/null 2>&1 || true ;;
        esac
    done
    bah rmi --prune >/dev/null 2>&1 || true
else
    for image in "${wanted[@]}"; do say "$image present"; done
fi

for image in "${wanted[@]}"; do
    archive="$(archive_of "$image")"
    ln -sfn "$archive" "$cache/current/$image.tar"
    echo "$archive"
done
echo "$cache/current"
