#!/usr/bin/env python3
"""Differential test of Shoal's SQL answers: TPC-H's 22 queries on Shoal and on DuckDB.

The eight tables `shoal bench tpch-gen` writes (NDJSON lines of {"key", "value"}) are
loaded into a running Shoal node, one collection per table, through `_bulk`; then every
query in bench/tpch/qNN.sql runs on `/v1/query` (documents), on `/v1/analytics` (the
columnar shadow) and in DuckDB on the same files, and the answers are compared: the same
row count, rows in the same order where the query has an ORDER BY (otherwise both sorted),
numbers equal within a relative 1e-9 (summation order differs between engines), strings and
dates as text. Prints a table and every difference; exits 1 on any difference or error.

DuckDB is the reference: it reads the same JSON with its own type detection (decimal
columns become DOUBLE, "YYYY-MM-DD" strings DATE) and parses SQL literals such as 0.06 as
exact decimals. Needs `pip install duckdb`.

Usage: bench/tpch_diff.py --data DIR [--url http://127.0.0.1:7070] [--only 6,15]
(`bench/tpch_diff.sh` builds, generates, starts a node and runs this in one command.)
"""
import argparse
import base64
import datetime
import decimal
import json
import math
import os
import pathlib
import re
import sys
import time
import urllib.error
import urllib.request

try:
    import duckdb
except ImportError:
    print("error: DuckDB is missing; install it with: pip install duckdb", file=sys.stderr)
    sys.exit(2)

TABLES = ["region", "nation", "part", "supplier", "partsupp", "customer", "orders", "lineitem"]
QUERIES = 22
# Numbers agree when |a - b| <= REL_TOL * max(|a|, |b|): the engines sum floats in different
# orders, which moves the last few of a double's ~16 significant digits, never the 9th.
REL_TOL = 1e-9
# `_bulk` takes bodies up to 256 MiB; smaller bodies keep the client's memory flat and let
# the server start applying sooner.
BULK_BODY_BYTES = 32 * 1024 * 1024
# Generous: a debug build at a larger scale factor is slow, and the point is the answer.
QUERY_TIMEOUT_MS = 600_000
HTTP_TIMEOUT_S = QUERY_TIMEOUT_MS / 1000 + 60
# Rows of a differing answer printed in full.
SHOWN_DIFFS = 5


class ShoalError(Exception):
    """A Shoal request answered an error (its status and body) or could not be sent."""


def request(url, method="GET", body=None, content_type="application/json"):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    # The node's credentials, as the CLI takes them (bench/tpch_diff.sh sets them).
    user, password = os.environ.get("SHOAL_USER"), os.environ.get("SHOAL_PASSWORD")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    if data is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise ShoalError(f"{method} {url}: {e}") from e


def sql(base, endpoint, text):
    status, raw = request(f"{base}/v1/{endpoint}", "POST", {"sql": text, "consistency": "request_plus", "timeout_ms": QUERY_TIMEOUT_MS})
    if status != 200:
        raise ShoalError(f"HTTP {status}: {raw.decode(errors='replace')[:500]}")
    return json.loads(raw)


def load_collection(base, table, path):
    """Drops and creates the collection, then upserts every line of the file; returns the row count."""
    status, raw = request(f"{base}/v1/collections/{table}", "DELETE")
    if status not in (200, 204, 404):
        raise ShoalError(f"dropping {table}: HTTP {status} {raw[:300]!r}")
    status, raw = request(f"{base}/v1/collections/{table}", "PUT")
    if status not in (200, 201):
        raise ShoalError(f"creating {table}: HTTP {status} {raw[:300]!r}")
    rows = errors = 0
    first_error = None

    def send(chunk):
        nonlocal errors, first_error
        status, raw = request(f"{base}/v1/collections/{table}/_bulk", "POST", b"".join(chunk), "application/x-ndjson")
        if status != 200:
            raise ShoalError(f"_bulk into {table}: HTTP {status} {raw[:300]!r}")
        for line in raw.splitlines():
            if line.strip() and b'"error"' in line:
                errors += 1
                first_error = first_error or line[:300]

    chunk, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if not line.startswith(b"{"):
                raise ShoalError(f"{path}: a line is not a JSON object: {line[:80]!r}")
            # {"key":..,"value":..} becomes {"op":"upsert","key":..,"value":..} without a JSON
            # round trip, so numbers reach Shoal with the generator's exact decimal text.
            out = b'{"op":"upsert",' + line[1:] + b"\n"
            chunk.append(out)
            size += len(out)
            rows += 1
            if size >= BULK_BODY_BYTES:
                send(chunk)
                chunk, size = [], 0
    if chunk:
        send(chunk)
    if errors:
        raise ShoalError(f"_bulk into {table}: {errors} lines failed, first: {first_error!r}")
    return rows


def normalize(v):
    """DuckDB's Python values as Shoal's JSON has them: dates as text, decimals as floats."""
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    return v


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def same_value(a, b):
    if is_number(a) and is_number(b):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        a, b = float(a), float(b)
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(a - b) <= REL_TOL * max(abs(a), abs(b))
    return a == b


def sort_key(row):
    # None first, then numbers, then text: a total order over the kinds an answer holds.
    return [(0, 0) if v is None else (1, float(v)) if is_number(v) else (2, str(v)) for v in row]


