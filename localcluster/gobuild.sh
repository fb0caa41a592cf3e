# What the local cluster's Go builds share; sourced (never run) by
# localcluster/controlplane/build.sh, localcluster/kueue/build.sh and localcluster/node/build.sh.
#
# A build script sets GO (the go command), HEARTBEAT (seconds between progress lines) and
# calls gobuild_name first; then, in this order:
#
#   gobuild_complete DIR WANT    whether DIR is a finished build of WANT (its marker
#                                DIR/.kelastic-complete reads WANT): reused at once, no Go asked
#   gobuild_need_go MIN          fails naming the Go to install when GO is not on PATH
#   gobuild_lock LOCK WHAT       one build per version at a time: a second caller waits
#                                (saying so) for the first, then looks again
#   gobuild_workspace DEST       WORK (a scratch directory, kept for inspection when the build
#                                fails), PARTIAL (DEST/bin.partial.PID), LOG and START; both
#                                directories are removed when the script exits. A script with
#                                another layout sets START=$SECONDS and LOG=FILE itself.
#   run_go STEP DIR ARGS...      the go command in DIR with a heartbeat, its output in $LOG;
#                                on failure explain_failure STEP
#   run_step STEP DIR COMMAND... the same for any command (a shell function too: gcc, go install
#                                with a step's own environment)
#   gobuild_publish PARTIAL DIR WANT
#                                PARTIAL becomes DIR whole, then DIR is marked complete: a reader
#                                never sees a mix of two builds
#
# k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces every staging module with a
# folder of its own tree); gobuild_kubernetes_release and gobuild_kubernetes_module make the
# throwaway module that builds it instead.
#
# explain_failure names each module and version the Go module proxy refused (404/410,
# unknown revision, invalid version), prints the build's last lines, runs the script's
# on_build_failure (if it defines one: what to keep and remove) and exits 1. Everything is
# said on stderr, prefixed with the build's name; stdout is left to the script's result.

gobuild_name() {  # NAME: the prefix of every line ("control-plane build: ...")
    GOBUILD_NAME=$1
}

say() { echo "$GOBUILD_NAME: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

gobuild_complete() {  # DIR WANT
    [[ -f $1/.kelastic-complete && $(cat "$1/.kelastic-complete") == "$2" ]]
}

gobuild_need_go() {  # MIN: the oldest Go that builds it
    command -v "$GO" >/dev/null 2>&1 || die "no Go toolchain ('$GO' is not on PATH); install Go $1 or newer"
}

gobuild_lock() {  # LOCK WHAT: holds LOCK (fd 9) until the script exits
    exec 9>"$1"
    if ! flock -n 9; then
        say "another build of $2 is running; waiting for it (lock $1)"
        flock 9
    fi
}

gobuild_workspace() {  # DEST: see above; leftovers of an interrupted build go first
    rm -rf "$1"/bin.partial.* "$1"/work.*
    WORK=$(mktemp -d "$1/work.XXXXXX")
    PARTIAL=$1/bin.partial.$$
    LOG=$WORK/build.log
    mkdir -p "$PARTIAL"
    trap 'stop_heartbeat; rm -rf "$WORK" "$PARTIAL"' EXIT
    on_build_failure() {  # the work directory stays for whoever looks into the failure
        trap - EXIT
        rm -rf "$PARTIAL"
        say "the work directory stays for inspection: $WORK"
    }
    START=$SECONDS
}

gobuild_publish() {  # PARTIAL DIR WANT
    local partial=$1 dir=$2
    rm -rf "$dir.old"
    if [[ -d $dir ]]; then mv "$dir" "$dir.old"; fi
    mv "$partial" "$dir"
    rm -rf "$dir.old"
    echo "$3" >"$dir/.kelastic-complete"
}

# The proxy's refusal reads "go: MODULE@VERSION: reading URL: 404 Not Found" (or 403/410,
# "unknown revision", "invalid version"); name the module and version plainly, then the output.
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
    stop_heartbeat
    if declare -F on_build_failure >/dev/null; then
        on_build_failure
    fi
    exit 1
}

