#!/usr/bin/env bash
# Build every release artifact of one version and push the chart and the images to
# an OCI registry: what a CI workflow for the public registries calls (after its
# own login: `helm registry login`, and skopeo's, which share
# ${REGISTRY_AUTH_FILE:-$XDG_RUNTIME_DIR/containers/auth.json}).
#
#   bash tooling/release.sh REGISTRY [--plain-http]     # or EFFECTMQ_RELEASE_REGISTRY=...
#
# REGISTRY is host[:port][/path], e.g. registry.example/effectmq; --plain-http (or
# EFFECTMQ_RELEASE_PLAIN_HTTP=1) talks HTTP instead of HTTPS, for a registry on
# loopback (tests/cluster/test_registry.py runs this against one).
#
# The version is pyproject.toml's `version`; the chart's `version` and `appVersion`
# must be the same (the script stops otherwise). It makes, in $EFFECTMQ_RELEASE_OUT
# (a new or empty directory; default build/release/<version>, emptied first):
#   dist/effectmq-<version>.tar.gz, dist/effectmq-<version>-py3-none-any.whl
#       python -m build, then twine check (PyPI upload is the workflow's own step)
#   effectmq-<version>.tgz     helm package charts/effectmq, pushed as
#                              oci://REGISTRY/charts/effectmq:<version>
#   the images of tooling/images.sh, pushed as REGISTRY/<name>:<version>:
#       effectmq-operator, effectmq-worker, effectmq-redis
#   pushed.txt                 what went where, with digests: one line per artifact
# Then: helm install effectmq oci://REGISTRY/charts/effectmq --version <version>
#   --set image.repository=REGISTRY/effectmq-operator --set redis.image.repository=REGISTRY/effectmq-redis
#
# Needs: python with `build` and `twine`, helm (3.8+), skopeo (Debian's package,
# installed when missing), and what tooling/images.sh needs (root, buildah).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

registry="${EFFECTMQ_RELEASE_REGISTRY:-}"
plain_http="${EFFECTMQ_RELEASE_PLAIN_HTTP:-0}"
for arg in "$@"; do
    case "$arg" in
        --plain-http) plain_http=1 ;;
        -*) say "unknown option $arg"; exit 2 ;;
        *) registry="$arg" ;;
    esac
done
registry="${registry%/}"
[ -n "$registry" ] || { say "usage: $0 REGISTRY [--plain-http]   (REGISTRY: host[:port][/path])"; exit 2; }
python="${PYTHON:-python3}"
helm="${HELM:-helm}"

# --- One version.
version="$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
chart_field() { sed -n "s/^$1:[[:space:]]*\"\{0,1\}\([^\"[:space:]]*\)\"\{0,1\}.*/\1/p" charts/effectmq/Chart.yaml; }
chart_version="$(chart_field version)"
app_version="$(chart_field appVersion)"
if [ "$chart_version" != "$version" ] || [ "$app_version" != "$version" ]; then
    say "pyproject.toml says $version, charts/effectmq/Chart.yaml version $chart_version and appVersion $app_version:"
    say "make them one version before releasing"
    exit 1
fi
if [ -n "${EFFECTMQ_RELEASE_OUT:-}" ]; then
    out="$EFFECTMQ_RELEASE_OUT"  # a directory of the caller's: never emptied here
    if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
        say "EFFECTMQ_RELEASE_OUT=$out is not empty: name a new or empty directory"
        exit 1
    fi
else
    out="$root/build/release/$version"
    rm -rf "$out"  # the previous run's artifacts of this version
fi
mkdir -p "$out"
say "releasing $version to $registry (artifacts in $out)"

# --- Tools.
"$python" -m build --version >/dev/null 2>&1 && "$python" -m twine --version >/dev/null 2>&1 \
    || { say "$python lacks build or twine: $python -m pip install build twine"; exit 1; }
command -v "$helm" >/dev/null || { say "helm not found (set HELM=...)"; exit 1; }
# shellcheck source-path=SCRIPTDIR source=apt.sh
source "$root/tooling/apt.sh"
apt_install_missing skopeo=/usr/bin/skopeo

# --- Python: wheel and sdist.
"$python" -m build --outdir "$out/dist" . >"$out/build.log" 2>&1 \
    || { tail -n 30 "$out/build.log" >&2; say "python -m build failed (log: $out/build.log)"; exit 1; }
"$python" -m twine check --strict "$out"/dist/*
say "built $(cd "$out/dist" && echo *)"

# --- The chart.
"$helm" lint charts/effectmq >/dev/null
"$helm" package charts/effectmq --destination "$out" >/dev/null
chart="$out/effectmq-$version.tgz"
[ -s "$chart" ] || { say "helm package made no $chart"; exit 1; }

# --- The images (built, or reused when warm, by tooling/images.sh; tagged with the
# chart's appVersion, which is this version).
images=(operator worker redis)
declare -A archive
for image in "${images[@]}"; do
    archive[$image]="$(bash tooling/images.sh "$image" | tail -n 2 | head -n 1)"
done

# --- Push.
helm_flags=(); skopeo_flags=()
if [ "$plain_http" = 1 ]; then
    helm_flags=(--plain-http)
    skopeo_flags=(--dest-tls-verify=false)
fi
"$helm" push "$chart" "oci://$registry/charts" "${helm_flags[@]}" >"$out/helm-push.log" 2>&1 \
    || { cat "$out/helm-push.log" >&2; say "helm push failed"; exit 1; }
chart_digest="$(sed -n 's/^Digest:[[:space:]]*//p' "$out/helm-push.log")"
echo "chart oci://$registry/charts/effectmq:$version@$chart_digest" >"$out/pushed.txt"
for image in "${images[@]}"; do
    ref="$registry/effectmq-$image:$version"
    skopeo copy --quiet "${skopeo_flags[@]}" --digestfile "$out/$image.digest" \
        "oci-archive:${archive[$image]}" "docker://$ref"
    echo "image $ref@$(cat "$out/$image.digest")" >>"$out/pushed.txt"
done
say "pushed:"
cat "$out/pushed.txt"
