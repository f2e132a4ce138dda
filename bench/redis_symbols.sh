#!/usr/bin/env bash
# Builds the installed redis-server's version from Debian's own source package, with
# symbols, for bench/script_cost.py --profile (Debian's binary is stripped: its Lua and
# most of Redis have no names in a profile). Prints the binary's path; cached under
# ~/.cache/effectmq/redis-symbols/<version>. The source list is private to this script
# (its own APT lists folder): the machine's apt configuration is not touched.
#
#   python bench/script_cost.py --k 10 --profile --redis-server "$(bash bench/redis_symbols.sh)"
#
# Upstream's build uses the Lua and jemalloc Redis bundles where Debian links the system
# ones; instruction counts differ by about 1 % (a call of 10 + 10: 1,526k against 1,537k).
set -euo pipefail
version="$(dpkg-query -W -f '${Version}' redis-server 2>/dev/null)" || {
    echo "redis_symbols.sh: the Debian package redis-server is not installed" >&2; exit 1; }
cache="${XDG_CACHE_HOME:-$HOME/.cache}/effectmq/redis-symbols/$version"
if [ -x "$cache/redis-server" ]; then echo "$cache/redis-server"; exit 0; fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The machine's own Debian sources, as source sources (deb-src), in a folder of this script's.
mkdir -p "$work/lists/partial" "$work/parts"
[ -f /etc/apt/sources.list ] && sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > "$work/parts/main.list"
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" > "$work/parts/$(basename "$f")"
done
apt_private=(-o APT::Sandbox::User=root -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/parts"
             -o "Dir::State::Lists=$work/lists")
apt-get "${apt_private[@]}" update -qq >&2
(cd "$work" && apt-get "${apt_private[@]}" source --download-only -qq "redis=$version" >&2)
tar -xzf "$work"/redis_*.orig.tar.gz -C "$work"
src="$(find "$work" -maxdepth 1 -type d -name 'redis-*' | head -n 1)"
make -C "$src" -j"$(nproc)" CFLAGS=-g >"$work/build.log" 2>&1 || { tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$cache"
cp "$src/src/redis-server" "$cache/redis-server"
echo "$cache/redis-server"
