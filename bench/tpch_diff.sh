#!/usr/bin/env bash
# TPC-H's 22 queries on Shoal (/v1/query and /v1/analytics) against DuckDB, in one command:
# builds the binary, generates the tables, starts a node on a scratch data directory and a
# free loopback port, runs bench/tpch_diff.py, stops the node. Exits non-zero on any
# difference.
#
#   bench/tpch_diff.sh                 # SF 0.01, release build
#   bench/tpch_diff.sh --sf 0.1        # a larger scale factor
#   bench/tpch_diff.sh --debug         # a debug build (quicker to build, slower to run)
#   bench/tpch_diff.sh --nodes 3       # on a cluster of 3 local nodes (rebalanced), asked through the first
#   SHOAL_BIN=path/to/shoal bench/tpch_diff.sh   # no build: use this binary
#
# Other arguments go to tpch_diff.py (e.g. `--only 6,15`). Needs python3 and
# `pip install duckdb`.
set -euo pipefail
# The nodes started here give their admin this password; the CLI, curl and tpch_diff.py
# call with it.
export SHOAL_ADMIN_PASSWORD=${SHOAL_ADMIN_PASSWORD:-bench-admin-password}
export SHOAL_USER=admin SHOAL_PASSWORD=$SHOAL_ADMIN_PASSWORD
curl() { command curl -u "admin:$SHOAL_ADMIN_PASSWORD" "$@"; }
cd "$(dirname "$0")/.."

sf=0.01
nodes=1
profile=release
passthrough=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sf) sf=$2; shift 2 ;;
    --debug) profile=debug; shift ;;
    --nodes) nodes=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) passthrough+=("$1"); shift ;;
  esac
done

if ! python3 -c 'import duckdb' 2>/dev/null; then
  echo "error: DuckDB is missing; install it with: pip install duckdb" >&2
  exit 2
fi

# One shared target directory for everyone building on this machine (see README).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shoal-target}"
if [ -n "${SHOAL_BIN:-}" ]; then
  shoal=$SHOAL_BIN
else
  if [ "$profile" = release ]; then cargo build --release -p shoal; else cargo build -p shoal; fi
  shoal=$CARGO_TARGET_DIR/$profile/shoal
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in ${pids[@]+"${pids[@]}"}; do kill "$pid" 2>/dev/null || true; done
  # Let the nodes flush and exit before their data directories go.
  for pid in ${pids[@]+"${pids[@]}"}; do while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done; done
  rm -rf "$work"
}
trap cleanup EXIT

echo "date: $(date -u +%FT%TZ); machine: $(nproc) cores; $("$shoal" --version); TPC-H SF $sf; $nodes node(s) (all on these cores)"
"$shoal" bench tpch-gen --sf "$sf" --out "$work/tpch"

# Starts node $1 (port 0: it picks a free port and prints its address on stdout).
start() {
  local i=$1; shift
  "$shoal" serve --listen 127.0.0.1:0 --data-path "$work/data$i" "$@" >"$work/out$i" 2>"$work/err$i" &
  pids+=($!)
  local u=
  for _ in $(seq 1 300); do
    u=$(sed -n 's/^shoal listening on \(http:[^ ]*\)$/\1/p' "$work/out$i")
    [ -n "$u" ] && break
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then
      echo "error: node $i exited:" >&2
      cat "$work/err$i" >&2
      exit 2
    fi
    sleep 0.1
  done
  if [ -z "$u" ]; then
    echo "error: node $i did not start within 30 s" >&2
    exit 2
  fi
  urls+=("$u")
}
urls=()
if [ "$nodes" -le 1 ]; then
  start 0
else
  secret=tpch-diff-$$
  start 0 --cluster-secret "$secret"
  for i in $(seq 1 $((nodes - 1))); do start "$i" --cluster-secret "$secret" --join "${urls[0]#http://}"; done
  field() { python3 -c "import json, sys; print($1)"; }
  for _ in $(seq 1 150); do
    [ "$(curl -s "${urls[0]}/v1/cluster" | field 'len(json.load(sys.stdin)["nodes"])')" -ge "$nodes" ] && break
    sleep 0.2
  done
  # Partitions spread over every node before the tables are loaded.
  curl -sf -XPOST "${urls[0]}/v1/cluster/rebalance" -d '{}' >/dev/null
  for _ in $(seq 1 600); do
    [ "$(curl -s "${urls[0]}/v1/cluster/rebalance" | field 'json.load(sys.stdin)["state"]')" = done ] && break
    sleep 0.2
  done
  echo "rebalance: $(curl -s "${urls[0]}/v1/cluster/rebalance" | field 'json.load(sys.stdin)["state"]')"
fi
url=${urls[0]}
echo "node(s): ${urls[*]}"

python3 bench/tpch_diff.py --url "$url" --data "$work/tpch" ${passthrough[@]+"${passthrough[@]}"}
