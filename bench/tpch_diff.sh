#!/usr/bin/env bash
# TPC-H's 22 queries on Shoal (/v1/query and /v1/analytics) against DuckDB, in one command:
# builds the binary, generates the tables, starts a node on a scratch data directory and a
# free loopback port, runs bench/tpch_diff.py, stops the node. Exits non-zero on any
# difference.
#
#   bench/tpch_diff.sh                 # SF 0.01, release build
#   bench/tpch_diff.sh --sf 0.1        # a larger scale factor
#   bench/tpch_diff.sh --debug         # a debug build (quicker to build, slower to run)
#   SHOAL_BIN=path/to/shoal bench/tpch_diff.sh   # no build: use this binary
#
# Other arguments go to tpch_diff.py (e.g. `--only 6,15`). Needs python3 and
# `pip install duckdb`.
set -euo pipefail
cd "$(dirname "$0")/.."

sf=0.01
profile=release
passthrough=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sf) sf=$2; shift 2 ;;
    --debug) profile=debug; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
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
pid=
cleanup() {
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    # Let the node flush and exit before its data directory goes.
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "date: $(date -u +%FT%TZ); machine: $(nproc) cores; $("$shoal" --version); TPC-H SF $sf"
"$shoal" bench tpch-gen --sf "$sf" --out "$work/tpch"

# Port 0: the node picks a free port and prints its address on stdout.
"$shoal" serve --listen 127.0.0.1:0 --data-path "$work/data" >"$work/out" 2>"$work/err" &
pid=$!
url=
for _ in $(seq 1 300); do
  url=$(sed -n 's/^shoal listening on \(http:[^ ]*\)$/\1/p' "$work/out")
  [ -n "$url" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "error: the node exited:" >&2
    cat "$work/err" >&2
    exit 2
  fi
  sleep 0.1
done
if [ -z "$url" ]; then
  echo "error: the node did not start within 30 s" >&2
  exit 2
fi
echo "node: $url"

python3 bench/tpch_diff.py --url "$url" --data "$work/tpch" ${passthrough[@]+"${passthrough[@]}"}
