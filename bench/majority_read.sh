#!/usr/bin/env bash
# Majority reads (`GET ?consistency=majority`) on an idle 3-node cluster: the latency of a
# read whose confirmation needs each replica to acknowledge a round begun after it, with no
# writes to wake the replicas' held pulls. Prints min / median / max over N reads.
#   bench/majority_read.sh [reads]      (a release build: SHOAL_BIN or target/release/shoal)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
reads=${1:-20}
secret=bench-majority-read
ports=(7201 7202 7203)
for i in 0 1 2; do
  join=()
  [ "$i" -gt 0 ] && join=(--join "127.0.0.1:${ports[0]}")
  "$shoal" serve --listen "127.0.0.1:${ports[$i]}" --data-path "$work/d$i" --cluster-secret "$secret" "${join[@]}" \
    >"$work/n$i.log" 2>&1 &
  bench_cleanups+=("kill $! 2>/dev/null || true; wait $! 2>/dev/null || true")
  for _ in $(seq 1 100); do curl -sf "127.0.0.1:${ports[$i]}/v1/health" >/dev/null && break; sleep 0.1; done
done
base="127.0.0.1:${ports[0]}"
field() { python3 -c "import json, sys; print($1)"; }
for _ in $(seq 1 100); do
  [ "$(curl -s "$base/v1/cluster" | field 'len(json.load(sys.stdin)["nodes"])')" -ge 3 ] && break
  sleep 0.2
done
# The collection the reads go to.
curl -sf -XPUT "$base/v1/collections/c" >/dev/null
curl -sf -XPOST "$base/v1/cluster/rebalance" -d '{}' >/dev/null
for _ in $(seq 1 300); do
  [ "$(curl -s "$base/v1/cluster/rebalance" | field 'json.load(sys.stdin)["state"]')" = done ] && break
  sleep 0.2
done
echo "rebalance: $(curl -s "$base/v1/cluster/rebalance" | field 'json.load(sys.stdin)["state"]')"
for i in $(seq 1 "$reads"); do
  curl -sf -XPUT "$base/v1/collections/c/docs/k$i?durability=majority" -d '{"a":1}' >/dev/null
done
sleep 1
echo "majority reads on an idle 3-node cluster (replicas=1), $reads reads 0.3 s apart, through one node:"
for i in $(seq 1 "$reads"); do
  curl -sf -o /dev/null -w "%{time_total}\n" "$base/v1/collections/c/docs/k$i?consistency=majority"
  sleep 0.3
done | sort -n | awk '{a[NR]=$1*1000} END {printf "min %.1f ms, median %.1f ms, max %.1f ms\n", a[1], a[int((NR+1)/2)], a[NR]}'
