#!/usr/bin/env bash
# Issue 43, item 1, counted rather than timed: the instructions the server runs per small
# get, with credentials (NEW) and without (BASE, a build from before users existed). On a
# shared VM, throughput (bench/auth_cost.sh) varies ±20 % between runs of one build, more
# than the cost being measured; instructions counted by valgrind's callgrind vary by 0.3 %.
# Each build runs under callgrind; after a warm-up (the credentials verified and cached, the
# collection made, the connections' code paths touched), the counters are zeroed, then
# `shoal bench kv --op get` (20 connections × REPEAT gets of a 195-byte document) and
# `shoal bench subdoc --mode regular` run, each between a zero and a dump. Every thread of
# the server is counted (background work included, which is the same for both builds).
# Prints instructions per get and NEW / BASE.
# Needs valgrind (installed from Debian's package when missing).
# Usage: bench/auth_instructions.sh BASE NEW [REPEAT]
set -euo pipefail
base=$1
new=$2
repeat=${3:-500}
port=${PORT:-7078}
url="http://127.0.0.1:$port"
command -v valgrind >/dev/null || { apt-get install -y valgrind || { apt-get update && apt-get install -y valgrind; }; } >/dev/null
export SHOAL_ADMIN_PASSWORD=bench-admin-password SHOAL_USER=admin SHOAL_PASSWORD=bench-admin-password
echo "date: $(date -u +%FT%TZ)"
echo "machine: $(nproc) cores, $(uname -sr); $(valgrind --version)"
echo "base: $base; new: $new; 20 connections x $repeat gets per bench"
gets=$((20 * repeat))
declare -A per_get
for label in base new; do
  bin=$base
  [ "$label" = new ] && bin=$new
  dir=$(mktemp -d)
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.%p" "$bin" serve --listen "127.0.0.1:$port" --data-path "$dir/data" >"$dir/out" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do curl -sf -o /dev/null "$url/v1/health" && break; sleep 0.5; done
  # Warm-up: collection, document, credentials and both benches' paths.
  "$new" --url "$url" bench kv --op get --parallel 20 --repeat 50 >/dev/null
  "$new" --url "$url" bench subdoc --mode regular --keys 5 --parallel 20 --repeat 50 >/dev/null
  for bench in kv subdoc; do
    callgrind_control --zero "$pid" >/dev/null
    if [ "$bench" = kv ]; then
      "$new" --url "$url" bench kv --op get --parallel 20 --repeat "$repeat" --json >"$dir/$bench.json"
    else
      "$new" --url "$url" bench subdoc --mode regular --keys 5 --parallel 20 --repeat "$repeat" --json | grep '"op"' | tail -1 >"$dir/$bench.json"
    fi
    callgrind_control --dump "$pid" >/dev/null
    sleep 1
    # The newest dump (cg.PID.N, N counting up).
    file=$(ls -v "$dir"/cg.*.* | tail -1)
    total=$(awk '/^summary:/ {print $2}' "$file")
    per_get[$label.$bench]=$((total / gets))
    echo "$label $bench: $total instructions, $((total / gets)) per get, bench: $(cat "$dir/$bench.json")"
  done
  kill -TERM "$pid"
  wait "$pid" || true
  rm -rf "$dir"
done
for bench in kv subdoc; do
  python3 -c "import sys; b, n = int(sys.argv[1]), int(sys.argv[2]); print(f'$bench: base {b} instructions per get, new {n}; base/new {b / n:.3f}')" "${per_get[base.$bench]}" "${per_get[new.$bench]}"
done
