# Shared by the bench scripts: prints what the figures were measured on, and runs one
# release `shoal serve` in a scratch data directory for the duration of the script.
# Source it after `set -euo pipefail`; then `bench_start_shoal [serve flags...]`.

shoal=${SHOAL_BIN:-${CARGO_TARGET_DIR:-target}/release/shoal}
# The nodes a script starts give their admin this password; the CLI (`SHOAL_USER`,
# `SHOAL_PASSWORD`), curl (the function below) and wrk (`-H "Authorization: $SHOAL_AUTH"`)
# call with it.
export SHOAL_ADMIN_PASSWORD=${SHOAL_ADMIN_PASSWORD:-bench-admin-password}
export SHOAL_USER=admin SHOAL_PASSWORD=$SHOAL_ADMIN_PASSWORD
SHOAL_AUTH="Basic $(printf 'admin:%s' "$SHOAL_ADMIN_PASSWORD" | base64 -w0)"
curl() { command curl -u "admin:$SHOAL_ADMIN_PASSWORD" "$@"; }
work=$(mktemp -d)
bench_cleanups=()

bench_cleanup() {
  local c
  for c in "${bench_cleanups[@]}"; do eval "$c"; done
  if [ -f "$work/shoal.pid" ]; then
    kill "$(cat "$work/shoal.pid")" 2>/dev/null || true
    # Let the server flush and exit before its data directory goes.
    while kill -0 "$(cat "$work/shoal.pid")" 2>/dev/null; do sleep 0.1; done
  fi
  rm -rf "$work"
}
trap bench_cleanup EXIT

echo "date: $(date -u +%FT%TZ)"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
echo "shoal: $("$shoal" --version)"

bench_start_shoal() {
  "$shoal" serve --listen 127.0.0.1:7070 --data-path "$work/data" "$@" >"$work/out" 2>"$work/err" &
  echo $! >"$work/shoal.pid"
  sleep 1
}

# Installs Debian packages whose commands are missing: `bench_need COMMAND PACKAGE...`.
bench_need() {
  local cmd=$1
  shift
  command -v "$cmd" >/dev/null && return 0
  echo "installing $* (for $cmd)" >&2
  { apt-get install -y "$@" || { apt-get update && apt-get install -y "$@"; }; } >/dev/null
}
