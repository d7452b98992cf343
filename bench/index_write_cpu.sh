#!/usr/bin/env bash
# What the index service costs the writes: runs the write part of `shoal bench
# index-rebalance` (3 nodes running data, index and query; 100,000 documents by `_bulk`, 4
# in flight, on a fresh cluster with 0 and then with 5 placed indexes of 8 partitions) and
# reads each cluster's CPU time (utime + stime of every node's /proc/PID/stat, the last
# sample before the bench stops it: start, index creation, load and indexing included).
# Each build given runs in turn, ROUNDS times. Prints one line per run.
# Usage: bench/index_write_cpu.sh ROUNDS BIN [BIN...]   (DOCS=N changes the load)
set -euo pipefail
rounds=$1
shift
hz=$(getconf CLK_TCK)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for r in $(seq "$rounds"); do
  for bin in "$@"; do
    "$bin" bench index-rebalance --default-services --data-nodes 3 --methods none --eq-scans 0 \
      --docs "${DOCS:-100000}" --indexes 5 --writers 4 --before-secs 2 > "$log" 2>&1 &
    bench=$!
    declare -A ticks=()
    while kill -0 "$bench" 2> /dev/null; do
      for pid in $(pgrep -f -- "ixr-writes-[05]-d" || true); do
        name=$(ps -o args= -p "$pid" | grep -o "ixr-writes-[05]-d[0-9]*" || true)
        t=$(awk '{print $14 + $15}' "/proc/$pid/stat" 2> /dev/null || true)
        if [ -n "$name" ] && [ -n "$t" ]; then ticks[$name]=$t; fi
      done
      sleep 0.1
    done
    wait "$bench" || { echo "run $r $bin: the bench failed"; cat "$log"; exit 1; }
    sum() { local s=0 k; for k in "${!ticks[@]}"; do [[ $k == ixr-writes-$1-* ]] && s=$((s + ticks[$k])); done; echo "$s"; }
    none=$(sum 0)
    five=$(sum 5)
    rows=$(grep -E '^\| [05] \|' "$log" | tr -s ' ' | tr '\n' ' ')
    echo "run $r $bin: cluster CPU s with 0 indexes $(awk -v t="$none" -v hz="$hz" 'BEGIN{printf "%.2f", t / hz}'), with 5 $(awk -v t="$five" -v hz="$hz" 'BEGIN{printf "%.2f", t / hz}'); rows (indexes | acked s | × none | indexed s): $rows"
    unset ticks
  done
done
