#!/usr/bin/env bash
# A clean restart right after a load (issue 40): each binary loads DOCS documents through
# `shoal bench load`, is stopped with SIGTERM at once, and started again; printed per run:
# the stop's time, the journal files left on disk (count and bytes), and the time from the
# restart's exec to the first `200` of `/v1/health` and of a document GET. Binaries take
# turns, run by run, so that a baseline build is measured in the same run.
# Usage: bench/restart.sh RUNS BINARY... (DOCS=1000000 by default)
set -euo pipefail
# The nodes started here give their admin this password; the CLI, curl and tpch_diff.py
# call with it.
export SHOAL_ADMIN_PASSWORD=${SHOAL_ADMIN_PASSWORD:-bench-admin-password}
export SHOAL_USER=admin SHOAL_PASSWORD=$SHOAL_ADMIN_PASSWORD
curl() { command curl -u "admin:$SHOAL_ADMIN_PASSWORD" "$@"; }
runs=$1
shift
docs=${DOCS:-1000000}
port=${PORT:-7071}
url="http://127.0.0.1:$port"
echo "date: $(date -u +%FT%TZ)"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
echo "documents: $docs; runs: $runs per binary"
now() { date +%s.%N; }
wait_ok() {
  # Polls until `curl` answers 200, at most 120 s; prints the time it took from $1.
  local from=$1 path=$2
  for _ in $(seq 1 12000); do
    if curl -sf -o /dev/null "$url$path"; then
      echo "$(now) - $from" | bc
      return 0
    fi
    sleep 0.01
  done
  echo "never"
}
for run in $(seq 1 "$runs"); do
  for bin in "$@"; do
    dir=$(mktemp -d)
    "$bin" serve --listen "127.0.0.1:$port" --data-path "$dir/data" >"$dir/out" 2>"$dir/err" &
    pid=$!
    wait_ok "$(now)" /v1/health >/dev/null
    "$bin" --url "$url" bench load --docs "$docs" >"$dir/load" 2>&1
    stop=$(now)
    kill -TERM "$pid"
    wait "$pid" || true
    stop_s=$(echo "$(now) - $stop" | bc)
    journals=$(find "$dir/data" -name '*.jnl' | wc -l)
    journal_bytes=$(find "$dir/data" -name '*.jnl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    start=$(now)
    "$bin" serve --listen "127.0.0.1:$port" --data-path "$dir/data" >"$dir/out2" 2>"$dir/err2" &
    pid=$!
    health_s=$(wait_ok "$start" /v1/health)
    get_s=$(wait_ok "$start" /v1/collections/load/docs/doc-00000000)
    kill -TERM "$pid"
    wait "$pid" || true
    echo "run $run $bin: stop ${stop_s}s, journals left $journals ($journal_bytes bytes), health after ${health_s}s, first GET after ${get_s}s"
    rm -rf "$dir"
  done
done
