#!/usr/bin/env python3
"""The user's path: fresh `gpu-topk` processes with the default settings over tables made the
user's way, against DataFusion and DuckDB on the same rows.

    python3 benches/user_path.py --cli PATH/gpu-topk [--rows 100000000] [--tpch DIR --sf 10]
        [--runs 3] [--duckdb] [--only first,tweets,groups,copy,strings,parquet] [--json OUT]

Each *session* below is one fresh process per engine: it makes its table, then runs each of
its queries once (*first*) and `--runs` more times (*repeat*: the median; *2nd*: the first
repeat). Times are the CLI's own `Elapsed` per statement (planning, execution and printing
the result), or DuckDB's `execute(...).fetchall()`.

Engines:
- *auto*: `gpu-topk` with no option: the default settings, the device not started, the
  kernel cache as a user's (one directory for the whole benchmark, filled by earlier
  processes; the very first process of the benchmark finds it empty, see below);
- *cuda* (a diagnostic, tweets and groups only): `--backend cuda`, the same process shape;
- *DataFusion*: `gpu-topk` with `SET gpu_topk.enabled = false` first: DataFusion's own plan;
- *DuckDB* (`--duckdb`, PyPI `duckdb`): a connection per session, the table loaded from the
  same rows' Parquet files into DuckDB's memory.

Sessions:
- *tweets*: the CLI's `tweets` table (generated in memory, `--rows`), one process per
  query of Q1-Q3;
- *groups*: the same table, one process per per-group shape;
- *copy*: Q1-Q3 over `CREATE TABLE tweets_copy AS SELECT * FROM tweets`, then over the
  CLI's table (a `GpuTable`), in one process: a table made by SQL must be read as fast;
- *strings*: TPC-H `lineitem` (`--tpch DIR`, written by `benches/tpch/generate.py` when DIR
  has none) made by `CREATE TABLE lineitem AS SELECT * FROM` its Parquet files, one process
  for the string queries;
- *parquet*: the same queries over the files as an external table;
- or, with `--synthetic-lineitem ROWS`, *strings* over `lineitem`'s columns made by SQL from
  a row number (the same expressions in DuckDB), where TPC-H data cannot be generated.

Before the sessions, the *first GPU query*: `--backend cuda` runs Q1 in a process whose kernel
cache directory is empty (a new machine), then again with the cache that run filled.

Every result is checked against DataFusion's: the per-group queries return the number of
rows kept and the sum of their ids (their order keys end in the unique id, so both are
exact), the others their sort keys (compared as values). DuckDB's per-group results are
checked the same way. The markdown table comes last; `--json` writes every figure.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (name, SQL, number of trailing columns that are the sort keys: 0 compares the whole row)
TWEETS = [
    (
        "Q1",
        "SELECT id, retweet_count FROM tweets WHERE tweet_time < '2017-05-04' "
        "ORDER BY retweet_count DESC LIMIT 50",
        1,
    ),
    (
        "Q2",
        "SELECT id, retweet_count + 0.5 * likes_count AS score FROM tweets "
        "ORDER BY retweet_count + 0.5 * likes_count DESC LIMIT 50",
        1,
    ),
    (
        "Q3",
        "SELECT id, retweet_count FROM tweets WHERE lang = 'en' OR lang = 'es' "
        "ORDER BY retweet_count DESC LIMIT 50",
        1,
    ),
]


def per_group(window, keep, where=""):
    return (
        f"SELECT count(*) AS n, sum(id) AS ids FROM (SELECT id, {window} AS rn "
        f"FROM tweets {where}) WHERE {keep}"
    )


GROUPS = [
    (
        "top 10 per user",
        per_group("ROW_NUMBER() OVER (PARTITION BY uid ORDER BY retweet_count DESC, id)", "rn <= 10"),
        0,
    ),
    (
        "top 3 per language",
        per_group("ROW_NUMBER() OVER (PARTITION BY lang ORDER BY retweet_count DESC, id)", "rn <= 3"),
        0,
    ),
    (
        "latest per user",
        per_group("ROW_NUMBER() OVER (PARTITION BY uid ORDER BY tweet_time DESC, id)", "rn = 1"),
        0,
    ),
    (
        "RANK per language",
        per_group("RANK() OVER (PARTITION BY lang ORDER BY likes_count DESC)", "rn <= 5"),
        0,
    ),
    (
        "DENSE_RANK per (language, user bucket)",
        per_group(
            "DENSE_RANK() OVER (PARTITION BY lang, uid % 64 ORDER BY retweet_count DESC)", "rn <= 2"
        ),
        0,
    ),
    (
        "QUALIFY 2 per user",
        "SELECT count(*) AS n, sum(id) AS ids FROM (SELECT id FROM tweets QUALIFY "
        "ROW_NUMBER() OVER (PARTITION BY uid ORDER BY likes_count DESC, id) <= 2)",
        0,
    ),
    (
        "2 per user, outer top 100",
        "SELECT id, uid, retweet_count FROM (SELECT id, uid, retweet_count, ROW_NUMBER() OVER "
        "(PARTITION BY uid ORDER BY retweet_count DESC, id) AS rn FROM tweets) WHERE rn <= 2 "
        "ORDER BY retweet_count DESC, id LIMIT 100",
        0,
    ),
]

STRINGS = [
    ("S1 l_comment", "SELECT l_orderkey, l_comment FROM lineitem ORDER BY l_comment LIMIT 10", 1),
    (
        "S2 price, comment",
        "SELECT l_orderkey, l_extendedprice, l_comment FROM lineitem "
        "ORDER BY l_extendedprice DESC, l_comment LIMIT 10",
        2,
    ),
    (
        "S3 LIKE filter",
        "SELECT l_orderkey, l_extendedprice FROM lineitem WHERE l_comment LIKE '%special%' "
        "ORDER BY l_extendedprice DESC LIMIT 10",
        1,
    ),
    (
        "S4 filter, comment DESC",
        "SELECT l_orderkey, l_comment FROM lineitem WHERE l_quantity < 2 "
        "ORDER BY l_comment DESC LIMIT 10",
        1,
    ),
    (
        "T1 long ties",
        "SELECT l_shipmode, l_shipinstruct, l_orderkey, l_linenumber FROM lineitem "
        "ORDER BY l_shipinstruct DESC, l_shipmode, l_orderkey, l_linenumber LIMIT 100",
        0,
    ),
]

ELAPSED = re.compile(r"^Elapsed ([0-9.]+) seconds\.$")
FETCHED = re.compile(r"^\d+ row(\(s\)|s)? fetched\.")


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def sql_text(s):
    return s.replace("'", "''")


def cli_session(args, session, engine, setup, queries, cache_dir, extra_env=None):
    """One fresh `gpu-topk` process: `setup` statements, then each query 1 + runs times.
    Returns {query name: (times in ms, result rows of the first run)} and the wall time."""
    statements = []
    if engine == "datafusion":
        statements.append("SET gpu_topk.enabled = false")
    statements += setup
    plan = []
    for name, sql, _ in queries:
        for run in range(1 + args.runs):
            statements.append(sql)
            plan.append((name, run))
    command = [str(args.cli), "--rows", str(args.rows), "--format", "csv"]
    if engine == "cuda":
        command += ["--backend", "cuda"]
    for s in statements:
        command += ["-c", s]
    env = dict(os.environ, GPU_TOPK_CACHE_DIR=str(cache_dir))
    env.update(extra_env or {})
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=args.workdir)
    wall = time.perf_counter() - started
    log = args.logs / re.sub(r"[^A-Za-z0-9.]+", "-", f"{engine} {session} {queries[0][0]}.log")
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        fail(f"{engine}: gpu-topk exited with {done.returncode}; see {log}")
    # Each statement's output ends with its `Elapsed` line; the banner comes before the first.
    outputs, lines = [], []
    for line in done.stdout.splitlines():
        m = ELAPSED.match(line.strip())
        if m:
            outputs.append((float(m.group(1)) * 1000.0, lines))
            lines = []
        else:
            lines.append(line)
    if len(outputs) != len(statements):
        fail(f"{engine}: {len(outputs)} statements timed, {len(statements)} run; see {log}")
    outputs = outputs[len(statements) - len(plan):]
    results = {}
    for (name, run), (ms, out) in zip(plan, outputs):
        times, rows = results.setdefault(name, ([], None))
        times.append(ms)
        if run == 0:
            rows = [l for l in out if l.strip() and not FETCHED.match(l.strip())][1:]
            results[name] = (times, rows)
    return results, wall


def key_values(rows, keys):
    """The rows' trailing `keys` columns (every column at 0), parsed as numbers where they
    are, sorted: equal for every correct answer whatever rows a tie let in."""
    import csv

    out = []
    for row in csv.reader(rows):
        cells = row[-keys:] if keys else row
        parsed = []
        for c in cells:
            try:
                parsed.append(float(c))
            except ValueError:
                parsed.append(c)
        out.append(tuple(parsed))
    return sorted(out, key=repr)


def wrapped(value):
    """A DuckDB integer as DataFusion's: sums of Int64 wrap at 64 bits there."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str((value + 2**63) % 2**64 - 2**63)
    return str(value)