def ordered(text):
    """Whether the query's answer has an order (an ORDER BY outside comments)."""
    code = re.sub(r"--[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    return re.search(r"\border\s+by\b", code, re.I) is not None


def compare(expected, got, keep_order):
    """Differences between DuckDB's rows and Shoal's, as lines of text (empty: the same)."""
    if len(expected) != len(got):
        return [f"{len(got)} rows, expected {len(expected)}"] + show_rows(expected, got)
    exp, act = (expected, got) if keep_order else (sorted(expected, key=sort_key), sorted(got, key=sort_key))
    diffs = []
    for i, (e, g) in enumerate(zip(exp, act)):
        if len(e) != len(g):
            diffs.append(f"row {i}: {len(g)} columns, expected {len(e)}")
            continue
        for c, (x, y) in enumerate(zip(e, g)):
            if not same_value(x, y):
                diffs.append(f"row {i} column {c}: got {y!r}, expected {x!r}" + (f" (relative difference {rel(x, y):.3g})" if is_number(x) and is_number(y) else ""))
    if diffs and keep_order and not compare(expected, got, False):
        diffs.insert(0, "the same rows in another order")
    return diffs


def rel(x, y):
    x, y = float(x), float(y)
    return abs(x - y) / max(abs(x), abs(y), sys.float_info.min)


def show_rows(expected, got):
    """The first rows that one answer has and the other lacks (by sorted value)."""
    def keyed(rows):
        return {json.dumps([round(v, 6) if isinstance(v, float) else v for v in r], default=str): r for r in rows}
    e, g = keyed(expected), keyed(got)
    lines = [f"  missing: {e[k]}" for k in list(e.keys() - g.keys())[:SHOWN_DIFFS]]
    lines += [f"  extra:   {g[k]}" for k in list(g.keys() - e.keys())[:SHOWN_DIFFS]]
    return lines


def duckdb_tables(con, data):
    for t in TABLES:
        path = pathlib.Path(data) / f"{t}.ndjson"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (run `shoal bench tpch-gen --out {data}`)")
        con.execute(f"CREATE TABLE {t} AS SELECT unnest(value) FROM read_json(?, format = 'newline_delimited')", [str(path)])


def timed(f):
    start = time.perf_counter()
    try:
        return f(), time.perf_counter() - start, None
    except (ShoalError, duckdb.Error) as e:
        return None, time.perf_counter() - start, str(e)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:7070", help="a running Shoal node")
    p.add_argument("--data", required=True, help="the directory `shoal bench tpch-gen` wrote")
    p.add_argument("--queries", default=str(pathlib.Path(__file__).parent / "tpch"), help="directory of q01.sql … q22.sql")
    p.add_argument("--only", default="", help="comma-separated query numbers (default: all 22)")
    p.add_argument("--no-load", action="store_true", help="the collections are already loaded")
    a = p.parse_args()
    base = a.url.rstrip("/")
    numbers = [int(n) for n in a.only.split(",") if n.strip()] or list(range(1, QUERIES + 1))

    con = duckdb.connect()
    t = time.perf_counter()
    duckdb_tables(con, a.data)
    print(f"DuckDB {duckdb.__version__}: tables loaded in {time.perf_counter() - t:.1f}s")

    try:
        if not a.no_load:
            t = time.perf_counter()
            total = 0
            for table in TABLES:
                total += load_collection(base, table, pathlib.Path(a.data) / f"{table}.ndjson")
            print(f"Shoal: {total} documents loaded through _bulk in {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        for table in TABLES:
            want = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for endpoint in ("query", "analytics"):
                have = sql(base, endpoint, f"SELECT count(*) FROM {table}")["rows"][0][0]
                if have != want:
                    raise ShoalError(f"{table}: /v1/{endpoint} counts {have} rows, the file has {want}")
        print(f"Shoal: /v1/query and /v1/analytics see every row ({time.perf_counter() - t:.1f}s)")
    except ShoalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    results, details = [], []
    for n in numbers:
        path = pathlib.Path(a.queries) / f"q{n:02}.sql"
        text = path.read_text()
        keep_order = ordered(text)
        expected, t_duck, duck_err = timed(lambda: [[normalize(v) for v in r] for r in con.execute(text).fetchall()])
        row = {"q": f"q{n:02}", "rows": "-" if expected is None else len(expected), "duck": t_duck}
        if duck_err:
            details.append(f"q{n:02} DuckDB failed (the query text is wrong for the reference): {duck_err}")
        for endpoint in ("query", "analytics"):
            answer, secs, err = timed(lambda: sql(base, endpoint, text))
            row[endpoint + "_s"] = secs
            if err:
                row[endpoint] = "ERROR"
                details.append(f"q{n:02} /v1/{endpoint}: {err}")
            elif expected is None:
                row[endpoint] = "?"
                row[endpoint + "_engine"] = answer.get("metrics", {}).get("engine", "?")
            else:
                row[endpoint + "_engine"] = answer.get("metrics", {}).get("engine", "?")
                diffs = compare(expected, answer["rows"], keep_order)
                row[endpoint] = "ok" if not diffs else f"DIFF ({len(answer['rows'])} rows)"
                if diffs:
                    details.append(f"q{n:02} /v1/{endpoint} differs from DuckDB ({answer.get('columns')}):")
                    details.extend("  " + d for d in diffs[:SHOWN_DIFFS * 4])
                    if len(diffs) > SHOWN_DIFFS * 4:
                        details.append(f"  … {len(diffs) - SHOWN_DIFFS * 4} more differences")
        results.append(row)

    print()
    print("| query | rows | /v1/query | /v1/analytics | /v1/query ms | /v1/analytics ms | DuckDB ms | analytics engine |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['q']} | {r['rows']} | {r['query']} | {r['analytics']} | {r['query_s'] * 1000:.1f} | {r['analytics_s'] * 1000:.1f} | {r['duck'] * 1000:.1f} | {r.get('analytics_engine', '-')} |")
    agree = sum(1 for r in results if r["query"] == "ok" and r["analytics"] == "ok")
    print(f"\n{agree} of {len(results)} queries agree with DuckDB on both endpoints.")
    if details:
        print("\nDifferences:")
        print("\n".join(details))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
