"""Apache DataFusion with a GPU top-k operator.

``SessionContext`` is DataFusion's session with the operator installed: every
``ORDER BY ... LIMIT k`` (and ``ROW_NUMBER() ... <= k`` per group) that it can take runs on
the GPU when one is present and the cost model says so, else on its CPU path, with
DataFusion's answer. Arrow data goes in and out without copies.

    import datafusion_gpu_topk as gt
    ctx = gt.SessionContext()
    ctx.register_parquet("hits", "data/hits/")
    df = ctx.sql("SELECT url, clicks FROM hits ORDER BY clicks DESC LIMIT 10")
    print(df.to_pandas())

Settings are DataFusion's options and the operator's (``gpu_topk.backend``,
``gpu_topk.enabled``, ...), given to ``SessionContext(settings=...)``, to ``ctx.set`` or by
SQL (``SET gpu_topk.backend = 'cpu'``). Errors are raised as ``DataFusionError`` with
DataFusion's message.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pyarrow as pa

from ._internal import DataFusionError, __version__, gpu_status, tweet_queries
from ._internal import DataFrame as _DataFrame
from ._internal import SessionContext as _SessionContext

__all__ = [
    "DataFrame",
    "DataFusionError",
    "SessionContext",
    "__version__",
    "gpu_status",
    "tweet_queries",
]


def _arrow_stream(data: Any) -> Any:
    """``data`` as an object with ``__arrow_c_stream__`` (pyarrow, polars and DuckDB results
    have it; pandas goes through pyarrow; record batches and arrays with
    ``__arrow_c_array__`` become a one-batch table)."""
    if hasattr(data, "__arrow_c_stream__"):
        return data
    module = type(data).__module__.split(".")[0]
    if module == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    if hasattr(data, "__arrow_c_array__"):
        return pa.Table.from_batches([pa.record_batch(data)])
    raise TypeError(
        "expected Arrow data (a pyarrow Table or RecordBatch, a pandas or polars DataFrame, "
        f"or an object with __arrow_c_stream__), got {type(data).__name__}"
    )


class DataFrame:
    """A planned query. Nothing runs until its result is asked for (``collect``,
    ``to_arrow_table``, ``to_pandas``, ``to_polars``, ``count``, ``show``); each such call runs
    it again. A DataFrame is Arrow data itself: ``pyarrow.table(df)`` and
    ``polars.DataFrame(df)`` read it through ``__arrow_c_stream__``."""

    def __init__(self, native: _DataFrame):
        self._native = native

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self._native.__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> Any:
        return self._native.__arrow_c_schema__()

    def schema(self) -> pa.Schema:
        """The result's Arrow schema (without running the query)."""
        return pa.schema(self._native)

    @property
    def columns(self) -> list[str]:
        return self._native.columns()

    def collect(self) -> list[pa.RecordBatch]:
        """Runs the query: its result as pyarrow record batches."""
        return list(pa.RecordBatchReader.from_stream(self._native))

    def to_arrow_table(self) -> pa.Table:
        """Runs the query: its result as a pyarrow Table (no copy of the batches)."""
        return pa.RecordBatchReader.from_stream(self._native).read_all()

    def to_pandas(self) -> Any:
        """Runs the query: its result as a pandas DataFrame."""
        return self.to_arrow_table().to_pandas()

    def to_polars(self) -> Any:
        """Runs the query: its result as a polars DataFrame."""
        import polars

        return polars.from_arrow(self.to_arrow_table())

    def to_pylist(self) -> list[dict[str, Any]]:
        """Runs the query: its rows as dictionaries."""
        return self.to_arrow_table().to_pylist()

    def count(self) -> int:
        """Runs the query: the number of rows of its result."""
        return self._native.count()

    def explain(self, verbose: bool = False, analyze: bool = False) -> str:
        """The query's plans as text (``analyze`` runs it and adds each operator's metrics),
        then where each top-k ran (``top-k: GpuTopKExec, backend=..., algorithm=...``) or
        why DataFusion's TopK was kept (``top-k: DataFusion's TopK kept: ...``)."""
        return self._native.explain(verbose, analyze)

    def show(self, n: int = 20) -> None:
        """Runs the query and prints its first ``n`` rows."""
        print(self._native.show_string(n))

    def __repr__(self) -> str:
        return f"DataFrame(columns={self.columns})"


