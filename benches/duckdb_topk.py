#!/usr/bin/env python3
"""String top-k queries in DuckDB over TPC-H lineitem, as a peer for this crate's operator.

    python3 benches/duckdb_topk.py --data /tmp/tpch-1 [--threads N] [--runs 3] [--json out.json]
    python3 benches/duckdb_topk.py --tweets DIR [--threads N] [--runs 3]

`--tweets DIR`: the per-group top-k queries of `cpu_vs_datafusion --groups` (G1-G3, with and
without a filter) instead, over the tweets in DIR/*.parquet (`gpu-topk gen --out DIR`) loaded
into a DuckDB table; each reports the rows kept and the sum of their ids, which the Rust
benchmark prints too.

`--tweets DIR --sql FILE --json OUT`: the queries FILE lists (a JSON list of [name, sql] over
the table `tweets`, or the table `--table` names: `cpu_vs_datafusion --hits` passes `hits`)
instead, from each of `--sources` (memory: a table loaded from the files;
parquet: a view over them), written to OUT with each result's last column (its sort key),
sorted, as text: `cpu_vs_datafusion --duckdb` runs it this way, in the same run as the other
engines, and checks those values against DataFusion's.

Reads DIR/lineitem/*.parquet (as benches/tpch/generate.py writes them) two ways:
  - parquet: a view over read_parquet(...), so every run scans the files;
  - memory:  a DuckDB table loaded once from them (CREATE TABLE lineitem AS SELECT * ...).

Queries (each for k in 10, 1000, 10000):
  s1  SELECT l_orderkey, l_comment FROM lineitem ORDER BY l_comment LIMIT k
  s2  SELECT l_orderkey, l_extendedprice, l_comment FROM lineitem
        ORDER BY l_extendedprice DESC, l_comment LIMIT k
  s3  SELECT l_orderkey, l_extendedprice FROM lineitem WHERE l_comment LIKE '%special%'
        ORDER BY l_extendedprice DESC LIMIT k
  s4  SELECT l_orderkey, l_comment FROM lineitem WHERE l_quantity < 2
        ORDER BY l_comment DESC LIMIT k

Each (source, query, k) runs once first (cold-ish: the first run of that shape) and then
`--runs` more times; it reports the first time and the median of the rest, in milliseconds,
each timing fetching the whole result (`.fetchall()`). A markdown table comes last; `--json`
also writes the numbers to a file.

Needs: pip install duckdb
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

QUERIES = {
    "s1": "SELECT l_orderkey, l_comment FROM lineitem ORDER BY l_comment LIMIT {k}",
    "s2": "SELECT l_orderkey, l_extendedprice, l_comment FROM lineitem "
    "ORDER BY l_extendedprice DESC, l_comment LIMIT {k}",
    "s3": "SELECT l_orderkey, l_extendedprice FROM lineitem WHERE l_comment LIKE '%special%' "
    "ORDER BY l_extendedprice DESC LIMIT {k}",
    "s4": "SELECT l_orderkey, l_comment FROM lineitem WHERE l_quantity < 2 "
    "ORDER BY l_comment DESC LIMIT {k}",
}
KS = (10, 1000, 10000)


def group_queries():
    """The per-group queries, as benches/cpu_vs_datafusion.rs `group_queries` writes them."""
    shapes = [
        ("G1", "uid", "retweet_count DESC, id", "rn <= 10"),
        ("G2", "lang", "retweet_count DESC, id", "rn <= 3"),
        ("G3", "uid", "tweet_time DESC, id", "rn = 1"),
    ]
    queries = {}
    for where, tag in (("", ""), ("WHERE retweet_count > 0", " filtered")):
        for name, group, order, keep in shapes:
            queries[name + tag] = (
                "SELECT count(*) AS n, sum(id) AS ids FROM (SELECT id, ROW_NUMBER() OVER "
                f"(PARTITION BY {group} ORDER BY {order}) AS rn FROM tweets {where}) WHERE {keep}"
            )
    return queries


def run_groups(duckdb, directory, threads, runs):
    """The per-group queries over the tweets in `directory`, loaded into memory."""
    files = sorted(directory.glob("*.parquet"))
    if not files:
        fail(f"no Parquet files in {directory} (gpu-topk gen --out DIR writes them)")
    con = duckdb.connect()
    con.execute(f"SET threads = {int(threads)}")
    pattern = str(directory / "*.parquet").replace("'", "''")
    start = time.perf_counter()
    con.execute(f"CREATE TABLE tweets AS SELECT * FROM read_parquet('{pattern}')")
    total = con.execute("SELECT count(*) FROM tweets").fetchone()[0]
    print(
        f"memory: loaded {total} tweets in {time.perf_counter() - start:.1f} s, threads={threads}",
        flush=True,
    )
    print("| query | rows kept | sum of ids | first ms | median ms |")
    print("|---|---:|---:|---:|---:|")
    for name, sql in group_queries().items():
        start = time.perf_counter()
        n, ids = con.execute(sql).fetchone()
        first = (time.perf_counter() - start) * 1000.0
        median = statistics.median(timed(con, sql)[0] for _ in range(runs))
        print(f"| {name} | {n} | {ids} | {first:.1f} | {median:.1f} |", flush=True)
    con.close()
SOURCES = ("memory", "parquet")


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def key_text(value):
    """A result value as the Rust benchmark prints it: integers wrapped to 64 bits (DataFusion
    sums Int64 with wrapping), floats with a fractional part, timestamps in ISO 8601."""
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else ""
    if isinstance(value, int):
        return str((value + 2**63) % 2**64 - 2**63)
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    return str(value)


def run_sql_file(duckdb, directory, sql_file, sources, threads, runs, out, table="tweets"):
    """The named queries of `sql_file` over the table `table` (by default the tweets) of the
    Parquet files in `directory` (see the module doc)."""
    files = sorted(directory.glob("*.parquet"))
    if not files:
        fail(f"no Parquet files in {directory}")
    queries = json.loads(sql_file.read_text())
    pattern = str(directory / "*.parquet").replace("'", "''")
    results = []
    for source in sources:
        con = duckdb.connect()
        con.execute(f"SET threads = {int(threads)}")
        start = time.perf_counter()
        kind = "TABLE" if source == "memory" else "VIEW"
        con.execute(f"CREATE {kind} {table} AS SELECT * FROM read_parquet('{pattern}')")
        total = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        print(
            f"{source}: {total} rows of {table} ready in {time.perf_counter() - start:.1f} s, "
            f"threads={threads}",
            flush=True,
        )
        for name, sql in queries:
            start = time.perf_counter()
            rows = con.execute(sql).fetchall()
            first = (time.perf_counter() - start) * 1000.0
            times = [timed(con, sql)[0] for _ in range(runs)]
            keys = sorted(key_text(row[-1]) for row in rows)
            results.append(
                {
                    "source": source,
                    "name": name,
                    "first_ms": first,
                    "median_ms": statistics.median(times),
                    "keys": keys,
                }
            )
            print(
                f"{source} {name}: {len(rows)} rows, first {first:.1f} ms, "
                f"median {statistics.median(times):.1f} ms",
                flush=True,
            )
        con.close()
    out.write_text(json.dumps({"duckdb": duckdb.__version__, "results": results}))


def timed(con, sql):
    """Milliseconds to run `sql` and fetch its whole result, and the number of rows."""
    start = time.perf_counter()
    rows = con.execute(sql).fetchall()
    return (time.perf_counter() - start) * 1000.0, len(rows)


def connect(duckdb, source, files, threads):
    con = duckdb.connect()
    con.execute(f"SET threads = {int(threads)}")
    scan = f"read_parquet('{files.replace(chr(39), chr(39) * 2)}')"
    if source == "memory":
        start = time.perf_counter()
        con.execute(f"CREATE TABLE lineitem AS SELECT * FROM {scan}")
        print(f"memory: loaded lineitem in {time.perf_counter() - start:.1f} s", flush=True)
    else:
        con.execute(f"CREATE VIEW lineitem AS SELECT * FROM {scan}")
    return con


def main():
    parser = argparse.ArgumentParser(description="String top-k queries in DuckDB over lineitem.")
    parser.add_argument("--data", type=Path, help="directory with lineitem/*.parquet")
    parser.add_argument(
        "--tweets", type=Path, help="directory of tweets Parquet files: the per-group queries"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="DuckDB threads (default: all cores)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs after the first (default 3)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.add_argument(
        "--sql", type=Path, help="with --tweets: a JSON list of [name, sql] to run instead"
    )
    parser.add_argument(
        "--table", default="tweets", help="with --sql: the table the queries read (default tweets)"
    )
    parser.add_argument(
        "--sources", default=",".join(SOURCES), help="comma-separated: memory, parquet (default both)"
    )
    parser.add_argument(
        "--queries", default=",".join(QUERIES), help="comma-separated subset of s1..s4 (default all)"
    )
    parser.add_argument(
        "--k", default=",".join(map(str, KS)), help="comma-separated k values (default 10,1000,10000)"
    )
    args = parser.parse_args()
    if args.runs < 1:
        fail("--runs must be at least 1")
    if (args.data is None) == (args.tweets is None):
        fail("give one of --data (lineitem) and --tweets (the per-group queries)")
    sources = [s for s in args.sources.split(",") if s]
    queries = [q for q in args.queries.split(",") if q]
    ks = [int(k) for k in args.k.split(",") if k]
    if not (sources and queries and ks):
        fail("--sources, --queries and --k must each name at least one")
    for s in sources:
        if s not in SOURCES:
            fail(f"unknown source {s!r}: expected memory or parquet")
    for q in queries:
        if q not in QUERIES:
            fail(f"unknown query {q!r}: expected one of {', '.join(QUERIES)}")

    try:
        import duckdb
    except ImportError:
        fail("the duckdb Python package is missing; install it with: pip install duckdb")
    if args.sql is not None:
        if args.tweets is None or args.json is None:
            fail("--sql needs --tweets DIR and --json OUT")
        if not args.table.isidentifier():
            fail(f"--table {args.table!r} is not a plain table name")
        run_sql_file(
            duckdb, args.tweets, args.sql, sources, args.threads, args.runs, args.json, args.table
        )
        return
    if args.tweets is not None:
        run_groups(duckdb, args.tweets, args.threads, args.runs)
        return

    directory = args.data / "lineitem"
    if not sorted(directory.glob("*.parquet")):
        fail(f"no Parquet files in {directory} (benches/tpch/generate.py writes them)")
    files = str(directory / "*.parquet")

    results = []
    for source in sources:
        con = connect(duckdb, source, files, args.threads)
        total = con.execute("SELECT count(*) FROM lineitem").fetchone()[0]
        print(f"{source}: lineitem has {total} rows, threads={args.threads}", flush=True)
        for name in queries:
            for k in ks:
                sql = QUERIES[name].format(k=k)
                first, rows = timed(con, sql)
                times = [timed(con, sql)[0] for _ in range(args.runs)]
                median = statistics.median(times)
                results.append(
                    {
                        "source": source,
                        "query": name,
                        "k": k,
                        "rows": rows,
                        "first_ms": first,
                        "median_ms": median,
                        "runs_ms": times,
                        "sql": sql,
                    }
                )
                print(
                    f"{source} {name} k={k}: {rows} rows, first {first:.1f} ms, "
                    f"median {median:.1f} ms",
                    flush=True,
                )
        con.close()

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "engine": "duckdb",
                    "duckdb_version": duckdb.__version__,
                    "threads": args.threads,
                    "runs": args.runs,
                    "data": str(args.data),
                    "lineitem_rows": total,
                    "results": results,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.json}")

    print()
    print("| source | query | k | first ms | median ms |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['source']} | {r['query']} | {r['k']} | {r['first_ms']:.1f} | "
            f"{r['median_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
