#!/usr/bin/env bash
# Issue 43, item 1: what checking credentials costs a small get. Runs of a build from before
# users existed (BASE: every call served unchecked) and of this one (NEW: every call carries
# Basic credentials, verified once with argon2id, then found in the credential cache) take
# turns, run by run: 200 connections of gets of a 195-byte document (`shoal bench kv --op
# get`) and seed 001's regular get (`shoal bench subdoc --mode regular`). The client is NEW's
# in both (it sends the header to BASE too, which ignores it), so the ratio is the server's
# cost. On a machine of 2 or more cores the server runs on the last core and the client on
# the others (taskset; PIN=0 turns that off), so the client's share of the cores does not move
# with the server's. Besides throughput, each run reads the server's CPU time (utime + stime
# of /proc/PID/stat) around each bench: CPU microseconds per get is the cost itself, and
# varies less than throughput. Prints each run, then the medians and NEW / BASE.
# Usage: bench/auth_cost.sh RUNS BASE NEW
set -euo pipefail
runs=$1
base=$2
new=$3
port=${PORT:-7075}
url="http://127.0.0.1:$port"
export SHOAL_ADMIN_PASSWORD=bench-admin-password SHOAL_USER=admin SHOAL_PASSWORD=bench-admin-password
echo "date: $(date -u +%FT%TZ)"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); server and client share the cores"
echo "base: $base ($("$base" --version)); new: $new ($("$new" --version))"
cores=$(nproc)
server_cpus=""
client_cpus=""
if [ "${PIN:-1}" = 1 ] && [ "$cores" -ge 2 ]; then
  server_cpus="taskset -c $((cores - 1))"
  client_cpus="taskset -c 0-$((cores - 2))"
  echo "pinned: server on cpu $((cores - 1)), client on cpus 0-$((cores - 2))"
fi
# The server's CPU time so far, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
ticks_per_s=$(getconf CLK_TCK)
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for run in $(seq 1 "$runs"); do
  for label in base new; do
    bin=$base
    [ "$label" = new ] && bin=$new
    dir=$(mktemp -d)
    $server_cpus "$bin" serve --listen "127.0.0.1:$port" --data-path "$dir/data" >"$dir/out" 2>"$dir/err" &
    pid=$!
    for _ in $(seq 1 300); do curl -sf -o /dev/null "$url/v1/health" && break; sleep 0.1; done
    sleep 1
    t0=$(cpu_ticks "$pid")
    kv=$($client_cpus "$new" --url "$url" bench kv --op get --parallel 200 --repeat 1000 --json)
    t1=$(cpu_ticks "$pid")
    sub=$($client_cpus "$new" --url "$url" bench subdoc --mode regular --keys 5 --repeat 1000 --json | grep '"op"' | tail -1)
    t2=$(cpu_ticks "$pid")
    # CPU microseconds per request (the setup's few requests included).
    kv=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); n=r["successes"]+r["errors"]; r["cpu_us_per_op"]=float(sys.argv[2])/float(sys.argv[3])*1e6/n; print(json.dumps(r))' "$kv" "$((t1 - t0))" "$ticks_per_s")
    sub=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); n=r["successes"]+r["errors"]; r["cpu_us_per_op"]=float(sys.argv[2])/float(sys.argv[3])*1e6/n; print(json.dumps(r))' "$sub" "$((t2 - t1))" "$ticks_per_s")
    echo "run $run $label kv: $kv"
    echo "run $run $label subdoc: $sub"
    echo "$label kv $kv" >>"$results"
    echo "$label subdoc $sub" >>"$results"
    kill -TERM "$pid"
    wait "$pid" || true
    rm -rf "$dir"
  done
done
python3 - "$results" <<'EOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    label, bench, body = line.split(" ", 2)
    r = json.loads(body)
    rows.setdefault((bench, label), []).append(r)
for bench in ("kv", "subdoc"):
    med = {}
    for label in ("base", "new"):
        rs = rows.get((bench, label), [])
        med[label] = {k: statistics.median(r[k] for r in rs) for k in ("success_rps", "p50_ms", "p99_ms", "cpu_us_per_op")}
        errors = sum(r["errors"] for r in rs)
        print(f"{bench} {label}: median {med[label]['success_rps']:.0f} gets/s, p50 {med[label]['p50_ms']:.2f} ms, p99 {med[label]['p99_ms']:.2f} ms, server {med[label]['cpu_us_per_op']:.1f} CPU us/get, {errors} errors over {len(rs)} runs")
    print(f"{bench} new/base throughput: {med['new']['success_rps'] / med['base']['success_rps']:.3f}; base/new server CPU per get: {med['base']['cpu_us_per_op'] / med['new']['cpu_us_per_op']:.3f}")
EOF