class SessionContext:
    """DataFusion's session with the GPU top-k operator installed.

    ``settings`` maps option names to values, as ``SET`` takes them: DataFusion's
    (``datafusion.execution.target_partitions``) and the operator's (``gpu_topk.backend``:
    ``auto``, ``cuda`` or ``cpu``; ``gpu_topk.enabled``; ...).
    """

    def __init__(self, settings: Mapping[str, Any] | None = None):
        self._native = _SessionContext(dict(settings) if settings else None)

    def sql(self, query: str) -> DataFrame:
        """Plans ``query``. Statements that change the session (``CREATE EXTERNAL TABLE``,
        ``SET``, ``DROP TABLE``) run now. A query asked again reuses its plan while the
        settings, the tables it reads and the device's column cache are unchanged."""
        return DataFrame(self._native.sql(query))

    def plan_cache_stats(self) -> dict[str, int]:
        """How often a query reused its plan (``hits``), was planned (``misses``), and how many
        plans the session keeps (``entries``)."""
        hits, misses, entries = self._native.plan_cache_stats()
        return {"hits": hits, "misses": misses, "entries": entries}

    def set(self, key: str, value: Any) -> None:
        """Sets one option, as ``SET key = value`` does."""
        if isinstance(value, bool):
            value = "true" if value else "false"
        self._native.set(key, str(value))

    def register_parquet(self, name: str, path: str, file_extension: str = ".parquet") -> None:
        """Registers a Parquet file, or a directory of them, as table ``name``."""
        self._native.register_parquet(name, str(path), file_extension)

    def register_csv(
        self,
        name: str,
        path: str,
        has_header: bool = True,
        delimiter: str = ",",
        file_extension: str = ".csv",
    ) -> None:
        """Registers a CSV file, or a directory of them, as table ``name``."""
        self._native.register_csv(name, str(path), has_header, delimiter, file_extension)

    def register_record_batches(
        self, name: str, partitions: Iterable[Iterable[pa.RecordBatch]]
    ) -> None:
        """Registers in-memory record batches as table ``name``, one list of batches a
        partition (partitions are scanned in parallel). The batches are not copied."""
        partitions = [list(p) for p in partitions]
        schema = next((b.schema for p in partitions for b in p), None)
        if schema is None:
            raise DataFusionError("register_record_batches: no batches, so no schema")
        tables = [pa.Table.from_batches(p, schema=schema) for p in partitions]
        self._native.register_record_batches(name, tables)

    def from_arrow(self, data: Any, name: str | None = None) -> DataFrame:
        """A DataFrame over Arrow data (a pyarrow Table or RecordBatch, a polars or pandas
        DataFrame, any object with ``__arrow_c_stream__``), registered as table ``name``
        when given. pyarrow and polars data is not copied."""
        return DataFrame(self._native.from_arrow(_arrow_stream(data), name))

    def from_pandas(self, data: Any, name: str | None = None) -> DataFrame:
        """A DataFrame over a pandas DataFrame (see ``from_arrow``)."""
        return self.from_arrow(data, name)

    def from_polars(self, data: Any, name: str | None = None) -> DataFrame:
        """A DataFrame over a polars DataFrame (see ``from_arrow``)."""
        return self.from_arrow(data, name)

    def register_tweets(self, rows: int, name: str = "tweets") -> None:
        """Registers the generated tweets table of the benchmarks (``tweet_queries()`` are
        the queries over it) with ``rows`` rows."""
        self._native.register_tweets(rows, name)

    def table(self, name: str) -> DataFrame:
        """The DataFrame of table ``name``."""
        return DataFrame(self._native.table(name))

    def deregister_table(self, name: str) -> bool:
        """Removes table ``name``; whether it was there."""
        return self._native.deregister_table(name)

    def tables(self) -> list[str]:
        """The names of the registered tables."""
        return self._native.tables()
