#!/usr/bin/env bash
# The long differential run of cluster reads (issue 40): the tests of tests/cluster_exact.rs
# — 1 -> 2 -> 3 nodes, a swap and 3 -> 2 under readers, and a kill -9, failover, recovery
# and rebalance under readers, every SQL count, point read, indexed count, index scan and
# analytics count compared with the model of what was written — run ROUNDS times over, each
# round on fresh nodes. The short version is one round, in `cargo test`.
#
#   scripts/cluster-exact.sh [ROUNDS]     (default 10)
#
# Writes bench/results/<date>-issue40-cluster-exact.md (and the log beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-10}
OUT=bench/results/$(date +%F)-issue40-cluster-exact
mkdir -p bench/results
: >"$OUT.log"
START=$(date +%s)
cargo test --test cluster_exact --no-run 2>>"$OUT.log"
for round in $(seq 1 "$ROUNDS"); do
  echo "=== round $round" >>"$OUT.log"
  cargo test --test cluster_exact -- --nocapture --test-threads 1 >>"$OUT.log" 2>&1 || { tail -40 "$OUT.log"; exit 1; }
done
END=$(date +%s)
read -r exact refused wrong < <(grep -o 'reads: [0-9]* exact, [0-9]* refused, [0-9]* wrong' "$OUT.log" |
  awk '{e += $2; r += $4; w += $6} END {print e + 0, r + 0, w + 0}')
runs=$(grep -c 'reads: ' "$OUT.log")
{
  echo "# Cluster reads against a model, long run (issue 40)"
  echo
  echo "- command: \`scripts/cluster-exact.sh $ROUNDS\`"
  echo "- date: $(date -u +%FT%TZ); machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); every node of a run shares them (debug build, as \`cargo test\` builds it)"
  echo "- wall time: $((END - START)) s"
  echo
  echo "## Result"
  echo
  echo "- runs under readers: $runs (each round: nodes added, swapped and removed; a node killed, failed over, recovered and rebalanced in)"
  echo "- reads compared with the model: $((exact + refused + wrong)); exact: $exact; refused with 503: $refused; wrong: $wrong"
  echo "- every run also checks that, once still, every member comes to answer every read exactly (a refusal on the way allowed, never a wrong answer), and that index entries and analytics rows sum to twice the documents (nothing leaked)"
  echo
  echo "Log: \`$(basename "$OUT").log\`."
} >"$OUT.md"
cat "$OUT.md"
