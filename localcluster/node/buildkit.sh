#!/usr/bin/env bash
# Build BuildKit (buildkitd and buildctl) from the Go module proxy, for the real-node lane's images.
#
#   localcluster/node/buildkit.sh       (or: make image, which then builds the images)
#
# Builds github.com/moby/buildkit $BUILDKIT_VERSION (cmd/buildkitd, cmd/buildctl; static, as its
# release build: CGO off, tags osusergo netgo static_build) into
#
#   $KELASTIC_NODE_CACHE/buildkit-$BUILDKIT_VERSION/bin   (default ~/.cache/kelastic/node/buildkit-v0.34.2/bin)
#
# and prints that directory on its last line. BuildKit's go.mod has exclude directives, so
# `go install PACKAGE@VERSION` refuses it; the module's own source (from the module cache, as
# `go mod download` leaves it) is built in place instead, with its own go.mod and go.sum: the
# versions its release pins. The marker, lock, progress lines and naming what the proxy refused
# are localcluster/gobuild.sh's, as for `make node`.
#
# buildkitd runs its OCI worker with `make node`'s runc (localcluster/node/imagebuild.py); no
# containerd or registry is needed.
#
# Knobs: BUILDKIT_VERSION, KELASTIC_NODE_CACHE (the cache root), GO (the go command),
# GOFLAGS/GOPROXY/GOMODCACHE/GOCACHE as for any Go build.
set -euo pipefail

BUILDKIT_VERSION=${BUILDKIT_VERSION:-v0.34.2}
GO=${GO:-go}
CACHE_ROOT=${KELASTIC_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/node}
HEARTBEAT=${KELASTIC_BUILD_HEARTBEAT:-30}

# shellcheck source=../gobuild.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"
gobuild_name "buildkit build"

[[ $BUILDKIT_VERSION =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] \
    || die "BUILDKIT_VERSION=$BUILDKIT_VERSION is not a release (vMAJOR.MINOR.PATCH)"

DEST=$CACHE_ROOT/buildkit-$BUILDKIT_VERSION
BIN=$DEST/bin
WANT="buildkit $BUILDKIT_VERSION"

if gobuild_complete "$BIN" "$WANT"; then
    echo "$BIN"
    exit 0
fi
gobuild_need_go 1.26
mkdir -p "$DEST"
gobuild_lock "$DEST/.lock" "BuildKit $BUILDKIT_VERSION"
if gobuild_complete "$BIN" "$WANT"; then
    echo "$BIN"
    exit 0
fi
gobuild_workspace "$DEST"

BK=github.com/moby/buildkit
say "building BuildKit $BUILDKIT_VERSION into $BIN (Go: $("$GO" env GOVERSION), proxy: $("$GO" env GOPROXY))"
say "a cold build takes about five minutes on two cores; the module and build caches make the next one fast"
run_go "fetching $BK@$BUILDKIT_VERSION's source" "$WORK" mod download -json "$BK@$BUILDKIT_VERSION"
SRC=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' "$LOG" | tail -1)
[[ -f $SRC/go.mod ]] || { echo "no Dir in the go command's answer" >>"$LOG"; explain_failure "locating $BK's source"; }
CGO_ENABLED=0 run_go "compiling buildkitd and buildctl $BUILDKIT_VERSION" "$SRC" \
    build -trimpath -tags "osusergo netgo static_build" \
    -ldflags "-s -w -X $BK/version.Version=$BUILDKIT_VERSION" -o "$PARTIAL/" ./cmd/buildkitd ./cmd/buildctl

for binary in buildkitd buildctl; do
    [[ -x $PARTIAL/$binary ]] || die "the build left no $binary in $PARTIAL"
done
"$PARTIAL/buildkitd" --version >>"$LOG" 2>&1 || explain_failure "running the new buildkitd --version"

gobuild_publish "$PARTIAL" "$BIN" "$WANT"
say "done in $((SECONDS - START)) s: $("$BIN/buildkitd" --version)"
echo "$BIN"
