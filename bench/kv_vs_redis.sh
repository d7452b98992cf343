#!/usr/bin/env bash
# Seed 001's baseline on this machine: 200 connections of blocking small-document gets
# against Shoal, and redis-benchmark against Redis in the same run; then the bulk load.
# Needs: a release build (cargo build --release); redis-server and redis-benchmark are
# installed from Debian's packages (redis-server, redis-tools) when missing. Usage: bench/kv_vs_redis.sh [runs]
set -euo pipefail
runs=${1:-3}
. "$(dirname "$0")/lib.sh"
bench_need redis-server redis-server redis-tools
bench_cleanups+=("redis-cli -p 6399 shutdown nosave >/dev/null 2>&1 || true")
bench_start_shoal --cache-mb 256
redis-server --port 6399 --save '' --appendonly no --daemonize yes >/dev/null
sleep 0.5
redis-cli -p 6399 set key:__rand_int__ "$(head -c 195 /dev/zero | tr '\0' x)" >/dev/null
for i in $(seq "$runs"); do
  echo "--- run $i"
  echo "\$ redis-benchmark -p 6399 -c 200 -t get -d 195 -n 200000 -q"
  redis-benchmark -p 6399 -c 200 -t get -d 195 -n 200000 -q | tr '\r' '\n' | grep -E '^GET: [0-9]'
  echo "\$ shoal bench kv --parallel 200 --repeat 1000"
  "$shoal" bench kv --parallel 200 --repeat 1000 | grep report
done
echo "--- bulk load (fresh collection)"
echo "\$ shoal bench load --docs 1000000"
"$shoal" bench load --docs 1000000
