#!/usr/bin/env python3
"""Seed 004's query 3 in DuckDB: the baseline of `shoal bench analytics`.

The same rows `shoal bench tpcds-gen` writes (NDJSON lines of {"key", "value"}) are
1. loaded into DuckDB's own native tables, and 2. read straight from the JSON files,
and query 3 (bench/tpcds_q3.sql) is timed on each with the given number of threads.
Prints one JSON object on stdout. Needs `pip install duckdb`.
"""
import argparse
import json
import pathlib
import sys
import time

try:
    import duckdb
except ImportError:
    print(json.dumps({"error": "duckdb is not installed (pip install duckdb)"}))
    sys.exit(0)

TABLES = ["date_dim", "item", "store_sales"]


def timed(con, sql, runs):
    times, rows = [], None
    for _ in range(runs):
        t = time.perf_counter()
        rows = con.execute(sql).fetchall()
        times.append(time.perf_counter() - t)
    return times, rows


def same(a, b):
    """Same rows, floats equal to 1e-9 relative (summation order differs)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if isinstance(u, float) or isinstance(v, float):
                if abs(u - v) > 1e-9 * max(abs(u), abs(v), 1.0):
                    return False
            elif u != v:
                return False
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, help="directory of the NDJSON files")
    p.add_argument("--query", required=True, help="file with query 3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json-runs", type=int, default=3)
    a = p.parse_args()
    sql = pathlib.Path(a.query).read_text()
    con = duckdb.connect()
    con.execute(f"SET threads = {a.threads}")
    con.execute("CREATE SCHEMA js")
    for t in TABLES:
        path = pathlib.Path(a.dir) / f"{t}.ndjson"
        con.execute(
            f"CREATE VIEW js.{t} AS SELECT unnest(value) FROM read_json('{path}', format = 'newline_delimited')"
        )
    start = time.perf_counter()
    for t in TABLES:
        con.execute(f"CREATE TABLE main.{t} AS SELECT * FROM js.{t}")
    load = time.perf_counter() - start
    native, rows = timed(con, sql, a.runs)
    con.execute("SET search_path = 'js'")
    on_json, json_rows = timed(con, sql, a.json_runs)
    print(json.dumps({
        "version": duckdb.__version__,
        "threads": a.threads,
        "load_s": load,
        "native_s": native,
        "json_s": on_json,
        "rows": len(rows),
        "same_rows_both_ways": same(rows, json_rows),
        "answer": [list(r) for r in rows],
    }))


if __name__ == "__main__":
    main()