# A Go build prints nothing for minutes; a line every $HEARTBEAT seconds says it is alive
# and how far the caches have grown. Stopped, it stops its sleep too. The sleep holds none of
# the caller's pipes: a stop that lands between its start and `sleeper=$!` orphans it, and an
# orphan holding stdout would keep `make -s kueue | tail -1` (or a caller reading the output
# to its end) waiting for the whole heartbeat after the build finished.
heartbeat() {
    local step=$1 sleeper=
    trap 'kill $sleeper 2>/dev/null; exit 0' TERM
    while true; do
        sleep "$HEARTBEAT" </dev/null >/dev/null 2>&1 &
        sleeper=$!
        wait "$sleeper"
        say "  ... $step, $((SECONDS - START)) s so far (module cache $(du -sh "$("$GO" env GOMODCACHE)" 2>/dev/null | cut -f1), build cache $(du -sh "$("$GO" env GOCACHE)" 2>/dev/null | cut -f1))"
    done
}

stop_heartbeat() {
    if [[ -n ${HEARTBEAT_PID:-} ]]; then
        kill "$HEARTBEAT_PID" 2>/dev/null
        wait "$HEARTBEAT_PID" 2>/dev/null || true
    fi
    HEARTBEAT_PID=
}

run_step() {  # STEP DIR COMMAND...: COMMAND in DIR with a heartbeat, its output in $LOG
    local step=$1 dir=$2
    shift 2
    say "$step"
    heartbeat "$step" &
    HEARTBEAT_PID=$!
    if ! (cd "$dir" && "$@") >>"$LOG" 2>&1; then
        explain_failure "$step"
    fi
    stop_heartbeat
    say "  done at $((SECONDS - START)) s"
}

run_go() {  # STEP DIR ARGS...: the go command's ARGS as a step
    local step=$1 dir=$2
    shift 2
    run_step "$step" "$dir" "$GO" "$@"
}

gobuild_kubernetes_release() {  # checks K8S_VERSION; sets MINOR and STAGING_VERSION (v1.37.2 -> v0.37.2)
    [[ $K8S_VERSION =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] \
        || die "K8S_VERSION=$K8S_VERSION is not a Kubernetes release (v1.MINOR.PATCH, e.g. v1.37.2)"
    MINOR=${BASH_REMATCH[1]}
    STAGING_VERSION="v0.$MINOR.${BASH_REMATCH[2]}"
}

# DIR: a throwaway module in DIR that requires k8s.io/kubernetes $K8S_VERSION and replaces each
# staging module with its release of the same minor, which is how projects import Kubernetes as
# a library. Sets UPSTREAM_DIR (the module's source) and K8S_LDFLAGS (the -X flags of
# Kubernetes's own release build, hack/lib/version.sh: the version the binaries report). Its go
# commands need GOFLAGS to hold -mod=mod: the module's go.sum is written as it goes.
gobuild_kubernetes_module() {
    local mod=$1 upstream_mod upstream_go upstream_info build_date pkg module
    local -a staging
    mkdir -p "$mod"
    printf 'module kelastic.local/build/kubernetes\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes %s\n' \
        "$K8S_VERSION" >"$mod/go.mod"
    run_go "fetching k8s.io/kubernetes@$K8S_VERSION's go.mod" "$mod" mod download -json "k8s.io/kubernetes@$K8S_VERSION"
    upstream_mod=$(sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p' "$LOG" | tail -1)
    UPSTREAM_DIR=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' "$LOG" | tail -1)
    upstream_info=$(sed -n 's/^\s*"Info": "\(.*\)",$/\1/p' "$LOG" | tail -1)
    [[ -f $upstream_mod ]] || { echo "no GoMod in the go command's answer" >>"$LOG"; explain_failure "reading k8s.io/kubernetes's go.mod"; }
    upstream_go=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$upstream_mod")
    # The staging modules are the ones k8s.io/kubernetes replaces with its own folders.
    mapfile -t staging < <(sed -n 's#^\s*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$upstream_mod")
    [[ ${#staging[@]} -gt 0 ]] || die "k8s.io/kubernetes@$K8S_VERSION's go.mod names no staging modules; is it a release?"
    {
        printf 'module kelastic.local/build/kubernetes\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' \
            "${upstream_go:-1.26.0}" "$K8S_VERSION"
        for module in "${staging[@]}"; do printf '\t%s => %s %s\n' "$module" "$module" "$STAGING_VERSION"; done
        echo ")"
    } >"$mod/go.mod"
    say "${#staging[@]} staging modules pinned to $STAGING_VERSION"
    build_date=$(sed -n 's/.*"Time": *"\([^"]*\)".*/\1/p' "$upstream_info" 2>/dev/null || true)
    K8S_LDFLAGS="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$MINOR"
        K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=${build_date:-1970-01-01T00:00:00Z}"
    done
}
