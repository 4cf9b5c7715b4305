#!/usr/bin/env python3
"""Generates TPC-H data with DuckDB's dbgen and writes it as Parquet (or CSV) files.

    python3 benches/tpch/generate.py --sf 0.1 --out /tmp/tpch-0.1
    python3 benches/tpch/generate.py --sf 1 --out /tmp/tpch-1 --files 8
    python3 benches/tpch/generate.py --sf 0.1 --out /tmp/tpch-0.1-csv --csv

Writes one directory per table (customer, lineitem, nation, orders, part, partsupp, region,
supplier), each holding `--files` files (default 4) named part-0.parquet, part-1.parquet, ...
The rows are split into consecutive ranges in dbgen's order (lineitem and orders by order key,
the others by their key), so file i holds the i-th range and every file has the same schema.
Parquet files have several row groups each (`--row-group-rows`; by default about a quarter of
a file's rows; DuckDB rounds row groups to multiples of its 2,048-row vectors, so small tables
get one per file). The column types are dbgen's: DECIMAL(15,2) for money and quantities, DATE for
dates, VARCHAR for text, BIGINT/INTEGER for keys. A table too small to fill `--files` files
(region: 5 rows) gets fewer, never an empty one.

With `--csv` the files are CSV with a header line (part-0.csv, ...) instead: dates are written
as YYYY-MM-DD and decimals as plain numbers, so a reader must be given the schema (or infer
DATE/DECIMAL itself) to get the same types back.

Needs the `duckdb` and `duckdb-extension-tpch` Python packages:

    pip install duckdb duckdb-extension-tpch

The second one carries DuckDB's TPC-H extension as a file inside the wheel, so generation
works offline: it is loaded from there by path (`LOAD '<path>'`). Without that package, an
extension already installed in DuckDB's own extension directory (`INSTALL tpch`) is used.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

TABLES = ["customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier"]
INSTALL_HINT = "pip install duckdb duckdb-extension-tpch"


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def import_duckdb():
    try:
        import duckdb
    except ImportError:
        fail(f"the duckdb Python package is missing; install it with: {INSTALL_HINT}")
    return duckdb


def wheel_extension_path(duckdb):
    """The tpch extension file shipped in the duckdb-extension-tpch wheel, or None."""
    try:
        import duckdb_extension_tpch
    except ImportError:
        return None
    root = Path(duckdb_extension_tpch.__file__).parent / "extensions"
    exact = root / f"v{duckdb.__version__}" / "tpch.duckdb_extension"
    if exact.is_file():
        return exact
    # The wheel pins the duckdb version it was built for; name what is there if it differs.
    found = sorted(root.glob("*/tpch.duckdb_extension"))
    if found:
        fail(
            f"duckdb-extension-tpch carries the extension for "
            f"{', '.join(p.parent.name for p in found)}, but duckdb is v{duckdb.__version__}; "
            f"install matching versions: pip install duckdb=={duckdb.__version__} "
            f"duckdb-extension-tpch=={duckdb.__version__}"
        )
    return None


def load_tpch(duckdb, con):
    """Loads the tpch extension without the network: from the wheel, else DuckDB's own
    extension directory. Returns where it came from."""
    path = wheel_extension_path(duckdb)
    if path is not None:
        con.execute(f"LOAD '{path}'")
        return str(path)
    try:
        con.execute("LOAD tpch")
        return "DuckDB's extension directory"
    except duckdb.Error as e:
        fail(
            f"DuckDB's tpch extension is not available ({e.__class__.__name__}); "
            f"install it with: {INSTALL_HINT}"
        )


def sql_path(path):
    return str(path).replace("'", "''")


def write_table(con, table, out, files, row_group_rows, csv):
    """Writes `table` as up to `files` files of consecutive row ranges under out/table."""
    rows = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    files = max(1, min(files, rows))
    directory = out / table
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    per_file = -(-rows // files)  # ceiling
    files = -(-rows // per_file)  # no empty file at the end (5 rows in 4 files: 2, 2, 1)
    # Several row groups per file: about four unless given; DuckDB takes at least 1 row.
    group = row_group_rows or max(1, -(-per_file // 4))
    extension = "csv" if csv else "parquet"
    for i in range(files):
        start, end = i * per_file, min(rows, (i + 1) * per_file)
        # rowid is the insertion position in dbgen's order; ranges of it are cheap to scan.
        query = f"SELECT * FROM {table} WHERE rowid >= {start} AND rowid < {end} ORDER BY rowid"
        target = directory / f"part-{i}.{extension}"
        if csv:
            options = "FORMAT CSV, HEADER true, DELIMITER ','"
        else:
            options = f"FORMAT PARQUET, ROW_GROUP_SIZE {group}, COMPRESSION zstd"
        con.execute(f"COPY ({query}) TO '{sql_path(target)}' ({options})")
    if csv:
        return rows, files, None
    # DuckDB rounds row groups to its vectors (2,048 rows), so report what was written.
    groups = con.execute(
        "SELECT count(DISTINCT (file_name, row_group_id)) "
        f"FROM parquet_metadata('{sql_path(directory)}/*.parquet')"
    ).fetchone()[0]
    return rows, files, groups


def main():
    parser = argparse.ArgumentParser(
        description="Generate TPC-H tables with DuckDB's dbgen as Parquet (or CSV) files, "
        "one directory per table."
    )
    parser.add_argument("--sf", type=float, required=True, help="scale factor (e.g. 0.01, 0.1, 1)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--files", type=int, default=4, help="files per table (default 4)")
    parser.add_argument(
        "--row-group-rows",
        type=int,
        default=0,
        help="rows per Parquet row group (default: a quarter of a file's rows)",
    )
    parser.add_argument("--csv", action="store_true", help="write CSV with a header instead")
    parser.add_argument(
        "--tables",
        default=",".join(TABLES),
        help="comma-separated tables to write (default: all eight)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="DuckDB threads (default: all)"
    )
    parser.add_argument(
        "--db",
        type=Path,
        help="generate into this new DuckDB database file instead of memory (for scale "
        "factors whose tables do not fit in memory); the file stays afterwards",
    )
    args = parser.parse_args()
    if args.sf <= 0:
        fail("--sf must be positive")
    if args.files < 1:
        fail("--files must be at least 1")
    if args.row_group_rows < 0:
        fail("--row-group-rows must not be negative")
    if args.db is not None and args.db.exists():
        fail(f"--db {args.db} exists; give a new file")

    duckdb = import_duckdb()
    started = time.perf_counter()
    con = duckdb.connect(str(args.db) if args.db else ":memory:")
    con.execute(f"SET threads = {int(args.threads)}")
    # Keep dbgen's row order, so that the rowid ranges are the key ranges.
    con.execute("SET preserve_insertion_order = true")
    source = load_tpch(duckdb, con)
    print(f"duckdb {duckdb.__version__}, tpch extension from {source}", flush=True)

    print(f"dbgen sf={args.sf:g} ...", flush=True)
    t = time.perf_counter()
    con.execute(f"CALL dbgen(sf={args.sf})")
    print(f"dbgen done in {time.perf_counter() - t:.1f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    kind = "CSV" if args.csv else "Parquet"
    wanted = [t.strip() for t in args.tables.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in TABLES]
    if unknown:
        sys.exit(f"error: unknown table(s) {', '.join(unknown)}; TPC-H has {', '.join(TABLES)}")
    for table in wanted:
        t = time.perf_counter()
        rows, files, row_groups = write_table(
            con, table, args.out, args.files, args.row_group_rows, args.csv
        )
        groups = "" if args.csv else f", {row_groups} row groups"
        print(
            f"{table}: {rows} rows, {files} {kind} file(s){groups} "
            f"in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
