# shellcheck shell=bash
# The start every install script shares. Sourced, never run, right after `set -Eeuo pipefail`:
#     . "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" helm-install
# The argument names the script in its log lines. The script then has:
#   CACHE      the cache root: $OPENFORGE_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/openforge
#   START_S    when the script began (in bash's $SECONDS)
#   log MSG    "[<name> +<seconds>s] MSG" on stderr: stdout is kept for the script's result line
#   die MSG    log "ERROR: MSG" and exit 1
#   an ERR trap that logs the failing line and command
#   stamp_matches, exit_if_installed, lock_then_exit_if_installed (below)

INSTALL_NAME="${1:?usage: . scripts/lib/install_common.sh LOG_NAME}"
CACHE="${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}"
START_S=$SECONDS

log() { printf '[%s +%ss] %s\n' "$INSTALL_NAME" "$((SECONDS - START_S))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'log "FAILED (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

# stamp_matches MARKER STAMP: the marker file's first line is STAMP (the recipe it was installed by).
stamp_matches() { [ -f "$1" ] && [ "$(head -n 1 "$1")" = "$2" ]; }

# exit_if_installed FORCE CHECK RESULT [WHAT]
#   Unless FORCE is 1, when the command CHECK succeeds: log WHAT (default "already installed"),
#   print RESULT as the last line of stdout (callers read it; nothing when empty) and exit 0.
exit_if_installed() {
    local force="$1" check="$2" result="$3" what="${4:-already installed}"
    if [ "$force" != "1" ] && "$check"; then
        log "$what${result:+: $result}"
        if [ -n "$result" ]; then echo "$result"; fi
        exit 0
    fi
}

# lock_then_exit_if_installed LOCK FORCE CHECK RESULT
#   One install at a time per cache: take the lock file LOCK, waiting while a concurrent run holds
#   it (the lock lasts until the script exits), then check again as exit_if_installed does, since
#   that run may have installed everything meanwhile.
lock_then_exit_if_installed() {
    local lock="$1"
    mkdir -p "$(dirname "$lock")"
    exec 9>"$lock"
    if command -v flock >/dev/null 2>&1; then
        log "waiting for the install lock $lock"
        flock 9
    fi
    exit_if_installed "$2" "$3" "$4" "installed by a concurrent run"
}

# go_tool_module DIR NAME PKG@VERSION...
#   A throwaway local module in DIR (go.mod and go.sum made anew) that requires each PKG@VERSION as a
#   tool (`go get -tool`). Unlike `go install pkg@version`, this builds programs whose own go.mod has
#   replace lines; the caller may `go mod edit` DIR's go.mod before go_lean_build.
go_tool_module() {
    local dir="$1" name="$2"; shift 2
    mkdir -p "$dir"
    rm -f "$dir/go.mod" "$dir/go.sum"
    (cd "$dir" && go mod init "openforge.local/$name" >/dev/null 2>&1)
    local pkg
    for pkg in "$@"; do (cd "$dir" && nice -n 10 go get -tool "$pkg" >&2); done
}

# go_lean_build DIR BIN_DIR LDFLAGS PKG...
#   Build each PKG (a tool of DIR's module) into BIN_DIR, niced, as many packages at once as there are
#   cores (OPENFORGE_GO_BUILD_P overrides). Lean: no paths of this machine (-trimpath), no symbol table
#   or DWARF (-s -w, which also spares the linker most of its work), no VCS stamp; CGO off (static,
#   and no C compiler needed). Logs the wall time and the binaries' sizes.
go_lean_build() {
    local dir="$1" bin="$2" ldflags="$3"; shift 3
    local t0=$SECONDS
    mkdir -p "$bin.tmp"
    log "building $* -> $bin (go build -p ${OPENFORGE_GO_BUILD_P:-$(nproc)}, GOFLAGS=$GOFLAGS)"
    (cd "$dir" && CGO_ENABLED=0 nice -n 10 go build -p "${OPENFORGE_GO_BUILD_P:-$(nproc)}" \
        -ldflags "-s -w $ldflags" -o "$bin.tmp/" "$@")
    mkdir -p "$bin"
    mv -f "$bin.tmp"/* "$bin/"
    rmdir "$bin.tmp"
    log "built $(cd "$bin" && du -h -- * | tr '\t' ' ' | paste -sd ',' -) in $((SECONDS - t0)) s"
}
