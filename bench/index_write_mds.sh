#!/usr/bin/env bash
# Issue 41's write target with the services apart, as Couchbase's multi-dimensional scaling
# deploys them: runs the write part of `shoal bench index-rebalance` (2 nodes running data and
# query, 3 running index and query; 100,000 documents by `_bulk`, 4 in flight, on a fresh
# cluster with 0 and then with 5 placed indexes of 8 partitions) twice per round:
#   pinned   — the bench client and the data nodes on CPU 0, the index nodes on CPU 1 (each
#              service its own core, as on separate machines);
#   shared   — every process on both cores (what `shoal bench index-rebalance` does alone).
# Prints the bench's rows (indexes | writes acknowledged s | × none | indexed s) per run.
# Usage: bench/index_write_mds.sh ROUNDS BIN   (DOCS=N changes the load; needs taskset)
set -euo pipefail
rounds=$1
bin=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
args=(bench index-rebalance --data-nodes 2 --index-nodes 3 --methods none --eq-scans 0
  --docs "${DOCS:-100000}" --indexes 5 --writers 4 --before-secs 2)
rows() { grep -E '^\| [05] \|' "$log" | tr -s ' ' | tr '\n' ' '; }
for r in $(seq "$rounds"); do
  taskset -c 0 "$bin" "${args[@]}" > "$log" 2>&1 &
  bench=$!
  declare -A pinned=()
  # Each index node, as soon as it is up, goes to CPU 1 with all its threads (threads it
  # starts later inherit that).
  while kill -0 "$bench" 2> /dev/null; do
    for pid in $(pgrep -f -- "ixr-writes-[05]-i" || true); do
      if [ -z "${pinned[$pid]:-}" ] && taskset -a -c -p 1 "$pid" > /dev/null 2>&1; then pinned[$pid]=1; fi
    done
    sleep 0.05
  done
  wait "$bench" || { echo "round $r pinned: the bench failed"; cat "$log"; exit 1; }
  echo "round $r pinned (data + client on CPU 0, ${#pinned[@]} index nodes on CPU 1): $(rows)"
  unset pinned
  "$bin" "${args[@]}" > "$log" 2>&1 || { echo "round $r shared: the bench failed"; cat "$log"; exit 1; }
  echo "round $r shared (every process on both CPUs): $(rows)"
done
