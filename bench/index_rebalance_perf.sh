#!/usr/bin/env bash
# Where a 3 -> 4 node scale-out with 100 indexes spends its CPU, by call stack: runs `shoal
# bench index-rebalance --default-services --data-nodes 3 --methods files --eq-scans 0`,
# records `perf record -a --call-graph dwarf` for SECS seconds from the bench's "the
# rebalance starts" line, and prints each PATTERN's share of all samples (a sample counts
# for the first pattern any frame of its stack matches; idle is the kernel's idle task).
# Needs `perf` (linux-tools). Usage: bench/index_rebalance_perf.sh BIN [SECS] [PATTERN...]
set -euo pipefail
bin=$1
secs=${2:-0.8}
shift $(( $# >= 2 ? 2 : 1 ))
[ $# -gt 0 ] || set -- import_group 'send_export|export_parts' 'stream::apply' 'serve_one' 'flush' 'compact'
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$bin" bench index-rebalance --default-services --data-nodes 3 --methods files --eq-scans 0 >"$dir/bench.log" 2>&1 &
bench=$!
until grep -q "the rebalance starts" "$dir/bench.log"; do sleep 0.02; kill -0 "$bench" 2>/dev/null || { cat "$dir/bench.log"; exit 1; }; done
perf record -a -F 1999 --call-graph dwarf,16384 -o "$dir/perf.data" -- sleep "$secs" >/dev/null 2>&1
wait "$bench"
grep -E "^\| files|rebalance starts" "$dir/bench.log"
perf script -i "$dir/perf.data" -F comm,ip,sym --no-inline 2>/dev/null >"$dir/stacks.txt"
python3 - "$dir/stacks.txt" "$@" <<'PY'
import re, sys
path, pats = sys.argv[1], [re.compile(p) for p in sys.argv[2:]]
samples, cur = [], None
for line in open(path):
    if not line.strip():
        if cur is not None:
            samples.append(cur)
        cur = None
    elif not line.startswith('\t'):
        cur = (line.strip(), [])
    elif cur is not None:
        parts = line.strip().split(' ', 1)
        if len(parts) == 2:
            cur[1].append(parts[1])
if cur is not None:
    samples.append(cur)
counts = {'idle': 0, 'other': 0}
for comm, stack in samples:
    if comm == 'swapper':
        counts['idle'] += 1
        continue
    for p in pats:
        if any(p.search(f) for f in stack):
            counts[p.pattern] = counts.get(p.pattern, 0) + 1
            break
    else:
        counts['other'] += 1
total = max(len(samples), 1)
print(f"{len(samples)} samples over the window (all processes, both cores)")
for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    print(f"{100 * n / total:6.2f} %  {name}")
PY