def duckdb_connect(load):
    """A DuckDB connection on every core with the table `load` makes (the same rows)."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {os.cpu_count()}")
    for statement in load:
        con.execute(statement)
    return con


def duckdb_session(args, con, queries):
    """Each query once, then `--runs` more times, on a connection kept for its table."""
    results = {}
    for name, sql, _ in queries:
        times, first = [], None
        for run in range(1 + args.runs):
            started = time.perf_counter()
            rows = con.execute(sql).fetchall()
            times.append((time.perf_counter() - started) * 1000.0)
            if run == 0:
                first = rows
        results[name] = (times, first)
    return results


def ensure_tweets_parquet(args):
    directory = args.scratch / f"tweets-{args.rows}"
    if not any(directory.glob("*.parquet")):
        subprocess.run(
            [str(args.cli), "--rows", str(args.rows), "gen", "--out", str(directory)],
            check=True,
            capture_output=True,
        )
    return directory


SHIPINSTRUCT = ("DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN")
SHIPMODE = ("AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK")


def synthetic_lineitem(rows, duckdb):
    """`lineitem`'s columns the string queries read, made by SQL from a row number with the
    same expressions in both engines: TPC-H's ship instructions and modes (so the tie shape
    ties as there), 32-character comments (an MD5), integer keys and prices."""
    def case(values, multiplier):
        arms = " ".join(f"WHEN {n} THEN '{v}'" for n, v in enumerate(values))
        return f"CASE (i * {multiplier}) % {len(values)} {arms} END"

    source = (
        f"(SELECT range AS i FROM range(0, {rows}))" if duckdb
        else f"(SELECT value AS i FROM generate_series(0, {rows - 1}))"
    )
    return (
        "CREATE TABLE lineitem AS SELECT "
        "CAST((i - i % 4) / 4 AS BIGINT) AS l_orderkey, CAST(i % 4 + 1 AS INT) AS l_linenumber, "
        "CAST((i * 31) % 50 + 1 AS INT) AS l_quantity, "
        "CAST((i * 7919) % 10000000 AS DOUBLE) / 100 AS l_extendedprice, "
        f"{case(SHIPINSTRUCT, 2654435761)} AS l_shipinstruct, {case(SHIPMODE, 40503)} AS l_shipmode, "
        f"md5(CAST(i AS VARCHAR)) AS l_comment FROM {source}"
    )


def ensure_lineitem(args):
    directory = args.tpch / "lineitem"
    if not any(directory.glob("*.parquet")):
        generate = Path(__file__).resolve().parent / "tpch" / "generate.py"
        subprocess.run(
            [sys.executable, str(generate), "--sf", str(args.sf), "--out", str(args.tpch),
             "--tables", "lineitem", "--files", "16"],
            check=True,
        )
    return directory


def summary(times):
    rest = times[1:] or times
    return {"first": times[0], "second": rest[0], "repeat": statistics.median(rest)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cli", type=Path, required=True, help="the gpu-topk binary")
    parser.add_argument("--rows", type=int, default=100_000_000, help="tweets (default 100M)")
    parser.add_argument("--tpch", type=Path, help="TPC-H directory (lineitem/*.parquet)")
    parser.add_argument("--sf", type=float, default=10, help="scale factor to generate")
    parser.add_argument(
        "--synthetic-lineitem",
        type=int,
        metavar="ROWS",
        help="make lineitem's string-query columns by SQL instead (no TPC-H data needed)",
    )
    parser.add_argument("--runs", type=int, default=3, help="repeats after the first run")
    parser.add_argument("--duckdb", action="store_true", help="add DuckDB")
    parser.add_argument(
        "--only", default="first,tweets,groups,copy,strings,parquet", help="sessions to run"
    )
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "user-path")
    parser.add_argument("--logs", type=Path, default=None, help="per-process logs (default scratch)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.cli = args.cli.resolve()
    if not args.cli.is_file():
        fail(f"no gpu-topk binary at {args.cli}")
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.logs = args.logs or args.scratch
    args.logs.mkdir(parents=True, exist_ok=True)
    args.workdir = args.scratch
    only = set(args.only.split(","))
    if args.duckdb:
        import duckdb

        print(f"duckdb {duckdb.__version__}", flush=True)

    cache = args.scratch / "kernel-cache"
    shutil.rmtree(cache, ignore_errors=True)
    figures = {}
    checks = []

    def record(session, name, engine, times):
        figures.setdefault((session, name), {})[engine] = summary(times)

    def compare(session, name, keys, ours, reference, engine):
        same = key_values(ours, keys) == key_values(reference, keys)
        checks.append((session, name, engine, same))

    if "first" in only:
        setup = ["SELECT count(*) FROM tweets"]
        for label, cache_dir in (("empty kernel cache", args.scratch / "fresh-cache"), ("filled", args.scratch / "fresh-cache")):
            if label.startswith("empty"):
                shutil.rmtree(cache_dir, ignore_errors=True)
            results, wall = cli_session(args, f"first {label}", "cuda", setup, TWEETS[:1], cache_dir)
            times = results["Q1"][0]
            figures[("first GPU query", label)] = {"cuda": summary(times), "wall_s": wall}
            print(f"first GPU query ({label}): {times[0]:.1f} ms, then {times[1]:.1f} ms", flush=True)

    # (session, queries, CLI setup, DuckDB's load, engines)
    sessions = []
    every = ("datafusion", "auto", "cuda")
    if only & {"tweets", "groups", "copy"}:
        parquet = ensure_tweets_parquet(args) if args.duckdb else None
        files = f"read_parquet('{sql_text(str(parquet))}/*.parquet')" if parquet else None
        load = [f"CREATE TABLE tweets AS SELECT * FROM {files}"] if parquet else []
        setup = ["SELECT count(*) FROM tweets"]
        if "tweets" in only:
            sessions += [("tweets", [q], setup, load, every) for q in TWEETS]
        if "groups" in only:
            sessions += [("groups", [q], setup, load, every) for q in GROUPS]
        if "copy" in only:
            # The same queries over a copy made by SQL and over the CLI's GpuTable, in one
            # process: the copy must be read as fast.
            copy = [(f"{n} copy", sql.replace("FROM tweets", "FROM tweets_copy"), k) for n, sql, k in TWEETS]
            setup = ["CREATE TABLE tweets_copy AS SELECT * FROM tweets"]
            sessions.append(("tweets (CREATE TABLE AS, then GpuTable)", copy + TWEETS, setup, [], ("datafusion", "auto")))
    if args.synthetic_lineitem and "strings" in only:
        setup = [synthetic_lineitem(args.synthetic_lineitem, duckdb=False)]
        load = [synthetic_lineitem(args.synthetic_lineitem, duckdb=True)]
        sessions.append(("strings (CREATE TABLE AS, synthetic)", STRINGS, setup, load, ("datafusion", "auto")))
    elif only & {"strings", "parquet"}:
        if args.tpch is None:
            fail("--tpch DIR is needed for the string sessions")
        lineitem = ensure_lineitem(args).resolve()
        location = sql_text(str(lineitem)) + "/"
        external = f"CREATE EXTERNAL TABLE lineitem_files STORED AS PARQUET LOCATION '{location}'"
        load = [f"CREATE TABLE lineitem AS SELECT * FROM read_parquet('{location}*.parquet')"]
        if "strings" in only:
            setup = [external, "CREATE TABLE lineitem AS SELECT * FROM lineitem_files"]
            sessions.append(("strings (CREATE TABLE AS)", STRINGS, setup, load, ("datafusion", "auto")))
        if "parquet" in only:
            setup = [f"CREATE EXTERNAL TABLE lineitem STORED AS PARQUET LOCATION '{location}'"]
            view = [f"CREATE VIEW lineitem AS SELECT * FROM read_parquet('{location}*.parquet')"]
            sessions.append(("strings (external Parquet)", STRINGS, setup, view, ("datafusion", "auto")))

    connections = {}
    # A run stopped by `timeout` (SIGTERM) still reports the sessions it finished.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for session, queries, setup, load, engines in sessions:
            reference = None
            for engine in engines:
                results, wall = cli_session(args, session, engine, setup, queries, cache)
                for name, sql, keys in queries:
                    times, rows = results[name]
                    record(session, name, engine, times)
                    if engine == "datafusion":
                        continue
                    compare(session, name, keys, rows, reference[name][1], engine)
                if engine == "datafusion":
                    reference = results
                print(f"{session} / {queries[0][0]}: {engine} done in {wall:.1f} s", flush=True)
            if args.duckdb and load:
                key = tuple(load)
                if key not in connections:
                    connections[key] = duckdb_connect(load)
                results = duckdb_session(args, connections[key], queries)
                for name, sql, keys in queries:
                    times, rows = results[name]
                    record(session, name, "duckdb", times)
                    if session == "groups":
                        ours = [",".join(wrapped(v) for v in r) for r in rows]
                        compare(session, name, 0, ours, reference[name][1], "duckdb")
    except KeyboardInterrupt:
        print("stopped: reporting what was measured so far", flush=True)
    for con in connections.values():
        con.close()

    if args.json:
        args.json.write_text(json.dumps(
            {" / ".join(k): v for k, v in figures.items()} | {"checks": checks}, indent=1))
    print()
    lineitem = f"{args.synthetic_lineitem} synthetic rows" if args.synthetic_lineitem else args.tpch
    print(f"gpu-topk user path: {args.rows} tweets, lineitem from {lineitem}, "
          f"first run then the median of {args.runs}; fresh process per session")
    print()
    wrong = [c for c in checks if not c[3]]
    print(f"checks against DataFusion: {len(checks) - len(wrong)} of {len(checks)} equal"
          + "".join(f"; DIFFERENT: {s} / {n} ({e})" for s, n, e, _ in wrong))
    for (session, label), v in figures.items():
        if session == "first GPU query":
            print(f"first GPU query, {label}: {v['cuda']['first']:.1f} ms (process {v['wall_s']:.1f} s)")
    print()
    print("| session | query | DataFusion first / repeat ms | DuckDB first / repeat ms | "
          "auto first / 2nd / repeat ms | cuda repeat ms | auto 2nd / cuda | DF / auto | "
          "DuckDB / auto |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (session, name), v in figures.items():
        if session == "first GPU query" or "auto" not in v or "datafusion" not in v:
            continue
        df, auto, cuda, duck = (v.get(e) for e in ("datafusion", "auto", "cuda", "duckdb"))
        pair = lambda f: f"{f['first']:.1f} / {f['repeat']:.1f}" if f else "-"
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        print(
            f"| {session} | {name} | {pair(df)} | {pair(duck)} | "
            f"{auto['first']:.1f} / {auto['second']:.1f} / {auto['repeat']:.1f} | "
            f"{format(cuda['repeat'], '.1f') if cuda else '-'} | "
            f"{ratio(auto['second'], cuda['repeat'] if cuda else None)} | "
            f"{ratio(df['repeat'], auto['repeat'])} | "
            f"{ratio(duck['repeat'] if duck else None, auto['repeat'])} |"
        )
    copies = [
        (name, v["auto"]["repeat"], figures[(session, name[: -len(" copy")])]["auto"]["repeat"])
        for (session, name), v in figures.items()
        if name.endswith(" copy") and "auto" in v
        and "auto" in figures.get((session, name[: -len(" copy")]), {})
    ]
    if copies:
        print()
        print("CREATE TABLE AS / GpuTable, auto repeat: " + ", ".join(
            f"{name[: -len(' copy')]} {a:.1f} / {b:.1f} ms = {a / b:.2f}" for name, a, b in copies))
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
