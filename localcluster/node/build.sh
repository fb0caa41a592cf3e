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
# interrupted build leaves only a `bin.partial.*` directory, never a half-filled bin/).
#
# containerd, runc, the CNI plugins and kube-router have no replace lines in their go.mod, so
# `go install PACKAGE@VERSION` builds them as their releases do. k8s.io/kubernetes cannot be
# installed that way (its go.mod replaces every staging module with a folder of its own tree):
# as in localcluster/controlplane/build.sh, a throwaway module requires it and replaces each
# staging module with its release of the same minor (v1.37.2 -> v0.37.2), which shares the
# control plane's module and build caches.
#
# Needs Go (1.26 or newer), gcc, and the Debian package libseccomp-dev (runc's seccomp, cgo);
# running the nodes also needs iptables, ipset, conntrack and nftables, and the image of the
# real-node lane needs debootstrap:
#   apt-get install -y iptables ipset conntrack nftables debootstrap libseccomp-dev
# (KELASTIC_NODE_APT=1 makes this script run that command when something is missing.)
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
APT_PACKAGES=(iptables ipset conntrack nftables debootstrap libseccomp-dev)

say() { echo "node build: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

[[ $K8S_VERSION =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] \
    || die "K8S_VERSION=$K8S_VERSION is not a Kubernetes release (v1.MINOR.PATCH, e.g. v1.37.2)"
MINOR=${BASH_REMATCH[1]}
STAGING_VERSION="v0.$MINOR.${BASH_REMATCH[2]}"
for pin in CONTAINERD_VERSION RUNC_VERSION CNI_PLUGINS_VERSION KUBE_ROUTER_VERSION; do
    [[ ${!pin} =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "$pin=${!pin} is not a release (vMAJOR.MINOR.PATCH)"
done

DEST=$CACHE_ROOT/$K8S_VERSION
BIN=$DEST/bin
MARKER=$BIN/.kelastic-complete
WANT="kubernetes $K8S_VERSION containerd $CONTAINERD_VERSION runc $RUNC_VERSION cni-plugins $CNI_PLUGINS_VERSION kube-router $KUBE_ROUTER_VERSION pause"
BINARIES=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr runc kube-router pause
    cni/bridge cni/host-local cni/loopback cni/portmap)

complete() { [[ -f $MARKER && $(cat "$MARKER") == "$WANT" ]]; }

if complete; then
    echo "$BIN"
    exit 0
fi

# Debian packages: runc's seccomp needs libseccomp's headers and library at build time.
missing=()
for package in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ ${KELASTIC_NODE_APT:-0} == 1 ]]; then
        say "installing Debian packages ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 \
            || die "apt-get install ${missing[*]} failed"
    elif [[ " ${missing[*]} " == *" libseccomp-dev "* ]]; then
        die "runc's seccomp needs libseccomp-dev; run: apt-get install -y ${missing[*]} (or KELASTIC_NODE_APT=1 make node)"
    else
        say "note: running the nodes needs ${missing[*]}: apt-get install -y ${missing[*]}"
    fi
fi
command -v "$GO" >/dev/null 2>&1 || die "no Go toolchain ('$GO' is not on PATH); install Go 1.26 or newer"
command -v gcc >/dev/null 2>&1 || die "no gcc: runc (cgo, seccomp) and the pause binary need it (apt-get install -y gcc)"

mkdir -p "$DEST"
# One build per version at a time: a second caller waits for the first and reuses its result.
exec 9>"$DEST/.lock"
if ! flock -n 9; then
    say "another build of the node for $K8S_VERSION is running; waiting for it (lock $DEST/.lock)"
    flock 9
fi
if complete; then
    echo "$BIN"
    exit 0
fi

WORK=$(mktemp -d "$DEST/work.XXXXXX")
PARTIAL=$DEST/bin.partial.$$
LOG=$WORK/build.log
cleanup() {
    [[ -n ${HEARTBEAT_PID:-} ]] && kill "$HEARTBEAT_PID" 2>/dev/null
    rm -rf "$WORK" "$PARTIAL"
}
trap cleanup EXIT
rm -rf "$DEST"/bin.partial.* "$DEST"/work.*
mkdir -p "$PARTIAL/cni"
START=$SECONDS

# The proxy's refusal reads "go: MODULE@VERSION: reading URL: 404 Not Found" (or 410 Gone,
# "unknown revision", "not found"); name the module and version plainly, then the go output.
explain_failure() {
    local step=$1
    local refused
    refused=$( {
        grep -oE '[A-Za-z0-9._~/-]+@v[0-9][A-Za-z0-9.+-]*: reading [^ ]+: [0-9]{3} [A-Za-z ]+' "$LOG" \
            | sed -E 's#^(.*)@(v[^:]*): reading [^ ]+: (.*)$#module \1 version \2 (\3)#'
        grep -oE '[A-Za-z0-9._~/-]+@v[0-9][A-Za-z0-9.+-]*: (unknown revision|invalid version)[^"]*' "$LOG" \
            | sed -E 's#^(.*)@(v[^:]*): (.*)$#module \1 version \2 (\3)#'
    } | sort -u | head -5 || true)
    say "ERROR: $step failed after $((SECONDS - START)) s"
    if [[ -n $refused ]]; then
        while IFS= read -r line; do
            say "  the Go module proxy ($("$GO" env GOPROXY)) refused $line"
        done <<<"$refused"
    fi
    say "last lines of the build's output ($LOG):"
    tail -n 25 "$LOG" | sed 's/^/    /' >&2
    trap - EXIT
    [[ -n ${HEARTBEAT_PID:-} ]] && kill "$HEARTBEAT_PID" 2>/dev/null
    rm -rf "$PARTIAL"
    say "the work directory stays for inspection: $WORK"
    exit 1
}

# A Go build prints nothing for minutes; a line every $HEARTBEAT seconds says it is alive and
# how far the caches have grown.
heartbeat() {
    local step=$1
    while sleep "$HEARTBEAT"; do
        say "  ... $step, $((SECONDS - START)) s so far (module cache $(du -sh "$("$GO" env GOMODCACHE)" 2>/dev/null | cut -f1), build cache $(du -sh "$("$GO" env GOCACHE)" 2>/dev/null | cut -f1))"
    done
}

run_step() {  # STEP DIR COMMAND...: runs COMMAND in DIR with a heartbeat, its output in $LOG
    local step=$1 dir=$2
    shift 2
    say "$step"
    heartbeat "$step" &
    HEARTBEAT_PID=$!
    if ! (cd "$dir" && "$@") >>"$LOG" 2>&1; then
        explain_failure "$step"
    fi
    kill "$HEARTBEAT_PID" 2>/dev/null
    wait "$HEARTBEAT_PID" 2>/dev/null || true
    HEARTBEAT_PID=
    say "  done at $((SECONDS - START)) s"
}

K8S_GOFLAGS="${GOFLAGS:-} -mod=mod"  # the throwaway module writes its go.sum as it goes
say "building the node components into $BIN (Go: $("$GO" env GOVERSION), proxy: $("$GO" env GOPROXY))"
say "pins: $WANT"
say "a cold build takes about ten minutes on two cores; the module and build caches make the next one fast"

# --- kubelet and kube-proxy ----------------------------------------------------------------
K8S_MOD=$WORK/kubernetes
mkdir -p "$K8S_MOD"
cat >"$K8S_MOD/go.mod" <<EOF
module kelastic.local/build/kubernetes

go 1.26.0

require k8s.io/kubernetes $K8S_VERSION
EOF
run_step "fetching k8s.io/kubernetes@$K8S_VERSION's go.mod" "$K8S_MOD" \
    env GOFLAGS="$K8S_GOFLAGS" "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION"
UPSTREAM_MOD=$(sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p' "$LOG" | tail -1)
UPSTREAM_DIR=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' "$LOG" | tail -1)
UPSTREAM_INFO=$(sed -n 's/^\s*"Info": "\(.*\)",$/\1/p' "$LOG" | tail -1)
[[ -f $UPSTREAM_MOD ]] || { echo "no GoMod in the go command's answer" >>"$LOG"; explain_failure "reading k8s.io/kubernetes's go.mod"; }
UPSTREAM_GO=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$UPSTREAM_MOD")
mapfile -t STAGING < <(sed -n 's#^\s*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$UPSTREAM_MOD")
[[ ${#STAGING[@]} -gt 0 ]] || die "k8s.io/kubernetes@$K8S_VERSION's go.mod names no staging modules; is it a release?"
{
    echo "module kelastic.local/build/kubernetes"
    echo
    echo "go ${UPSTREAM_GO:-1.26.0}"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    for module in "${STAGING[@]}"; do echo "	$module => $module $STAGING_VERSION"; done
    echo ")"
} >"$K8S_MOD/go.mod"
# The version the binaries report: the -X flags of Kubernetes's own release build.
BUILD_DATE=$(sed -n 's/.*"Time": *"\([^"]*\)".*/\1/p' "$UPSTREAM_INFO" 2>/dev/null || true)
K8S_LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$MINOR"
    K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=${BUILD_DATE:-1970-01-01T00:00:00Z}"
done
ONLY_ERRORS='{{if .Error}}{{.ImportPath}}: {{.Error}}{{end}}'
run_step "fetching the modules that kubelet and kube-proxy $K8S_VERSION import" "$K8S_MOD" \
    env GOFLAGS="$K8S_GOFLAGS" "$GO" list -deps -f "$ONLY_ERRORS" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
run_step "compiling kubelet and kube-proxy $K8S_VERSION" "$K8S_MOD" \
    env GOFLAGS="$K8S_GOFLAGS" CGO_ENABLED=0 "$GO" build -trimpath -ldflags "$K8S_LDFLAGS" -o "$PARTIAL/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy

# --- the pause binary of the sandbox image ---------------------------------------------------
PAUSE_C=$UPSTREAM_DIR/build/pause/linux/pause.c
if [[ ! -f $PAUSE_C ]]; then
    run_step "fetching k8s.io/kubernetes@$K8S_VERSION's source (for pause.c)" "$K8S_MOD" \
        env GOFLAGS="$K8S_GOFLAGS" "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION"
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

# Swap the finished directory in whole, then mark it complete: a reader never sees a mix.
rm -rf "$BIN.old"
[[ -d $BIN ]] && mv "$BIN" "$BIN.old"
mv "$PARTIAL" "$BIN"
rm -rf "$BIN.old"
echo "$WANT" >"$MARKER"
say "done in $((SECONDS - START)) s: $(cd "$BIN" && ./kubelet --version), $(cd "$BIN" && ./runc --version | head -1)"
echo "$BIN"
