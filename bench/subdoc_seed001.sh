#!/usr/bin/env bash
# Seed 001's headline comparison on this machine: regular get of the 195-byte document vs
# 10-path lookups at the end (hard) and start (easy) of the 310 KB document, 200 connections.
# Needs a release build. Usage: bench/subdoc_seed001.sh [runs]
set -euo pipefail
runs=${1:-3}
. "$(dirname "$0")/lib.sh"
bench_start_shoal
for i in $(seq "$runs"); do
  echo "--- run $i"
  for cmd in "--mode regular --keys 5 --repeat 1000" "--difficulty hard --repeat 500" "--difficulty easy --repeat 500"; do
    echo "\$ shoal bench subdoc $cmd"
    # shellcheck disable=SC2086
    "$shoal" bench subdoc $cmd | grep report
  done
done
