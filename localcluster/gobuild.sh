# What the local cluster's Go builds share; sourced (never run) by
# localcluster/controlplane/build.sh and localcluster/kueue/build.sh.
#
# A build script sets GO (the go command), HEARTBEAT (seconds between progress lines) and
# calls gobuild_name first; then, in this order:
#
#   gobuild_need_go MIN          fails naming the Go to install when GO is not on PATH
#   gobuild_lock LOCK WHAT       one build per version at a time: a second caller waits
#                                (saying so) for the first, then looks again
#   START=$SECONDS LOG=FILE      where run_go's output goes and when the build started
#   run_go STEP DIR ARGS...      the go command in DIR with a heartbeat; on failure
#                                explain_failure STEP
#
# explain_failure names each module and version the Go module proxy refused (404/410,
# unknown revision, invalid version), prints the go command's last lines, runs the script's
# on_build_failure (if it defines one: what to keep and remove) and exits 1. Everything is
# said on stderr, prefixed with the build's name; stdout is left to the script's result.

gobuild_name() {  # NAME: the prefix of every line ("control-plane build: ...")
    GOBUILD_NAME=$1
}

say() { echo "$GOBUILD_NAME: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

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
    say "last lines of the go command's output ($LOG):"
    tail -n 25 "$LOG" | sed 's/^/    /' >&2
    stop_heartbeat
    if declare -F on_build_failure >/dev/null; then
        on_build_failure
    fi
    exit 1
}

# A Go build prints nothing for minutes; a line every $HEARTBEAT seconds says it is alive
# and how far the caches have grown. Stopped, it stops its sleep too: an orphaned sleep would
# hold the caller's pipe open (`make -s kueue | tail -1` would wait for it).
heartbeat() {
    local step=$1 sleeper=
    trap 'kill $sleeper 2>/dev/null; exit 0' TERM
    while true; do
        sleep "$HEARTBEAT" &
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

run_go() {  # STEP DIR ARGS...: runs the go command in DIR with a heartbeat, its output in $LOG
    local step=$1 dir=$2
    shift 2
    say "$step"
    heartbeat "$step" &
    HEARTBEAT_PID=$!
    if ! (cd "$dir" && "$GO" "$@") >>"$LOG" 2>&1; then
        explain_failure "$step"
    fi
    stop_heartbeat
}
