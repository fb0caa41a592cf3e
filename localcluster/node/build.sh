#!/usr/bin/env bash
# Build the components of a real Kubernetes node from the Go module proxy.
#
#   localcluster/node/build.sh          (or: make node)
#
# Builds, with every version pinned:
#   kubelet, kube-proxy            k8s.io/kubernetes $K8S_VERSION (cmd/kubelet, cmd/kube-proxy)
#   containerd, containerd-shim-runc-v2, ctr
#                                  github.com/containerd/containerd/v2 $CONTAINERD_VERSION
#   runc                           github.com/opencontainers/runc $RUNC_VERSION (-tags seccomp)
#   kube-router                    github.com/cloudnativelabs/kube-router/v2 $KUBE_ROUTER_VERSION
#   cni/bridge, cni/host-local, cni/loopback, cni/portmap
#                                  github.com/containernetworking/plugins $CNI_PLUGINS_VERSION
#   pause                          build/pause/linux/pause.c of k8s.io/kubernetes, gcc -static
# into
#
#   $KELASTIC_NODE_CACHE/$K8S_VERSION/bin      (default ~/.cache/kelastic/node/v1.37.2/bin)
#
# and prints that directory on its last line; `kelastic local up --real-nodes N` and the tests'
# real-node lane take it. A directory is complete once its marker `.kelastic-complete` names
# every version asked for; a complete one is reused at once, anything else is rebuilt (an
# interrupted build leaves only a `bin.partial.*` directory, never a half-filled bin/). The
# lock, the Go check, the progress lines, naming what the module proxy refused and the marker
# are localcluster/gobuild.sh's, as for the control plane's and Kueue's builds.
#
# containerd, runc, the CNI plugins and kube-router have no replace lines in their go.mod, so
# `go install PACKAGE@VERSION` builds them as their releases do. k8s.io/kubernetes cannot be
# installed that way (its go.mod replaces every staging module with a folder of its own tree):
# as for the control plane, a throwaway module (gobuild_kubernetes_module) requires it and
# replaces each staging module with its release of the same minor (v1.37.2 -> v0.37.2), which
# shares the control plane's module and build caches.
#
# Needs Go (1.26 or newer), gcc, and the Debian package libseccomp-dev (runc's seccomp, cgo);
# running the nodes also needs iproute2, iptables, ipset, conntrack and nftables, and the image
# of the real-node lane needs debootstrap:
#   apt-get install -y iproute2 iptables ipset conntrack nftables debootstrap libseccomp-dev
# KELASTIC_NODE_APT=1 makes this script run that command (after apt-get update) when something
# is missing, also before it reuses a complete directory: a machine may have the build in its
# cache but not the packages (CI runs it so).
#
# Knobs: K8S_VERSION, CONTAINERD_VERSION, RUNC_VERSION, CNI_PLUGINS_VERSION,
# KUBE_ROUTER_VERSION, KELASTIC_NODE_CACHE (the cache root), GO (the go command),
# GOFLAGS/GOPROXY/GOMODCACHE/GOCACHE as for any Go build.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.37.2}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
RUNC_VERSION=${RUNC_VERSION:-v1.5.3}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-v1.10.0}
KUBE_ROUTER_VERSION=${KUBE_ROUTER_VERSION:-v2.1.0}
GO=${GO:-go}
CACHE_ROOT=${KELASTIC_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/node}
HEARTBEAT=${KELASTIC_BUILD_HEARTBEAT:-30}
APT_PACKAGES=(iproute2 iptables ipset conntrack nftables debootstrap libseccomp-dev)

# shellcheck source=../gobuild.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"
gobuild_name "node build"

