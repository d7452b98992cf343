#!/usr/bin/env bash
# What an idle node costs: one node of 128 partitions is given 3 collections of 100,000
# small documents (`_bulk`), left alone for 20 s, and then its CPU time (utime + stime of
# /proc/PID/stat) is read over 30 s in which no client calls it. Each build given runs in
# turn, ROUNDS times, on a fresh data directory. Prints one line per run.
# Usage: bench/idle_cpu.sh ROUNDS BIN [BIN...]
set -euo pipefail
rounds=$1
shift
port=${PORT:-7181}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SHOAL_ADMIN_PASSWORD=bench-admin-password
python3 -c "
import json
for i in range(100000): print(json.dumps({'op':'upsert','key':'k%06d'%i,'value':{'g':i%10,'n':i,'s':'x'*100}}))" > "$work/docs.ndjson"
split -l 5000 "$work/docs.ndjson" "$work/chunk-"
hz=$(getconf CLK_TCK)
for r in $(seq "$rounds"); do
  for bin in "$@"; do
    rm -rf "$work/data"
    "$bin" serve --listen "127.0.0.1:$port" --data-path "$work/data" --partitions 128 > "$work/log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/v1/health" > /dev/null && break; sleep 0.2; done
    for c in a b c; do
      curl -sf -u "admin:$SHOAL_ADMIN_PASSWORD" -XPUT "http://127.0.0.1:$port/v1/collections/$c" > /dev/null
      for f in "$work"/chunk-*; do
        curl -sf -u "admin:$SHOAL_ADMIN_PASSWORD" -XPOST "http://127.0.0.1:$port/v1/collections/$c/_bulk" --data-binary "@$f" > /dev/null
      done
    done
    sleep 20
    t0=$(awk '{print $14+$15}' "/proc/$pid/stat")
    sleep 30
    t1=$(awk '{print $14+$15}' "/proc/$pid/stat")
    kill "$pid"
    wait "$pid" 2> /dev/null || true
    echo "round $r $bin: idle CPU over 30 s: $(( (t1 - t0) * 1000 / hz )) ms ($(( (t1 - t0) * 100 / (30 * hz) ))% of one core)"
  done
done
