"""The Python package as a user drives it: the tweet queries, Parquet and CSV tables,
in-memory Arrow, pandas and polars data, settings, EXPLAIN, errors, and the GPU-less path.

Every answer is checked against plain DataFusion (the operator off) and, where the query
is simple enough, against pyarrow's own sort. With a GPU, ``test_cuda_backend_*`` runs the
queries with the CUDA backend forced; without one it is skipped and says why. The other tests
run the backend of ``GPU_TOPK_TEST_BACKEND`` (default ``cpu``, the operator's CPU path).
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

import datafusion_gpu_topk as gt

# The operator's backend under test (`cuda` on the GPU machine), as for the Rust tests.
BACKEND = os.environ.get("GPU_TOPK_TEST_BACKEND", "cpu")
DEFAULTS = {"datafusion.execution.target_partitions": "3", "gpu_topk.backend": BACKEND}


def session(**settings):
    return gt.SessionContext({**DEFAULTS, **settings})


def plain():
    """Plain DataFusion: the operator off."""
    return session(**{"gpu_topk.enabled": False})


def taken(plan: str) -> bool:
    """Whether one of the operators (the top-k's, or the top-k over an aggregate's) is in
    the plan."""
    return "GpuTopKExec" in plan or "GpuAggregateTopKExec" in plan


def rows(df):
    return df.to_arrow_table().to_pylist()


@pytest.fixture(scope="module")
def tweets_table():
    """The generated tweets as one pyarrow Table (60k rows)."""
    ctx = session()
    ctx.register_tweets(60_000)
    return ctx.table("tweets").to_arrow_table()


def table_of(n=5000):
    """A table with ties, NULLs and strings: `id` is unique, the rest repeat."""
    ids = list(range(n))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "score": pa.array([None if i % 37 == 0 else (i * 7919) % 101 for i in ids], pa.int32()),
            "price": pa.array([((i * 31) % 997) / 10 for i in ids], pa.float64()),
            "name": pa.array(
                [None if i % 41 == 0 else f"n{(i * 13) % 250:04d}-é" for i in ids], pa.string()
            ),
        }
    )


def test_tweet_queries_match_datafusion():
    ours, base = session(), plain()
    for ctx in (ours, base):
        ctx.register_tweets(50_000)
    queries = gt.tweet_queries()
    assert [name for name, _ in queries] == ["Q1", "Q2", "Q3", "Q4"]
    for name, sql in queries:
        # DataFusion breaks ties as its partitions arrive: a last key makes its order total.
        sql = sql.replace(" LIMIT", ", uid LIMIT" if "uid" in sql else ", id LIMIT")
        got = ours.sql(sql)
        assert taken(got.explain()), name
        assert rows(got) == rows(base.sql(sql)), name


def test_parquet_with_several_files_and_row_groups(tmp_path):
    data = table_of()
    folder = tmp_path / "t"
    folder.mkdir()
    for i, start in enumerate(range(0, data.num_rows, 2000)):
        pq.write_table(data.slice(start, 2000), folder / f"part-{i}.parquet", row_group_size=300)
    ours, base = session(), plain()
    for ctx in (ours, base):
        ctx.register_parquet("t", str(folder))
    for sql in [
        "SELECT id, score FROM t ORDER BY score DESC NULLS LAST, id LIMIT 25",
        "SELECT id, name FROM t WHERE price > 50 ORDER BY name, id LIMIT 40",
        "SELECT * FROM t ORDER BY price * 2 - score, id LIMIT 7 OFFSET 3",
    ]:
        df = ours.sql(sql)
        assert taken(df.explain()), sql
        assert rows(df) == rows(base.sql(sql)), sql
    # An independent oracle: pyarrow's own sort of the same rows.
    want = data.sort_by([("score", "descending"), ("id", "ascending")])
    want = want.filter(pc.is_valid(want["score"])).slice(0, 25).select(["id", "score"])
    got = ours.sql("SELECT id, score FROM t ORDER BY score DESC NULLS LAST, id LIMIT 25")
    assert got.to_arrow_table().to_pylist() == want.to_pylist()


def test_csv(tmp_path):
    data = table_of(3000)
    folder = tmp_path / "csv"
    folder.mkdir()
    for i, start in enumerate(range(0, data.num_rows, 1000)):
        pacsv.write_csv(data.slice(start, 1000), folder / f"part-{i}.csv")
    ours, base = session(), plain()
    for ctx in (ours, base):
        ctx.register_csv("t", str(folder))
    sql = "SELECT id, price FROM t WHERE score < 50 ORDER BY price DESC, id LIMIT 30"
    df = ours.sql(sql)
    assert "GpuTopKExec" in df.explain()
    assert rows(df) == rows(base.sql(sql))


def test_record_batches_in_partitions_and_an_aggregate_below(tweets_table):
    batches = tweets_table.to_batches(max_chunksize=4096)
    partitions = [batches[i::4] for i in range(4)]
    ours, base = session(), plain()
    for ctx in (ours, base):
        ctx.register_record_batches("tweets", partitions)
    for sql in [
        "SELECT id, retweet_count FROM tweets ORDER BY retweet_count DESC, id LIMIT 50",
        # An input that cannot be replayed: an aggregate below the top-k.
        "SELECT uid, sum(likes_count) AS likes FROM tweets GROUP BY uid "
        "ORDER BY likes DESC, uid LIMIT 20",
    ]:
        df = ours.sql(sql)
        assert taken(df.explain()), sql
        assert rows(df) == rows(base.sql(sql)), sql


def test_arrow_in_and_out_without_copies():
    n = 10_000_000
    ids = pa.array(range(n), pa.int64())
    data = pa.table({"id": ids, "price": pc.multiply(pc.bit_wise_and(ids, 1023), 0.5)})
    data = pa.Table.from_batches(data.to_batches(max_chunksize=1 << 20))
    ctx = session()
    df = ctx.from_arrow(data, name="t")
    out = df.to_arrow_table()
    assert out.num_rows == n
    # Every value buffer that came back lies inside one that went in (DataFusion's scan
    # slices the batches): no column data was copied in or out.
    def values(table):
        return [
            (chunk.buffers()[1].address, chunk.buffers()[1].size)
            for column in table.columns
            for chunk in column.chunks
        ]
    given = values(data)
    for address, size in values(out):
        assert any(a <= address and address + size <= a + n for a, n in given), address
    assert ctx.tables() == ["t"]
    assert df.schema() == data.schema
    top = ctx.sql("SELECT id FROM t ORDER BY price DESC, id LIMIT 3").to_pylist()
    assert top == [{"id": 1023}, {"id": 2047}, {"id": 3071}]
    # pyarrow reads a DataFrame directly.
    assert pa.table(ctx.sql("SELECT 1 AS one")).to_pylist() == [{"one": 1}]


def test_pandas_and_polars():
    pd = pytest.importorskip("pandas")
    pl = pytest.importorskip("polars")
    frame = pd.DataFrame({"k": [3, 1, 2, 5, 4], "v": list("abcde")})
    ctx = session()
    ctx.from_pandas(frame, name="p")
    ctx.from_polars(pl.DataFrame({"k": [9, 8, 7], "v": ["x", "y", "z"]}), name="q")
    sql = "SELECT k, v FROM p UNION ALL SELECT k, v FROM q ORDER BY k DESC LIMIT 4"
    got = ctx.sql(sql)
    assert got.to_pandas()["k"].tolist() == [9, 8, 7, 5]
    assert got.to_polars()["v"].to_list() == ["x", "y", "z", "d"]
    assert pl.DataFrame(ctx.sql("SELECT k FROM p ORDER BY k LIMIT 2"))["k"].to_list() == [1, 2]


def test_results_pass_to_the_datafusion_package_and_back():
    """The `datafusion` package's DataFrames and ours read each other through the Arrow C
    stream interface."""
    datafusion = pytest.importorskip("datafusion")
    ctx = session()
    ctx.from_arrow(table_of(), name="t")
    sql = "SELECT id, score FROM t ORDER BY score DESC NULLS LAST, id LIMIT 5"
    ours = ctx.sql(sql)
    theirs = datafusion.SessionContext().from_arrow(ours, name="top")
    assert theirs.to_arrow_table().to_pylist() == rows(ours)
    back = session().from_arrow(theirs, name="again")
    assert rows(back) == rows(ours)
    plain_rows = datafusion.SessionContext()
    plain_rows.from_arrow(table_of(), name="t")
    assert plain_rows.sql(sql).to_arrow_table().to_pylist() == rows(ours)


def test_repeated_queries_reuse_their_plan_until_something_changes(tmp_path):
    data = table_of()
    ours, base = session(), plain()
    for ctx in (ours, base):
        ctx.register_record_batches("t", [data.to_batches(max_chunksize=700)])
    sql = "SELECT id, score FROM t ORDER BY score DESC NULLS LAST, id LIMIT 12"
    want = rows(base.sql(sql))
    for _ in range(4):
        assert rows(ours.sql(sql)) == want
    stats = ours.plan_cache_stats()
    assert stats["hits"] >= 2 and stats["entries"] == 1, stats
    # A DataFrame runs its query again each time it is asked for.
    df = ours.sql(sql)
    assert rows(df) == want and rows(df) == want and df.count() == 12
    # Another table under the same name: planned again, its rows.
    smaller = data.slice(0, 100)
    for ctx in (ours, base):
        ctx.deregister_table("t")
        ctx.register_record_batches("t", [smaller.to_batches()])
    misses = ours.plan_cache_stats()["misses"]
    assert rows(ours.sql(sql)) == rows(base.sql(sql))
    assert ours.plan_cache_stats()["misses"] == misses + 1
    # A setting changed: planned again.
    ours.set("datafusion.execution.batch_size", 77)
    assert rows(ours.sql(sql)) == rows(base.sql(sql))
    assert ours.plan_cache_stats()["misses"] == misses + 2
    # Statements with side effects are not kept, and run once per `sql`.
    ours.sql("CREATE TABLE u AS SELECT id FROM t WHERE id < 5")
    assert ours.sql("SELECT count(*) AS n FROM u").to_pylist() == [{"n": 5}]


def test_settings():
    ctx = session()
    ctx.register_tweets(10_000)
    sql = gt.tweet_queries()[0][1]
    assert "GpuTopKExec" in ctx.sql(sql).explain()
    ctx.sql("SET gpu_topk.enabled = false")
    assert "GpuTopKExec" not in ctx.sql(sql).explain()
    ctx.set("gpu_topk.enabled", True)
    ctx.set("gpu_topk.backend", "cpu")
    assert "GpuTopKExec, backend=cpu" in ctx.sql(sql).explain()
    with pytest.raises(gt.DataFusionError, match="invalid gpu_topk.backend 'tpu'|gpu_topk.backend"):
        ctx.set("gpu_topk.backend", "tpu")
    with pytest.raises(gt.DataFusionError, match="unknown setting gpu_topk.nope"):
        ctx.sql("SET gpu_topk.nope = 1")
    with pytest.raises(gt.DataFusionError):
        gt.SessionContext({"datafusion.execution.target_partitions": "many"})


def test_errors_are_datafusions():
    ctx, base = session(), plain()
    for sql, fragment in [
        ("SELEC 1", "Expected"),
        ("SELECT * FROM nowhere ORDER BY 1 LIMIT 1", "nowhere"),
        ("SELECT 1/0", "Divide by zero"),
    ]:
        with pytest.raises(gt.DataFusionError) as ours_error:
            ctx.sql(sql).collect()
        with pytest.raises(gt.DataFusionError) as plain_error:
            base.sql(sql).collect()
        assert fragment in str(ours_error.value)
        assert str(ours_error.value) == str(plain_error.value)
    with pytest.raises(TypeError, match="expected Arrow data"):
        ctx.from_arrow([1, 2, 3])
    with pytest.raises(gt.DataFusionError, match="delimiter"):
        ctx.register_csv("t", "x.csv", delimiter=";;")
    with pytest.raises(gt.DataFusionError):
        ctx.register_parquet("t", "/nonexistent/dir/")


def test_explain_says_where_the_top_k_ran_or_why_not():
    ctx = session(**{"gpu_topk.backend": "auto"})
    ctx.register_tweets(10_000)
    text = ctx.sql(gt.tweet_queries()[0][1]).explain()
    assert "top-k:" in text
    if gt.gpu_status().startswith("none"):
        # No GPU: under `auto` the operator says why it kept DataFusion's TopK, or that it
        # runs its CPU path.
        assert "DataFusion's TopK kept" in text or "backend=cpu" in text
    analyzed = ctx.sql(gt.tweet_queries()[1][1]).explain(analyze=True)
    assert "output_rows" in analyzed


def test_gpu_status_names_the_device_or_the_reason():
    status = gt.gpu_status()
    assert status.startswith("none (") or status


def test_cuda_backend_matches_the_cpu_path():
    status = gt.gpu_status()
    if status.startswith("none"):
        pytest.skip(f"no GPU: {status}")
    cuda, cpu = session(**{"gpu_topk.backend": "cuda"}), session(**{"gpu_topk.backend": "cpu"})
    for ctx in (cuda, cpu):
        ctx.register_tweets(200_000)
    for name, sql in gt.tweet_queries():
        if "GROUP BY" in sql:
            # Rows merged by a hash repartition arrive in any order: ties need a last key.
            sql = sql.replace(" LIMIT", ", uid LIMIT")
        df = cuda.sql(sql)
        assert "backend=cuda" in df.explain(), name
        assert rows(df) == rows(cpu.sql(sql)), name


def test_the_plot_example_runs(tmp_path):
    pytest.importorskip("matplotlib")
    import runpy

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "top_users.py")
    out = tmp_path / "top_users.png"
    os.environ["TOP_USERS_PNG"] = str(out)
    try:
        runpy.run_path(example, run_name="__main__")
    finally:
        del os.environ["TOP_USERS_PNG"]
    assert out.stat().st_size > 1000
