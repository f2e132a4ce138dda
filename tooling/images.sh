#!/usr/bin/env bash
# Build the project's container images without a Docker daemon or a registry:
# buildah (chroot isolation, vfs storage) on a Debian bookworm base that
# debootstrap makes from this machine's Debian mirrors. Each image lands in an
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
#   redis     tooling/images/redis.Dockerfile    values.yaml redis.image: <repository>:<tag or appVersion>
#             (Debian's redis-server; its package version is the label org.opencontainers.image.version)
#
# The base: bookworm minbase plus Python from this machine's bookworm mirror, upgraded
# from its bookworm-updates and bookworm-security mirrors, which stay in the base's apt
# sources for the Dockerfiles' apt-get steps (and for images built FROM ours). With no
# bookworm-security source the build stops, as its images would miss Debian's security
# fixes; EFFECTMQ_IMAGE_NO_SECURITY=1 builds them anyway, with a warning. Mirror
# addresses are never printed (output reads <debian-mirror>) and keys hold only hashes.
#
# Refresh: the base's key holds a refresh period, by default the ISO week (UTC), so the
# first run of a week rebuilds the base and every image on it with the week's security
# fixes, and later runs in the week reuse the archives (no apt, no pip).
# EFFECTMQ_IMAGE_REFRESH=<word> names the period instead: a new word refreshes now, a
# kept one keeps the base (e.g. offline). Images carry it as the label effectmq.base.refresh.
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/images/storage/         buildah's storage (vfs) and run root
#   $EFFECTMQ_CACHE/images/<image>/<key>.tar   the OCI archives (the ARCHIVES_KEPT newest)
#   $EFFECTMQ_CACHE/images/current/<image>.tar symlinks to the newest archives
# stdout: the archive of each image asked for, then the current/ folder.
# <key> hashes the Dockerfile, every file the build copies in (the Python lock files
# too), the build args, the image name and the base's key (the example image: the
# worker's key). The base's key records its inputs: the debootstrap recipe, the
# mirrors (hashed) and the refresh period. (So our builds pin the base by what made
# it; the Dockerfiles' PYTHON_IMAGE default is for Docker users, who pin it by digest.)
#
# Builds reach PyPI with this machine's CA bundle and pip configuration, and the
# Debian mirrors with its apt settings (a proxy; a snapshot mirror's expired Release
# files), mounted read-only for the RUN steps, never copied into a layer. The base
# and the apt-get steps of the worker image (tini, PID 1 in front of the worker:
# worker_image/effectmq-pid1.sh) and of the Redis image reach only the Debian
# mirrors of this machine's apt sources. Needs root (or sudo) for debootstrap and buildah.
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
ARCHIVES_KEPT=3

