#!/usr/bin/env bash
# Does a follower paused for longer than the election timeout depose the metadata leader when
# it resumes? Starts 3 nodes of each binary given (loopback ports 17101-17103, fresh data
# directories), rebalances them, pauses a follower (SIGSTOP) for PAUSE seconds (default 3),
# resumes it (SIGCONT) and asks the first node for 10 s which member leads and whether a
# write succeeds. Prints one line per run: the leader before, the leaders seen after, and
# the writes not answered 200. Needs curl.
# Usage: bench/pause_follower.sh ROUNDS BIN [BIN...]
set -euo pipefail
rounds=$1
shift
export SHOAL_ADMIN_PASSWORD=bench-admin-password
C=(curl -s -m 1 -u "admin:$SHOAL_ADMIN_PASSWORD")
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)" 2> /dev/null || true; }
for r in $(seq "$rounds"); do
  for bin in "$@"; do
    d=$(mktemp -d)
    pids=()
    for port in 17101 17102 17103; do
      join=()
      [ "$port" != 17101 ] && join=(--join 127.0.0.1:17101)
      SHOAL_LOG=warn "$bin" serve --listen "127.0.0.1:$port" --data-path "$d/n$port" --cache-mb 32 \
        --cluster-secret pause-follower-secret --partitions 16 --analytics-partitions 0 "${join[@]}" \
        > "$d/n$port.out" 2> "$d/n$port.err" &
      pids+=($!)
      sleep 1.5
    done
    sleep 3
    u=http://127.0.0.1:17101
    "${C[@]}" -X POST -H 'content-type: application/json' -d '{"eject":[]}' "$u/v1/cluster/rebalance" > /dev/null
    sleep 5
    "${C[@]}" -X PUT "$u/v1/collections/c1" > /dev/null
    leader=$("${C[@]}" "$u/v1/cluster" | json '["leader"]')
    victim=""
    for i in 2 1; do
      id=$("${C[@]}" "http://127.0.0.1:1710$((i + 1))/v1/cluster" | json '["node"]')
      if [ "$id" != "$leader" ]; then victim=${pids[$i]}; fi
    done
    kill -STOP "$victim"
    sleep "${PAUSE:-3}"
    kill -CONT "$victim"
    seen=()
    failed=0
    for i in $(seq 40); do
      seen+=("$("${C[@]}" "$u/v1/cluster" | json '["leader"]')")
      code=$("${C[@]}" -o /dev/null -w "%{http_code}" -X PUT -H 'content-type: application/json' -d '{"a":1}' "$u/v1/collections/c1/docs/k$i" || true)
      [ "$code" = 200 ] || failed=$((failed + 1))
      sleep 0.2
    done
    kill "${pids[@]}" 2> /dev/null || true
    wait "${pids[@]}" 2> /dev/null || true
    rm -rf "$d"
    after=$(printf '%s\n' "${seen[@]}" | sort | uniq -c | tr -s ' ' | tr '\n' ';')
    echo "run $r $bin: leader before $leader; after (count leader):$after writes not 200: $failed of 40"
  done
done
