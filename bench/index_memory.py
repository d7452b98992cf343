#!/usr/bin/env python3
"""A node's memory over a bulk load of many indexes, and after it.

One node per build given (64 data partitions, no analytics), each in turn and ROUNDS times
(alternated, so the machine's drift falls on all): INDEXES indexes of 8 partitions over two
of ten small integer fields, then DOCS documents of ~250 bytes through `_bulk` (2,000 per
call, one call at a time). The process's resident memory (`VmRSS` from /proc) is read every
0.5 s from the first write until IDLE seconds after every index answered a `request_plus`
scan; at the end the node's `/metrics` say how many bytes of index memtables it holds
(`shoal_index_memtable_bytes`: not flushed yet; `shoal_index_memtables_held_bytes`: in
memory, flushed ones not let go of included; "-" for a build without them).

Usage: bench/index_memory.py [--docs N] [--indexes N] [--idle S] [--rounds N] BIN [BIN...]
Standard library only. Every node runs on this machine's cores and disk.
"""

import argparse
import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

PASSWORD = "bench-memory-pw"
SLICE = 2000


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Node:
    def __init__(self, binary, partitions=64):
        self.dir = tempfile.mkdtemp(prefix="shoal-index-memory-")
        env = dict(os.environ, SHOAL_ADMIN_PASSWORD=PASSWORD, SHOAL_LOG="warn")
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--data-path", self.dir, "--partitions", str(partitions),
             "--analytics-partitions", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        first = self.proc.stdout.readline().strip()
        prefix = "shoal listening on http://"
        if not first.startswith(prefix):
            self.stop()
            raise SystemExit(f"{binary} said {first!r}")
        self.base = "http://" + first[len(prefix):]
        # The rest of its output is not read; it must not fill the pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.auth = "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()

    def call(self, method, path, body=None, ctype="application/json", timeout=600):
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        req.add_header("Content-Type", ctype)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def must(self, method, path, body=None, ctype="application/json"):
        status, answer = self.call(method, path, body, ctype)
        if status >= 300:
            raise SystemExit(f"{method} {path}: {status} {answer[:300]!r}")
        return answer

    def metric(self, name):
        _, text = self.call("GET", "/metrics")
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def document(i):
    value = {f"f{k}": (i * (2 * k + 1) + k * 7) % 50 for k in range(10)}
    value["pad"] = "x" * 100
    return value


def one_run(binary, args):
    node = Node(binary)
    try:
        node.must("PUT", "/v1/collections/bench")
        for n in range(args.indexes):
            k = n % 10
            keys = [f"f{k}", f"f{(k + 1 + n // 10) % 10}"]
            node.must("POST", "/v1/collections/bench/indexes", {"name": f"i{n:03}", "keys": keys, "partitions": 8})
        samples = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                samples.append((time.monotonic(), rss_mb(node.proc.pid)))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        start = time.monotonic()
        sampler.start()
        for first in range(0, args.docs, SLICE):
            lines = [json.dumps({"op": "upsert", "key": f"doc-{i:08}", "value": document(i)})
                     for i in range(first, min(first + SLICE, args.docs))]
            answer = node.must("POST", "/v1/collections/bench/_bulk", ("\n".join(lines) + "\n").encode(), "application/x-ndjson")
            if b'"error"' in answer:
                raise SystemExit(f"a _bulk item failed: {answer[:300]!r}")
        loaded = time.monotonic() - start
        # Every index answers a request_plus scan once it holds every document written.
        scan = {"consistency": "request_plus", "timeout_ms": 300_000, "limit": 1}
        for n in range(args.indexes):
            node.must("POST", f"/v1/collections/bench/indexes/i{n:03}/scan", scan)
        indexed = time.monotonic() - start
        time.sleep(args.idle)
        stop.set()
        sampler.join()
        end_rss = rss_mb(node.proc.pid)
        peak = max(r for _, r in samples)
        unflushed = node.metric("shoal_index_memtable_bytes")
        held = node.metric("shoal_index_memtables_held_bytes")
        return loaded, indexed, peak, end_rss, unflushed, held
    finally:
        node.stop()


def mb(v):
    return "-" if v is None else f"{v / 1e6:.0f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=60_000)
    p.add_argument("--indexes", type=int, default=100)
    p.add_argument("--idle", type=float, default=20.0, help="seconds watched after every index is ready")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("binaries", nargs="+")
    args = p.parse_args()
    print(f"one node; {args.indexes} indexes of 8 partitions; {args.docs} documents; watched {args.idle:.0f} s after ready")
    print("| round | build | loaded s | indexed s | peak RSS MB | RSS MB at the end | index memtables unflushed MB | held MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        for binary in args.binaries:
            loaded, indexed, peak, end, unflushed, held = one_run(binary, args)
            print(f"| {r} | {binary} | {loaded:.1f} | {indexed:.1f} | {peak:.0f} | {end:.0f} | {mb(unflushed)} | {mb(held)} |",
                  flush=True)


if __name__ == "__main__":
    main()
