#!/usr/bin/env bash
# Where a 3 -> 4 node scale-out with 100 indexes spends CPU: runs `shoal bench
# index-rebalance --default-services --data-nodes 3 --methods METHOD --eq-scans 0
# --no-writes` and reads every node's CPU time (utime + stime of /proc/PID/stat) when the
# bench says the rebalance starts and when it prints the rebalance's time; the difference
# is each node's CPU over the rebalance (the fourth node is the one that joined). Each
# build given runs in turn, ROUNDS times (alternated, so the machine's drift falls on all).
# Usage: bench/index_rebalance_cpu.sh ROUNDS BIN [BIN...]   (METHOD=files|stream|none)
set -euo pipefail
rounds=$1
shift
method=${METHOD:-files}
hz=$(getconf CLK_TCK)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cpu() { for p in $(pgrep -f " serve --"); do awk -v p="$p" -v hz="$hz" '{print p, ($14+$15)/hz}' "/proc/$p/stat" 2>/dev/null || true; done | sort; }
for r in $(seq "$rounds"); do
    for bin in "$@"; do
        "$bin" bench index-rebalance --default-services --data-nodes 3 --methods "$method" --eq-scans 0 --no-writes >"$log" 2>&1 &
        bench=$!
        until grep -q "the rebalance starts" "$log"; do sleep 0.02; kill -0 "$bench" 2>/dev/null || { cat "$log"; exit 1; }; done
        before=$(cpu)
        until grep -q "^$method: rebalance" "$log"; do sleep 0.02; kill -0 "$bench" 2>/dev/null || { cat "$log"; exit 1; }; done
        after=$(cpu)
        wait "$bench"
        took=$(grep "^$method: rebalance" "$log" | head -1 | awk '{print $3}')
        # By pid, in start order: the last is the node that joined.
        during=$(join <(echo "$before") <(echo "$after") | sort -n | awk '{printf "%s%.2f", (NR>1 ? " " : ""), $3-$2}')
        echo "round $r $bin: rebalance $took s; CPU s per node over it, the joining node last: $during"
    done
done
