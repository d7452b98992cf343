#!/usr/bin/env bash
# The long cluster fault run (issue 13): NODES real nodes on loopback, ROUNDS faults
# (kill -9, a network partition past the failover timeout, short SIGSTOP, SIGSTOP past the
# failover timeout, a short network partition, in turn), each followed by
# recovery and a rebalance, under concurrent clients doing majority writes, CAS, deletes
# and majority reads; the history is checked by Porcupine. It is the same test as the
# short version in `cargo test` (tests/cluster_faults.rs), with more nodes and faults.
#
#   scripts/cluster-faults.sh [NODES] [ROUNDS] [SEED] [LEADER_EVERY] [TIMEOUT_S]     (default 5 51 11 2 2)
#
# LEADER_EVERY=k makes every k-th fault's victim the metadata leader (0: drawn at random);
# TIMEOUT_S is the auto-failover timeout the cluster runs with (the lowest allowed is 2).
# The nodes run with users and TLS on (members over TLS too); SHOAL_FAULT_TLS=0 runs plain HTTP.
#
# Writes bench/results/<date>-issue13-cluster-faults.md (and the raw history beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${1:-5}
ROUNDS=${2:-51}
SEED=${3:-11}
LEADER_EVERY=${4:-2}
TIMEOUT_S=${5:-2}
OUT=bench/results/$(date +%F)-issue13-cluster-faults-timeout${5:-2}s
mkdir -p bench/results
START=$(date +%s)
SHOAL_FAULT_NODES=$NODES SHOAL_FAULT_ROUNDS=$ROUNDS SHOAL_FAULT_SEED=$SEED SHOAL_FAULT_LEADER_EVERY=$LEADER_EVERY SHOAL_FAULT_TIMEOUT_S=$TIMEOUT_S SHOAL_FAULT_REPORT="$OUT.txt" \
  cargo test --test cluster_faults -- --nocapture 2>"$OUT.log" >/dev/null || { tail -40 "$OUT.log"; exit 1; }
END=$(date +%s)
{
  echo "# Cluster fault run (issue 13)"
  echo
  echo "- command: \`scripts/cluster-faults.sh $NODES $ROUNDS $SEED $LEADER_EVERY $TIMEOUT_S\`"
  echo "- date: $(date -u +%FT%TZ); machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); all $NODES nodes share them (debug build, as \`cargo test\` builds it)"
  echo "- wall time: $((END - START)) s"
  echo "- TLS: $([ "${SHOAL_FAULT_TLS:-1}" = 1 ] && echo "on (clients and members; \`shoal cert\` certificates)" || echo off); users: on"
  echo
  echo "## Result"
  echo
  cat "$OUT.txt"
  echo
  echo "History (NDJSON, one operation per line): \`$(basename "$OUT").txt.history.ndjson\`."
} > "$OUT.md"
rm -f "$OUT.log" "$OUT.txt"
cat "$OUT.md"
