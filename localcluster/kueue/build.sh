#!/usr/bin/env bash
# Build the Kueue manager from the Go module proxy, with its CRDs and webhook manifests.
#
#   localcluster/kueue/build.sh          (or: make kueue)
#
# Builds cmd/kueue of sigs.k8s.io/kueue $KUEUE_VERSION into
#
#   $KELASTIC_KUEUE_CACHE/$KUEUE_VERSION/bin/kueue     (default ~/.cache/kelastic/kueue/v0.17.0)
#
# copies the module's CRDs (config/components/crd/bases) into .../crds and its webhook
# manifests (config/components/webhook/manifests.yaml) into .../webhook, and prints the
# version directory on its last line; `kelastic local up --control-plane DIR --kueue` and the
# tests' Kueue lane take it. A directory is complete once its marker `.kelastic-complete` names
# the version asked for; a complete one is reused at once, anything else is rebuilt (an
# interrupted build leaves only a `partial.*` directory, never a half-filled one).
#
# sigs.k8s.io/kueue's go.mod has no replace lines, so `go install MODULE/cmd/kueue@VERSION`
# builds it exactly as its release does (the same -X flags for the version it reports).
#
# Knobs: KUEUE_VERSION, KELASTIC_KUEUE_CACHE (the cache root), GO (the go command),
# GOFLAGS/GOPROXY/GOMODCACHE/GOCACHE as for any Go build. Needs Go at least as new as the go
# line of sigs.k8s.io/kueue's go.mod (1.25 for v0.17).
set -euo pipefail

KUEUE_VERSION=${KUEUE_VERSION:-v0.17.0}
MODULE=sigs.k8s.io/kueue
GO=${GO:-go}
CACHE_ROOT=${KELASTIC_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/kueue}
HEARTBEAT=${KELASTIC_BUILD_HEARTBEAT:-30}

# shellcheck source=../gobuild.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"
gobuild_name "kueue build"

[[ $KUEUE_VERSION =~ ^v0\.[0-9]+\.[0-9]+$ ]] \
    || die "KUEUE_VERSION=$KUEUE_VERSION is not a Kueue release (v0.MINOR.PATCH, e.g. v0.17.0)"

DEST=$CACHE_ROOT/$KUEUE_VERSION
WANT="kueue $KUEUE_VERSION"

complete() { gobuild_complete "$DEST" "$WANT" && [[ -x $DEST/bin/kueue ]]; }

if complete; then
    echo "$DEST"
    exit 0
fi

gobuild_need_go 1.25
mkdir -p "$CACHE_ROOT"
# One build per version at a time: a second caller waits for the first and reuses its result.
gobuild_lock "$CACHE_ROOT/.$KUEUE_VERSION.lock" "Kueue $KUEUE_VERSION"
if complete; then
    echo "$DEST"
    exit 0
fi

PARTIAL=$CACHE_ROOT/partial.$KUEUE_VERSION.$$
LOG=$PARTIAL.log
cleanup() {
    stop_heartbeat
    rm -rf "$PARTIAL"
}
trap cleanup EXIT
rm -rf "$CACHE_ROOT"/partial.$KUEUE_VERSION.*
mkdir -p "$PARTIAL/bin" "$PARTIAL/crds" "$PARTIAL/webhook"
: >"$LOG"
START=$SECONDS

export CGO_ENABLED=0
say "building $MODULE $KUEUE_VERSION into $DEST (Go: $("$GO" env GOVERSION), proxy: $("$GO" env GOPROXY))"
say "a cold build takes about ten minutes on two cores; the module and build caches make the next one fast"

# The module first: a version the proxy refuses is named within seconds, not after compiling.
run_go "fetching $MODULE@$KUEUE_VERSION" "$PARTIAL" mod download -json "$MODULE@$KUEUE_VERSION"
SRC=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' "$LOG" | tail -1)
[[ -d $SRC/config/components/crd/bases ]] || { echo "no CRDs under $SRC" >>"$LOG"; explain_failure "reading $MODULE's CRDs"; }

LDFLAGS="-s -w -X $MODULE/pkg/version.GitVersion=$KUEUE_VERSION -X $MODULE/pkg/version.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
GOBIN=$PARTIAL/bin run_go "compiling $MODULE/cmd/kueue $KUEUE_VERSION (the long step)" "$PARTIAL" \
    install -trimpath -ldflags "$LDFLAGS" "$MODULE/cmd/kueue@$KUEUE_VERSION"
[[ -x $PARTIAL/bin/kueue ]] || die "the build left no kueue in $PARTIAL/bin"
cp "$SRC"/config/components/crd/bases/*.yaml "$PARTIAL/crds/"
cp "$SRC"/config/components/webhook/manifests.yaml "$PARTIAL/webhook/"
chmod -R u+w "$PARTIAL"
"$PARTIAL/bin/kueue" --help >>"$LOG" 2>&1 || explain_failure "running the new kueue --help"

gobuild_publish "$PARTIAL" "$DEST" "$WANT"
rm -f "$LOG"
say "done in $((SECONDS - START)) s: $DEST/bin/kueue, $(ls "$DEST/crds" | wc -l) CRDs"
echo "$DEST"