# --- Names and tags, read from where they are used.
app_version="$(sed -n 's/^appVersion:[[:space:]]*"\{0,1\}\([^"[:space:]]*\)"\{0,1\}.*/\1/p' charts/effectmq/Chart.yaml)"
# values.yaml redis.image: an empty tag is the chart's appVersion (as for the operator image)
redis_ref="$(awk -v app_version="$app_version" '
    /^redis:/ {in_redis=1; next}
    in_redis && /^[^[:space:]#]/ {in_redis=0}
    in_redis && /^  image:/ {in_image=1; next}
    in_image && /^  [^[:space:]]/ {in_image=0}
    in_image && $1 == "repository:" {repo=$2}
    in_image && $1 == "tag:" {tag=$2}
    END {gsub(/"/, "", repo); gsub(/"/, "", tag); print repo ":" (tag == "" ? app_version : tag)}' charts/effectmq/values.yaml)"
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
    [operator]="operator/requirements.lock pyproject.toml README.md LICENSE effectmq operator/effectmq_operator operator/Dockerfile.dockerignore"
    [worker]="worker_image/requirements.lock pyproject.toml README.md LICENSE effectmq operator/effectmq_operator worker_image/effectmq-pid1.sh worker_image/Dockerfile.dockerignore"
    [example]="examples/shop worker_image/example.Dockerfile.dockerignore"
    [redis]="tooling/images/redis.Dockerfile.dockerignore"
)

hash_files() { # paths... -> one line per file: path and content hash
    find "$@" -type f -not -path '*/__pycache__/*' -not -name '*.pyc' 2>/dev/null \
        | LC_ALL=C sort | while read -r f; do printf '%s  ' "$f"; sha256sum <"$f"; done
}

# --- The base: Debian bookworm, minbase plus Python, from this machine's mirrors.
# (Only the mirrors' hashes go into keys, and logs mask their addresses.)
apt_sources() { # -> "<suite> <uri>" for each deb source of this machine (one-line and deb822 files)
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '$1 == "deb" { i=2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } print $(i+1), $i }'
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk 'BEGIN {RS=""} {
            types = ""; uri = ""; suites = ""; enabled = "yes"
            n = split($0, lines, "\n")
            for (i = 1; i <= n; i++) {
                if (lines[i] ~ /^[[:space:]]*#/ || lines[i] !~ /:/) continue
                key = tolower(substr(lines[i], 1, index(lines[i], ":") - 1))
                value = substr(lines[i], index(lines[i], ":") + 1)
                if (key == "types") types = value
                else if (key == "uris") { split(value, uris, " "); uri = uris[1] }
                else if (key == "suites") suites = value
                else if (key == "enabled") enabled = tolower(value)
            }
            if (enabled ~ /no/ || (" " types " ") !~ /[[:space:]]deb[[:space:]]/ || uri == "") next
            m = split(suites, each, " ")
            for (j = 1; j <= m; j++) if (each[j] != "") print each[j], uri
        }' "$f"
    done
}
machine_sources="$(apt_sources)"
mirror_of() { awk -v suite="$1" '$1 == suite {print $2; exit}' <<<"$machine_sources"; }
mirror="$(mirror_of bookworm)"
updates_mirror="$(mirror_of bookworm-updates)"
security_mirror="$(mirror_of bookworm-security)"
mirror_strings() { # the mirrors' addresses and host names, longest first
    printf '%s\n' "$mirror" "$updates_mirror" "$security_mirror" \
        | awk 'NF { print; host = $0; sub(/^[a-z+]*:\/\//, "", host); sub(/[\/:].*/, "", host); print host }' \
        | LC_ALL=C sort -u | awk '{ print length($0), $0 }' | LC_ALL=C sort -k1,1nr | cut -d' ' -f2-
}
masked() { # stdin -> stdout, with every mirror address and host name replaced
    awk -v list="$(mirror_strings)" '
        BEGIN { n = split(list, find, "\n") }
        { for (i = 1; i <= n; i++) if (find[i] != "") while ((p = index($0, find[i])) > 0)
              $0 = substr($0, 1, p - 1) "<debian-mirror>" substr($0, p + length(find[i]))
          print }'
}
refresh="${EFFECTMQ_IMAGE_REFRESH:-$(date -u +%G-W%V)}"
base_packages="python3,python3-venv,python-is-python3,ca-certificates"
base_key="$(printf 'debootstrap --variant=minbase --include=%s bookworm\nmirrors=%s\nrefresh=%s\nrecipe=3\n' \
    "$base_packages" "$(printf '%s|%s|%s' "$mirror" "$updates_mirror" "$security_mirror" | sha256sum | cut -c1-16)" \
    "$refresh" | sha256sum | cut -c1-16)"
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
    [ -n "$mirror" ] || { say "no Debian bookworm source in this machine's apt sources (/etc/apt/sources.list*)"; exit 1; }
    if [ -z "$security_mirror" ]; then
        if [ "${EFFECTMQ_IMAGE_NO_SECURITY:-}" != 1 ]; then
            say "no bookworm-security source in this machine's apt sources: the images would miss Debian's security fixes."
            say "Add one (e.g. to /etc/apt/sources.list.d/debian.sources), or set EFFECTMQ_IMAGE_NO_SECURITY=1 to build without them."
            exit 1
        fi
        say "WARNING: EFFECTMQ_IMAGE_NO_SECURITY=1 and no bookworm-security source: these images miss Debian's security fixes"
    fi
    [ -n "$updates_mirror" ] || say "no bookworm-updates source in this machine's apt sources: the base goes without it"

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
    # 3. Build-time access to the Debian mirrors: this machine's apt settings that
    #    decide whether they answer (a proxy; Release files of a snapshot mirror are
    #    past their Valid-Until), mounted over an empty file of the base for RUN steps.
    mkdir -p "$cache/build-apt"
    apt_conf="$cache/build-apt/apt.conf"
    (
        umask 077
        apt-config dump 2>/dev/null \
            | grep -E '^Acquire::(Check-Valid-Until|Check-Date|Max-FutureTime|https?::Proxy)( |::)' >"$apt_conf.tmp" || true
        mv -f "$apt_conf.tmp" "$apt_conf"
    )
    apt_settings_in_image=/etc/apt/apt.conf.d/99effectmq-build
    build_volumes=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro"
                   --volume "$cache/build-pip:/etc/xdg/pip:ro"
                   --volume "$apt_conf:$apt_settings_in_image:ro")

    have_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

    ensure_base() {
        have_image "$base_image" && return 0
        local tmp ctr mnt start=$SECONDS
        tmp="$(mktemp -d "$cache/tmp.XXXXXX")"
        say "debootstrap bookworm (minbase + $base_packages) ..."
        debootstrap --variant=minbase --include="$base_packages" bookworm "$tmp/rootfs" "$mirror" \
            >"$tmp/debootstrap.log" 2>&1 || { tail -n 20 "$tmp/debootstrap.log" | masked >&2; exit 1; }
        rm -rf "$tmp/rootfs"/var/cache/apt/archives/*.deb "$tmp/rootfs"/var/lib/apt/lists/* \
               "$tmp/rootfs"/var/log/* "$tmp/rootfs"/debootstrap
        # The base's sources: what upgrades it now, and what the Dockerfiles install from.
        {
            echo "deb $mirror bookworm main"
            [ -z "$updates_mirror" ] || echo "deb $updates_mirror bookworm-updates main"
            [ -z "$security_mirror" ] || echo "deb $security_mirror bookworm-security main"
        } >"$tmp/rootfs/etc/apt/sources.list"
        # Empty files that builds mount settings on (a mount on a path missing from
        # the image would leave its mountpoint in the layer).
        mkdir -p "$tmp/rootfs/etc/xdg/pip"
        : >"$tmp/rootfs$apt_settings_in_image"
        ctr="$(bah from --signature-policy "$policy" scratch)"
        mnt="$(bah mount "$ctr")"
        tar -C "$tmp/rootfs" -cf - . | tar -C "$mnt" -xpf - --numeric-owner
        bah umount "$ctr" >/dev/null
        say "upgrading the base from bookworm-updates and bookworm-security ..."
        # (Not this machine's CA bundle mounted over the base's: ca-certificates upgrades it.)
        bah run --isolation chroot --volume "$apt_conf:$apt_settings_in_image:ro" "$ctr" -- sh -ec '
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            apt-get upgrade -y -qq -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
            apt-get clean
            rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /var/cache/debconf/*-old' \
            >"$tmp/upgrade.log" 2>&1 || { tail -n 30 "$tmp/upgrade.log" | masked >&2; say "upgrading the base failed"; exit 1; }
        bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 --cmd /bin/bash \
            --label org.opencontainers.image.title=effectmq-base \
            --label org.opencontainers.image.description="Debian bookworm minbase with python3 and the security suite's fixes, for tooling/images.sh" \
            --label "effectmq.base.refresh=$refresh" \
            "$ctr"
        bah commit --quiet --rm "$ctr" "$base_image" >/dev/null
        rm -rf "$tmp"
        say "base $base_image in $((SECONDS - start))s"
    }

    # The Redis image says which Debian package it holds (its name cannot: values.yaml names it).
    label_redis_version() { # tag
        local ctr mnt version
        ctr="$(bah from --pull=never --signature-policy "$policy" "$1")"
        mnt="$(bah mount "$ctr")"
        version="$(dpkg-query --admindir="$mnt/var/lib/dpkg" -W -f='${Version}' redis-server)"
        bah umount "$ctr" >/dev/null
        bah config --label "org.opencontainers.image.version=$version" "$ctr"
        bah commit --quiet --rm "$ctr" "$1" >/dev/null
        say "redis image holds Debian's redis-server $version"
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
        [ "$image" != redis ] || label_redis_version "$tag"
        mkdir -p "$cache/$image"
        rm -f "$archive.tmp"
        bah push --quiet --signature-policy "$policy" "$tag" "oci-archive:$archive.tmp:${ref[$image]}" >&2
        mv -f "$archive.tmp" "$archive"
        # Keep the newest few archives of the image: another checkout's tests may be
        # about to import theirs (they use the paths printed below, not current/).
        ls -t "$cache/$image"/*.tar | tail -n "+$((ARCHIVES_KEPT + 1))" | xargs -r rm -f
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
