#!/usr/bin/env bash
# Write the images' Python dependencies, every one pinned with its hashes (pip-tools):
#
#   operator/requirements.lock      effectmq[operator,dashboard,otel]   operator/Dockerfile
#   worker_image/requirements.lock  effectmq[otel]                      worker_image/Dockerfile
#
# Each lock also pins the build backend (pyproject.toml's build-system.requires): the
# Dockerfiles install the lock with `pip install --require-hashes --no-deps`, then
# build effectmq from its source offline with that backend (`--no-deps
# --no-build-isolation --no-index`) and run `pip check`.
#
#   bash tooling/lock.sh                           # keep the pins pyproject.toml still allows
#   bash tooling/lock.sh --upgrade                 # the newest versions it allows
#   bash tooling/lock.sh --upgrade-package redis   # (other arguments go to pip-compile)
#
# Resolved for the images' interpreter, Debian bookworm's python3 (3.11: tooling/images.sh
# builds on it), because some dependencies hang on the Python version (async-timeout
# for redis before 3.11.3). PYTHON=<a python3.11> names another one. pip-tools comes
# from PyPI into a throwaway virtualenv; only the index is used (no find-links, and no
# index address is written into the locks: builds use their own pip settings).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

PIP_TOOLS_VERSION=7.7.0
python="${PYTHON:-/usr/bin/python3}"
version="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)" \
    || { say "no Python at $python (Debian: apt-get install python3 python3-venv, or PYTHON=...)"; exit 1; }
case "$version" in
    3.11.*) ;;
    *) say "$python is Python $version; the images run Python 3.11 (Debian bookworm): PYTHON=<a python3.11>"; exit 1 ;;
esac

venv="$(mktemp -d "${TMPDIR:-/tmp}/effectmq-lock.XXXXXX")"
trap 'rm -rf "$venv"' EXIT
unset PIP_FIND_LINKS PIP_NO_INDEX  # resolve against the index alone, as the image builds do
"$python" -m venv "$venv" || { say "cannot make a virtualenv with $python (Debian: python3-venv)"; exit 1; }
"$venv/bin/pip" install --quiet --disable-pip-version-check "pip-tools==$PIP_TOOLS_VERSION"

lock() { # output extras...
    local output="$1" extra_args=() extra
    shift
    for extra in "$@"; do extra_args+=(--extra "$extra"); done
    say "$output: effectmq${*:+[$(IFS=,; echo "$*")]} and its build backend, for Python $version ..."
    CUSTOM_COMPILE_COMMAND="bash tooling/lock.sh" "$venv/bin/pip-compile" --quiet --no-config \
        --generate-hashes --allow-unsafe --build-deps-for wheel --strip-extras \
        --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
        "${extra_args[@]}" --output-file "$output" "${LOCK_ARGS[@]}" pyproject.toml
}
LOCK_ARGS=("$@")
lock operator/requirements.lock operator dashboard otel
lock worker_image/requirements.lock otel
say "done: commit the locks; tooling/images.sh rebuilds the images whose lock changed"
