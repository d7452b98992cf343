#!/usr/bin/env bash
# Issue 12, item 8: random-key upserts of 180-byte documents from 200 connections (wrk -t2
# -c200, keys over 1M), at durability none and persist, and in the same run Redis 7 `SET`
# with `appendfsync always` (redis-benchmark -r, the same sizes and connections); and, as
# the floor under them, wrk on `GET /v1/health` (no storage work) with the same connections.
# Needs: a release build; wrk, redis-server and redis-benchmark are installed from Debian's
# packages when missing.
# Usage: bench/write_path.sh [seconds per run] [runs]
set -euo pipefail
secs=${1:-20}
runs=${2:-3}
. "$(dirname "$0")/lib.sh"
bench_need wrk wrk
bench_need redis-server redis-server redis-tools
lua="$(cd "$(dirname "$0")" && pwd)/wrk/upsert.lua"
bench_cleanups+=("redis-cli -p 6398 shutdown nosave >/dev/null 2>&1 || true")
bench_start_shoal
until curl -sf localhost:7070/v1/health >/dev/null; do sleep 0.1; done
curl -sf -X PUT localhost:7070/v1/collections/w >/dev/null
mkdir -p "$work/redis"
redis-server --port 6398 --dir "$work/redis" --save '' --appendonly yes --appendfsync always --daemonize yes >/dev/null
sleep 0.5
for i in $(seq "$runs"); do
  echo "--- run $i"
  # The HTTP floor: the same connections on an endpoint that does no work (no body, no
  # storage), so a reader sees what the HTTP stack and wrk alone leave of the 2 cores.
  echo "\$ wrk -t2 -c200 -d${secs}s --latency http://127.0.0.1:7070/v1/health"
  wrk -t2 -c200 -d"${secs}s" --latency -H "Authorization: $SHOAL_AUTH" http://127.0.0.1:7070/v1/health | grep -E "Requests/sec|^ +(50|99)%|Non-2xx"
  for d in none persist; do
    echo "\$ DURABILITY=$d wrk -t2 -c200 -d${secs}s --latency -s bench/wrk/upsert.lua http://127.0.0.1:7070"
    DURABILITY=$d wrk -t2 -c200 -d"${secs}s" --latency -H "Authorization: $SHOAL_AUTH" -s "$lua" http://127.0.0.1:7070 | grep -E "Requests/sec|^ +(50|99)%|Non-2xx"
  done
  echo "\$ redis-benchmark -p 6398 -c 200 -t set -d 180 -r 1000000 -n 400000 -q (appendfsync always)"
  redis-benchmark -p 6398 -c 200 -t set -d 180 -r 1000000 -n 400000 -q | tr '\r' '\n' | grep -E '^SET: [0-9]'
done