gobuild_kubernetes_release
for pin in CONTAINERD_VERSION RUNC_VERSION CNI_PLUGINS_VERSION KUBE_ROUTER_VERSION; do
    [[ ${!pin} =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "$pin=${!pin} is not a release (vMAJOR.MINOR.PATCH)"
done

DEST=$CACHE_ROOT/$K8S_VERSION
BIN=$DEST/bin
WANT="kubernetes $K8S_VERSION containerd $CONTAINERD_VERSION runc $RUNC_VERSION cni-plugins $CNI_PLUGINS_VERSION kube-router $KUBE_ROUTER_VERSION pause"
BINARIES=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr runc kube-router pause
    cni/bridge cni/host-local cni/loopback cni/portmap)

complete() { gobuild_complete "$BIN" "$WANT"; }

missing_packages() {  # sets missing: the APT_PACKAGES not installed
    missing=()
    for package in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
}

if [[ ${KELASTIC_NODE_APT:-0} == 1 ]]; then
    missing_packages
    if [[ ${#missing[@]} -gt 0 ]]; then
        say "installing Debian packages ${missing[*]}"
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } >&2 \
            || die "apt-get install ${missing[*]} failed"
    fi
fi

if complete; then
    echo "$BIN"
    exit 0
fi

# Debian packages: runc's seccomp needs libseccomp's headers and library at build time.
missing_packages
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ " ${missing[*]} " == *" libseccomp-dev "* ]]; then
        die "runc's seccomp needs libseccomp-dev; run: apt-get install -y ${missing[*]} (or KELASTIC_NODE_APT=1 make node)"
    else
        say "note: running the nodes needs ${missing[*]}: apt-get install -y ${missing[*]}"
    fi
fi
gobuild_need_go 1.26
command -v gcc >/dev/null 2>&1 || die "no gcc: runc (cgo, seccomp) and the pause binary need it (apt-get install -y gcc)"

mkdir -p "$DEST"
# One build per version at a time: a second caller waits for the first and reuses its result.
gobuild_lock "$DEST/.lock" "the node for $K8S_VERSION"
if complete; then
    echo "$BIN"
    exit 0
fi

gobuild_workspace "$DEST"
mkdir -p "$PARTIAL/cni"

K8S_GOFLAGS="${GOFLAGS:-} -mod=mod"  # the throwaway module writes its go.sum as it goes
say "building the node components into $BIN (Go: $("$GO" env GOVERSION), proxy: $("$GO" env GOPROXY))"
say "pins: $WANT"
say "a cold build takes about ten minutes on two cores; the module and build caches make the next one fast"

# --- kubelet and kube-proxy ----------------------------------------------------------------
K8S_MOD=$WORK/kubernetes
GOFLAGS="$K8S_GOFLAGS" gobuild_kubernetes_module "$K8S_MOD"
ONLY_ERRORS='{{if .Error}}{{.ImportPath}}: {{.Error}}{{end}}'
GOFLAGS="$K8S_GOFLAGS" run_go "fetching the modules that kubelet and kube-proxy $K8S_VERSION import" "$K8S_MOD" \
    list -deps -f "$ONLY_ERRORS" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
GOFLAGS="$K8S_GOFLAGS" CGO_ENABLED=0 run_go "compiling kubelet and kube-proxy $K8S_VERSION" "$K8S_MOD" \
    build -trimpath -ldflags "$K8S_LDFLAGS" -o "$PARTIAL/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy

# --- the pause binary of the sandbox image ---------------------------------------------------
PAUSE_C=$UPSTREAM_DIR/build/pause/linux/pause.c
if [[ ! -f $PAUSE_C ]]; then
    GOFLAGS="$K8S_GOFLAGS" run_go "fetching k8s.io/kubernetes@$K8S_VERSION's source (for pause.c)" "$K8S_MOD" \
        mod download -json "k8s.io/kubernetes@$K8S_VERSION"
    UPSTREAM_DIR=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' "$LOG" | tail -1)
    PAUSE_C=$UPSTREAM_DIR/build/pause/linux/pause.c
fi
run_step "compiling pause (build/pause/linux/pause.c, static)" "$WORK" \
    gcc -Os -Wall -Werror -static -DVERSION="$K8S_VERSION" -o "$PARTIAL/pause" "$PAUSE_C"

# --- containerd, runc, the CNI plugins, kube-router: go install PACKAGE@VERSION --------------
install_into() {  # DIR CGO_ENABLED GO-INSTALL-ARGS...
    local dir=$1 cgo=$2
    shift 2
    env GOBIN="$dir" CGO_ENABLED="$cgo" "$GO" install -trimpath "$@"
}
CNI=github.com/containernetworking/plugins
run_step "compiling the CNI plugins $CNI_PLUGINS_VERSION (bridge, host-local, loopback, portmap)" "$WORK" \
    install_into "$PARTIAL/cni" 0 -ldflags "-s -w -X $CNI/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
    "$CNI/plugins/main/bridge@$CNI_PLUGINS_VERSION" "$CNI/plugins/ipam/host-local@$CNI_PLUGINS_VERSION" \
    "$CNI/plugins/main/loopback@$CNI_PLUGINS_VERSION" "$CNI/plugins/meta/portmap@$CNI_PLUGINS_VERSION"
run_step "compiling runc $RUNC_VERSION (seccomp, cgo)" "$WORK" \
    install_into "$PARTIAL" 1 -tags seccomp -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" \
    "github.com/opencontainers/runc@$RUNC_VERSION"
CTRD=github.com/containerd/containerd/v2
run_step "compiling containerd $CONTAINERD_VERSION (containerd, containerd-shim-runc-v2, ctr)" "$WORK" \
    install_into "$PARTIAL" 0 -tags no_btrfs -ldflags "-s -w -X $CTRD/version.Version=$CONTAINERD_VERSION" \
    "$CTRD/cmd/containerd@$CONTAINERD_VERSION" "$CTRD/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
    "$CTRD/cmd/ctr@$CONTAINERD_VERSION"
KR=github.com/cloudnativelabs/kube-router/v2
run_step "compiling kube-router $KUBE_ROUTER_VERSION" "$WORK" \
    install_into "$PARTIAL" 0 -ldflags "-s -w -X $KR/pkg/version.Version=$KUBE_ROUTER_VERSION" \
    "$KR/cmd/kube-router@$KUBE_ROUTER_VERSION"

for binary in "${BINARIES[@]}"; do
    [[ -x $PARTIAL/$binary ]] || die "the build left no $binary in $PARTIAL"
done
"$PARTIAL/kubelet" --version >>"$LOG" 2>&1 || explain_failure "running the new kubelet --version"
"$PARTIAL/runc" --version >>"$LOG" 2>&1 || explain_failure "running the new runc --version"

gobuild_publish "$PARTIAL" "$BIN" "$WANT"
say "done in $((SECONDS - START)) s: $(cd "$BIN" && ./kubelet --version), $(cd "$BIN" && ./runc --version | head -1)"
echo "$BIN"
