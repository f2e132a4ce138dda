#!/usr/bin/env bash
# Build the Argo CD health helper (main.go here: one Kubernetes object as JSON on
# stdin, one JSON line {"status","message","error"} on stdout, computed by Argo
# CD's own code from an argocd-cm manifest or one Lua health script: argo-cd
# util/settings, util/lua and gitops-engine pkg/health, the path of `argocd
# admin settings resource-overrides health`) into a per-machine cache outside the
# repository. Idempotent: a binary already in the cache is reused. The keying,
# locking, building and publishing are tooling/gobuild.sh's, shared with
# tooling/kstatus/build.sh.
#
#   bash tooling/argohealth/build.sh   # logs on stderr; last stdout line = binary path
#
# Cache layout (EFFECTMQ_CACHE defaults to ~/.cache/effectmq):
#   $EFFECTMQ_CACHE/argohealth/<key>/argohealth   the binary (manifest.txt beside it)
#   $EFFECTMQ_CACHE/argohealth/current            symlink to the newest <key>/argohealth
# <key> hashes go.mod, go.sum, *.go, this script, tooling/gobuild.sh and
# `go version`.
#
# Needs: go (>= the module's `go` line, argo-cd v3.5.3's 1.26.3), sha256sum,
# flock. Network: only the Go module proxy, on a cold module cache. Cold, the
# build compiles about 1,500 packages (argo-cd imports much of Kubernetes).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=../gobuild.sh
source "$here/../gobuild.sh"
gobuild_init argohealth "$here" "" # the binary sits in <key>/ itself

# The module (effectmq.local/tooling/argohealth) is the main package: go build
# names the binary argohealth.
if ! all_present argohealth; then
    argocd="$(mod_field . github.com/argoproj/argo-cd/v3 Version)"
    lua="$(mod_field . github.com/yuin/gopher-lua Version)"
    timed "argohealth (argo-cd $argocd, gopher-lua $lua)" build_into_bin . "-s -w" .
else
    log "argohealth present"
fi

write_manifest argohealth
publish_current "$bin_dir/argohealth"
