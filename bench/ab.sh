#!/usr/bin/env bash
# Several builds of shoal side by side in one run: issue 2's key/value figures
# (bench/kv_vs_redis.sh, with Redis), seed 001's sub-document figures
# (bench/subdoc_seed001.sh) and issue 5's SQL point query (`shoal bench query-point`), for
# each binary in turn, twice over, so that a change of code or build profile is judged by
# what it does to request speed on the same machine in the same hour.
# Usage: bench/ab.sh RUNS BINARY... (RUNS per script per binary per round)
set -euo pipefail
runs=$1
shift
here=$(dirname "$0")
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for round in 1 2; do
  for bin in "$@"; do
    echo "=== round $round, binary $bin"
    SHOAL_BIN=$bin "$here/kv_vs_redis.sh" "$runs" | grep -v '^\$'
    SHOAL_BIN=$bin "$here/subdoc_seed001.sh" "$runs" | grep -E 'report|---'
    "$bin" bench query-point --out-dir "$scratch" | tail -3
  done
done
