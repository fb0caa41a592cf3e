#!/usr/bin/env bash
# Build a Kubernetes control plane from the Go module proxy into an envtest asset directory.
#
#   localcluster/controlplane/build.sh          (or: make control-plane)
#
# Builds kube-apiserver, kube-controller-manager, kube-scheduler and kubectl of
# k8s.io/kubernetes $K8S_VERSION, and etcd of go.etcd.io/etcd/server/v3 $ETCD_VERSION, into
#
#   $KELASTIC_K8S_CACHE/$K8S_VERSION/bin      (default ~/.cache/kelastic/k8s/v1.37.2/bin)
#
# and prints that directory on its last line. The directory has the layout of an envtest
# asset directory (KUBEBUILDER_ASSETS): etcd and kube-apiserver side by side, the others
# beside them; `kelastic local --control-plane DIR` and the tests' control-plane lane take it.
# A directory is complete once its marker `.kelastic-complete` names the versions asked for;
# a complete one is reused at once, anything else is rebuilt (an interrupted build leaves
# only a `bin.partial.*` directory, never a half-filled bin/).
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every k8s.io staging module
# with a folder of its own source tree. Here a throwaway module requires it and replaces each
# staging module with its release of the same minor (v1.37.2 -> v0.37.2), which is how
# projects import Kubernetes as a library. etcd's server module has replace lines too; a
# second throwaway module requires it, and its requirements pin its sibling modules.
#
# Knobs: K8S_VERSION, ETCD_VERSION, K8S_COMPONENTS (a subset, e.g. "kube-apiserver" for a
# CRD-only check; etcd is always built), KELASTIC_K8S_CACHE (the cache root), GO (the go command),
# GOFLAGS/GOPROXY/GOMODCACHE/GOCACHE as for any Go build. Needs Go at least as new as the
# go line of k8s.io/kubernetes's go.mod (1.26 for v1.37); with an older Go, export
# GOTOOLCHAIN=go1.27.3 (or whichever the error names) and the go command fetches it.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.7.3}
GO=${GO:-go}
CACHE_ROOT=${KELASTIC_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/k8s}
HEARTBEAT=${KELASTIC_BUILD_HEARTBEAT:-30}

# shellcheck source=../gobuild.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"
gobuild_name "control-plane build"

gobuild_kubernetes_release
[[ $ETCD_VERSION =~ ^v3\.[0-9]+\.[0-9]+$ ]] \
    || die "ETCD_VERSION=$ETCD_VERSION is not an etcd release (v3.MINOR.PATCH, e.g. v3.7.3)"

DEST=$CACHE_ROOT/$K8S_VERSION
BIN=$DEST/bin
ALL_COMPONENTS="kube-apiserver kube-controller-manager kube-scheduler kubectl"
read -r -a COMPONENTS <<<"${K8S_COMPONENTS:-$ALL_COMPONENTS}"
for component in "${COMPONENTS[@]}"; do
    [[ " $ALL_COMPONENTS " == *" $component "* ]] \
        || die "K8S_COMPONENTS names $component; it may name only: $ALL_COMPONENTS"
done
[[ " ${COMPONENTS[*]} " == *" kube-apiserver "* ]] || die "K8S_COMPONENTS must include kube-apiserver"
WANT="kubernetes $K8S_VERSION etcd $ETCD_VERSION"
# A subset is its own build: a later build of every component does not take it as complete.
[[ ${COMPONENTS[*]} == "$ALL_COMPONENTS" ]] || WANT+=" only ${COMPONENTS[*]}"

complete() { gobuild_complete "$BIN" "$WANT"; }

if complete; then
    echo "$BIN"
    exit 0
fi

gobuild_need_go 1.26
mkdir -p "$DEST"
# One build per version at a time: a second caller waits for the first and reuses its result.
gobuild_lock "$DEST/.lock" "$K8S_VERSION"
if complete; then
    echo "$BIN"
    exit 0
fi

gobuild_workspace "$DEST"

export GOFLAGS="${GOFLAGS:-} -mod=mod"
export CGO_ENABLED=0
say "building Kubernetes $K8S_VERSION and etcd $ETCD_VERSION into $BIN (Go: $("$GO" env GOVERSION), proxy: $("$GO" env GOPROXY))"
say "a cold build takes tens of minutes on two cores; the module and build caches make the next one fast"

# --- Kubernetes ----------------------------------------------------------------------------
K8S_MOD=$WORK/kubernetes
gobuild_kubernetes_module "$K8S_MOD"
PACKAGES=()
for component in "${COMPONENTS[@]}"; do PACKAGES+=("k8s.io/kubernetes/cmd/$component"); done
# etcd's throwaway module: its requirements pin etcd's sibling modules (api, client, pkg).
ETCD_MOD=$WORK/etcd
mkdir -p "$ETCD_MOD"
cat >"$ETCD_MOD/go.mod" <<EOF
module kelastic.local/build/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF

# Every module both builds need, fetched before anything compiles: a version the proxy
# refuses is named within seconds, not after the long step. Only errors are printed.
ONLY_ERRORS='{{if .Error}}{{.ImportPath}}: {{.Error}}{{end}}'
run_go "fetching the modules that Kubernetes $K8S_VERSION's commands import" "$K8S_MOD" \
    list -deps -f "$ONLY_ERRORS" "${PACKAGES[@]}"
run_go "fetching the modules that etcd $ETCD_VERSION imports" "$ETCD_MOD" \
    list -deps -f "$ONLY_ERRORS" go.etcd.io/etcd/server/v3
run_go "compiling ${COMPONENTS[*]} (the long step)" "$K8S_MOD" \
    build -trimpath -ldflags "$K8S_LDFLAGS" -o "$PARTIAL/" "${PACKAGES[@]}"
run_go "compiling etcd $ETCD_VERSION" "$ETCD_MOD" \
    build -trimpath -ldflags "-s -w" -o "$PARTIAL/etcd" go.etcd.io/etcd/server/v3

for binary in "${COMPONENTS[@]}" etcd; do
    [[ -x $PARTIAL/$binary ]] || die "the build left no $binary in $PARTIAL"
done
"$PARTIAL/kube-apiserver" --version >>"$LOG" 2>&1 || explain_failure "running the new kube-apiserver --version"

gobuild_publish "$PARTIAL" "$BIN" "$WANT"
say "done in $((SECONDS - START)) s: $(cd "$BIN" && "./kube-apiserver" --version), etcd $ETCD_VERSION"
echo "$BIN"
