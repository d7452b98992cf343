#!/usr/bin/env bash
# Seed 001's headline comparison on this machine: regular get of the 195-byte document vs
# 10-path lookups at the end (hard) and start (easy) of the 310 KB document, 200 connections.
# Needs a release build. Usage: bench/subdoc_seed001.sh [runs]
set -euo pipefail
runs=${1:-3}
shoal=${SHOAL_BIN:-${CARGO_TARGET_DIR:-target}/release/shoal}
work=$(mktemp -d)
trap 'kill $(cat "$work/pid") 2>/dev/null || true; sleep 1; rm -rf "$work"' EXIT
echo "date: $(date -u +%FT%TZ)"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
"$shoal" serve --listen 127.0.0.1:7070 --data-path "$work/data" >"$work/out" 2>"$work/err" &
echo $! >"$work/pid"
sleep 1
for i in $(seq "$runs"); do
  echo "--- run $i"
  for cmd in "--mode regular --keys 5 --repeat 1000" "--difficulty hard --repeat 500" "--difficulty easy --repeat 500"; do
    echo "\$ shoal bench subdoc $cmd"
    # shellcheck disable=SC2086
    "$shoal" bench subdoc $cmd | grep report
  done
done
