# Sourced by tooling/test.sh and tooling/local.sh: installs the Debian packages
# named in $EFFECTMQ_APT (when their files are missing) and prepares the
# virtualenv, then sets $venv. Reused across runs: keyed by pyproject.toml.
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
venv="${EFFECTMQ_VENV:-$cache/venv-$(sha256sum pyproject.toml | cut -c1-12)}"
if [ ! -f "$venv/.complete" ]; then
    say "creating $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip setuptools >&2
    "$venv/bin/pip" install -q ".[test,operator]" >&2
    touch "$venv/.complete"
fi
# This checkout, not a cached copy, is what runs.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >&2
export PATH="$venv/bin:$PATH"
