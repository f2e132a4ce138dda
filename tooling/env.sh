# Sourced by tooling/test.sh and tooling/local.sh: installs the Debian packages
# named in $EFFECTMQ_APT (when their files are missing) and prepares the
# virtualenv, then sets $venv. Reused across runs: keyed by pyproject.toml.
# pinned_venv makes further ones (tooling/test.sh: redis-py 5.x).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. System packages, given as package=file-that-proves-it-is-installed.
source "$root/tooling/apt.sh"
# shellcheck disable=SC2086 # a list of words
apt_install_missing ${EFFECTMQ_APT:-}

# 2. Python: a virtualenv per machine, keyed by pyproject.toml, reused when warm.
cache="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}"
# make_venv DIR [REQUIREMENT...]: DIR as a virtualenv with the test dependencies (and
# the requirements given, e.g. a pinned redis-py), created once (.complete marks it
# finished), with this checkout, not a cached copy, installed as what runs.
make_venv() {
    local dir="$1"; shift
    if [ ! -f "$dir/.complete" ]; then
        say "creating $dir"
        rm -rf "$dir"
        python3 -m venv "$dir"
        "$dir/bin/pip" install -q --upgrade pip setuptools >&2
        "$dir/bin/pip" install -q ".[test,operator,dashboard]" "$@" >&2
        touch "$dir/.complete"
    fi
    "$dir/bin/pip" install -q --no-deps --no-build-isolation -e . >&2
}
# pinned_venv VAR NAME REQUIREMENT...: sets VAR to a second virtualenv made like the
# main one but with REQUIREMENT (keyed by pyproject.toml and the requirements too).
pinned_venv() {
    local var="$1" name="$2"; shift 2
    local dir
    dir="$cache/venv-$name-$( (cat pyproject.toml; printf '%s\n' "$@") | sha256sum | cut -c1-12)"
    make_venv "$dir" "$@"
    printf -v "$var" '%s' "$dir"
}
venv="${EFFECTMQ_VENV:-$cache/venv-$(sha256sum pyproject.toml | cut -c1-12)}"
make_venv "$venv"
export PATH="$venv/bin:$PATH"
