//! The native module of the `datafusion_gpu_topk` Python package: a DataFusion
//! `SessionContext` with the GPU top-k operator installed, and its DataFrames.
//!
//! Arrow data crosses the boundary through the Arrow PyCapsule interface (the C stream and
//! schema interfaces), without copies: tables come in from any object with
//! `__arrow_c_stream__` (pyarrow, polars, pandas through pyarrow), and a DataFrame is itself
//! such an object. Queries run on one Tokio runtime of the process, with the GIL released.
//! DataFusion's errors are raised as `DataFusionError` with DataFusion's message.
//!
//! The Python layer (`datafusion_gpu_topk/__init__.py`) wraps these classes with the
//! conveniences that need pyarrow, pandas or polars.

use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::ffi::FFI_ArrowSchema;
use datafusion::arrow::ffi_stream::{ArrowArrayStreamReader, FFI_ArrowArrayStream};
use datafusion::arrow::record_batch::{RecordBatchIterator, RecordBatchReader};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError as DfError;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{
    CsvReadOptions, DataFrame, ParquetReadOptions, SessionConfig, SessionContext,
};
use datafusion_gpu_topk::datasets::{QUERIES, TweetsSpec, tweets_mem_table};
use datafusion_gpu_topk::{
    CachedPlan, GpuTopKConfig, PlanCache, SessionStateBuilderExt, gpu_summary, topk_report,
};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

pyo3::create_exception!(
    datafusion_gpu_topk,
    DataFusionError,
    PyException,
    "An error of DataFusion's (SQL, planning, execution, a setting), with its message."
);

/// The capsule names of the Arrow PyCapsule interface.
const STREAM: &CStr = c"arrow_array_stream";
const SCHEMA: &CStr = c"arrow_schema";

fn error(e: impl Into<DfError>) -> PyErr {
    DataFusionError::new_err(e.into().strip_backtrace())
}

fn arrow_error(e: ArrowError) -> PyErr {
    error(DfError::ArrowError(Box::new(e), None))
}

/// The runtime every query of the process runs on (all cores).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("datafusion-gpu-topk")
            .build()
            .expect("a Tokio runtime")
    })
}

/// Runs `future` to its end with the GIL released, so that other Python threads go on.
fn wait<F>(py: Python<'_>, future: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    py.detach(|| runtime().block_on(future))
}

/// The batches of an object with `__arrow_c_stream__` (its schema, then the batches).
fn import_stream(data: &Bound<'_, PyAny>) -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
    if !data.hasattr("__arrow_c_stream__")? {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "expected Arrow data (an object with __arrow_c_stream__, such as a pyarrow Table), \
             got {}",
            data.get_type().name()?
        )));
    }
    let capsule = data.call_method0("__arrow_c_stream__")?;
    let capsule = capsule.cast::<PyCapsule>()?;
    let pointer = capsule.pointer_checked(Some(STREAM))?;
    // SAFETY: a capsule named arrow_array_stream holds an ArrowArrayStream, which `from_raw`
    // moves out (marking the capsule's released) so that the reader owns it.
    let reader = unsafe {
        ArrowArrayStreamReader::from_raw(pointer.as_ptr().cast::<FFI_ArrowArrayStream>())
    }
    .map_err(arrow_error)?;
    let schema = reader.schema();
    let batches = reader.collect::<Result<Vec<_>, _>>().map_err(arrow_error)?;
    Ok((schema, batches))
}

/// A DataFusion session with the GPU top-k operator installed.
#[pyclass(
    name = "SessionContext",
    module = "datafusion_gpu_topk._internal",
    frozen
)]
struct PySessionContext {
    ctx: SessionContext,
    /// Queries repeated in this session reuse their physical plans.
    plans: Arc<PlanCache>,
}

#[pymethods]
impl PySessionContext {
    /// `settings`: DataFusion's and the operator's options by their SQL names
    /// (`{"gpu_topk.backend": "cpu", "datafusion.execution.target_partitions": "4"}`).
    #[new]
    #[pyo3(signature = (settings = None))]
    fn new(settings: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut pairs = Vec::new();
        for (key, value) in settings.into_iter().flat_map(|d| d.iter()) {
            // Python's True and False as SQL's true and false.
            let value = match value.extract::<bool>() {
                Ok(b) => b.to_string(),
                Err(_) => value.str()?.to_string(),
            };
            pairs.push((key.extract::<String>()?, value));
        }
        let mut config = SessionConfig::new().with_information_schema(true);
        // DataFusion's own options before the session is built (they size it); the operator's
        // after it is installed, as `SET` would.
        let (ours, theirs): (Vec<_>, Vec<_>) = pairs
            .into_iter()
            .partition(|(k, _)| k.starts_with("gpu_topk."));
        for (key, value) in theirs {
            config.options_mut().set(&key, &value).map_err(error)?;
        }
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .with_gpu_topk(GpuTopKConfig::default())
            .build();
        let ctx = SessionContext::new_with_state(state);
        for (key, value) in ours {
            set_option(&ctx, &key, &value)?;
        }
        Ok(Self {
            ctx,
            plans: Arc::new(PlanCache::new()),
        })
    }

    /// Plans `query` (any statement DataFusion takes: a query, `CREATE EXTERNAL TABLE`,
    /// `SET`, `EXPLAIN`); statements that change the session run now.
    /// A query (or `EXECUTE`) is planned through the session's `PlanCache`: repeated, it
    /// reuses its plan while nothing it was planned from changed.
    fn sql(&self, py: Python<'_>, query: &str) -> PyResult<PyDataFrame> {
        if !is_query(&self.ctx, query) {
            let frame = wait(py, self.ctx.sql(query)).map_err(error)?;
            return Ok(PyDataFrame::of(frame));
        }
        let planned = wait(py, self.plans.plan(&self.ctx, query)).map_err(error)?;
        Ok(PyDataFrame {
            schema: planned.plan().schema(),
            frame: OnceLock::new(),
            query: Some(Query {
                ctx: self.ctx.clone(),
                plans: Arc::clone(&self.plans),
                sql: query.to_string(),
                planned: Mutex::new(Some(planned)),
            }),
        })
    }

    /// How the session's plan cache has served: plans reused (`hits`), queries planned
    /// (`misses`), plans kept now (`entries`).
    fn plan_cache_stats(&self) -> (u64, u64, usize) {
        let stats = self.plans.stats();
        (stats.hits, stats.misses, stats.entries)
    }

    /// Sets one option by its SQL name, as `SET key = value` does.
    fn set(&self, key: &str, value: &str) -> PyResult<()> {
        set_option(&self.ctx, key, value)
    }

    /// Registers the Parquet file or directory of files at `path` as table `name`.
    #[pyo3(signature = (name, path, file_extension = ".parquet"))]
    fn register_parquet(
        &self,
        py: Python<'_>,
        name: &str,
        path: &str,
        file_extension: &str,
    ) -> PyResult<()> {
        let options = ParquetReadOptions {
            file_extension,
            ..Default::default()
        };
        wait(py, self.ctx.register_parquet(name, path, options)).map_err(error)
    }

    /// Registers the CSV file or directory of files at `path` as table `name`.
    #[pyo3(signature = (name, path, has_header = true, delimiter = ",", file_extension = ".csv"))]
    fn register_csv(
        &self,
        py: Python<'_>,
        name: &str,
        path: &str,
        has_header: bool,
        delimiter: &str,
        file_extension: &str,
    ) -> PyResult<()> {
        let [delimiter] = delimiter.as_bytes() else {
            return Err(error(DfError::Configuration(format!(
                "a CSV delimiter is one byte, not {delimiter:?}"
            ))));
        };
        let options = CsvReadOptions::new()
            .has_header(has_header)
            .delimiter(*delimiter)
            .file_extension(file_extension);
        wait(py, self.ctx.register_csv(name, path, options)).map_err(error)
    }

    /// Registers in-memory partitions as table `name`: each partition an object with
    /// `__arrow_c_stream__` (e.g. a pyarrow Table), all of one schema. The batches are not
    /// copied.
    fn register_record_batches(
        &self,
        name: &str,
        partitions: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let table = mem_table(&partitions)?;
        self.ctx.register_table(name, table).map_err(error)?;
        Ok(())
    }

    /// A DataFrame over the Arrow data in `data` (an object with `__arrow_c_stream__`), not
    /// copied; registered as table `name` too when given.
    #[pyo3(signature = (data, name = None))]
    #[allow(clippy::wrong_self_convention)] // datafusion-python's name for it
    fn from_arrow(&self, data: &Bound<'_, PyAny>, name: Option<&str>) -> PyResult<PyDataFrame> {
        let table = mem_table(std::slice::from_ref(data))?;
        if let Some(name) = name {
            self.ctx
                .register_table(name, Arc::clone(&table) as _)
                .map_err(error)?;
        }
        let frame = self.ctx.read_table(table).map_err(error)?;
        Ok(PyDataFrame::of(frame))
    }

    /// Registers the generated tweets table of the benchmarks (the columns `id`, `tweet_time`,
    /// `retweet_count`, `likes_count`, `lang`, …) with `rows` rows, as table `name`.
    #[pyo3(signature = (rows, name = "tweets"))]
    fn register_tweets(&self, py: Python<'_>, rows: u64, name: &str) -> PyResult<()> {
        let partitions = self.ctx.copied_config().target_partitions();
        let table = py
            .detach(|| tweets_mem_table(&TweetsSpec::new(rows), partitions))
            .map_err(error)?;
        self.ctx.register_table(name, table).map_err(error)?;
        Ok(())
    }

    /// The DataFrame of table `name`.
    fn table(&self, py: Python<'_>, name: &str) -> PyResult<PyDataFrame> {
        let frame = wait(py, self.ctx.table(name)).map_err(error)?;
        Ok(PyDataFrame::of(frame))
    }

    /// Removes table `name`; whether it was there.
    fn deregister_table(&self, name: &str) -> PyResult<bool> {
        Ok(self.ctx.deregister_table(name).map_err(error)?.is_some())
    }

    /// The names of the tables of the default schema, sorted.
    fn tables(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .ctx
            .catalog("datafusion")
            .and_then(|c| c.schema("public"))
            .map(|s| s.table_names())
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// Whether `sql` is one statement that only reads (a query, `EXECUTE`): planning it again
/// changes nothing. Anything else, or what does not parse, takes `SessionContext::sql`'s path.
fn is_query(ctx: &SessionContext, sql: &str) -> bool {
    use datafusion::sql::parser::Statement as DfStatement;
    use datafusion::sql::sqlparser::ast::Statement;
    let state = ctx.state_ref();
    let state = state.read();
    let dialect = state.config().options().sql_parser.dialect;
    matches!(
        state.sql_to_statement(sql, &dialect),
        Ok(DfStatement::Statement(s)) if matches!(*s, Statement::Query(_) | Statement::Execute { .. })
    )
}

fn set_option(ctx: &SessionContext, key: &str, value: &str) -> PyResult<()> {
    let state = ctx.state_ref();
    let mut state = state.write();
    state
        .config_mut()
        .options_mut()
        .set(key, value)
        .map_err(error)
}

/// One in-memory table of the partitions' batches.
fn mem_table(partitions: &[Bound<'_, PyAny>]) -> PyResult<Arc<MemTable>> {
    let mut schema: Option<SchemaRef> = None;
    let mut parts = Vec::with_capacity(partitions.len());
    for (i, partition) in partitions.iter().enumerate() {
        let (s, batches) = import_stream(partition)?;
        match &schema {
            None => schema = Some(s),
            Some(first) if first.fields() != s.fields() => {
                return Err(error(DfError::Plan(format!(
                    "partition {i} has schema {s}, partition 0 {first}"
                ))));
            }
            Some(_) => {}
        }
        parts.push(batches);
    }
    let schema = schema.ok_or_else(|| {
        error(DfError::Plan(
            "no partitions: a table needs at least one (it may be empty)".to_string(),
        ))
    })?;
    // Batches whose schema differs in metadata only take the table's.
    let parts = parts
        .into_iter()
        .map(|batches| {
            batches
                .into_iter()
                .map(|b| b.with_schema(Arc::clone(&schema)))
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(arrow_error)?;
    Ok(Arc::new(MemTable::try_new(schema, parts).map_err(error)?))
}

/// `batch` in `schema`: a plan's branches may give one column in different physical types
/// (a `UNION ALL` of `LargeUtf8` and `Utf8View`), where the stream must give one.
fn conform(batch: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, ArrowError> {
    if batch.schema().fields() == schema.fields() {
        return RecordBatch::try_new(Arc::clone(schema), batch.columns().to_vec());
    }
    let columns = (batch.columns().iter().zip(schema.fields()))
        .map(|(column, field)| datafusion::arrow::compute::cast(column, field.data_type()))
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(Arc::clone(schema), columns)
}

/// A planned query: run it with `collect` (or hand it to pyarrow, pandas or polars, which
/// read it through `__arrow_c_stream__`). Each run executes the query again.
#[pyclass(name = "DataFrame", module = "datafusion_gpu_topk._internal", frozen)]
struct PyDataFrame {
    /// The result's schema.
    schema: SchemaRef,
    /// The logical plan, made when first needed for a query (`explain`, `count`, `show`).
    frame: OnceLock<DataFrame>,
    /// Where the frame came from a query: its text and the plan made for it.
    query: Option<Query>,
}

/// A query of a [`PySessionContext`], run through its `PlanCache`.
struct Query {
    ctx: SessionContext,
    plans: Arc<PlanCache>,
    sql: String,
    /// The plan made by `sql()`, for the first run; later runs ask the cache again.
    planned: Mutex<Option<CachedPlan>>,
}

impl PyDataFrame {
    fn of(frame: DataFrame) -> Self {
        Self {
            schema: Arc::new(frame.schema().as_arrow().clone()),
            frame: OnceLock::from(frame),
            query: None,
        }
    }

    /// The logical plan.
    fn frame(&self, py: Python<'_>) -> PyResult<DataFrame> {
        if let Some(frame) = self.frame.get() {
            return Ok(frame.clone());
        }
        let query = self
            .query
            .as_ref()
            .expect("a frame without one comes from a query");
        let frame = wait(py, query.ctx.sql(&query.sql)).map_err(error)?;
        Ok(self.frame.get_or_init(|| frame).clone())
    }

    /// Runs the query to the end.
    fn run(&self, py: Python<'_>) -> PyResult<Vec<RecordBatch>> {
        let Some(query) = &self.query else {
            return wait(py, self.frame(py)?.collect()).map_err(error);
        };
        let first = query
            .planned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        wait(py, async {
            let planned = match first {
                Some(planned) => planned,
                None => query.plans.plan(&query.ctx, &query.sql).await?,
            };
            planned.collect().await
        })
        .map_err(error)
    }
}

#[pymethods]
impl PyDataFrame {
    /// Runs the query: its result as an Arrow C stream (a PyCapsule), for pyarrow's
    /// `RecordBatchReader.from_stream`, `pyarrow.table`, polars and pandas.
    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        // The result is given in its own schema; consumers cast where they asked otherwise.
        let _ = requested_schema;
        let schema = Arc::clone(&self.schema);
        let batches = self.run(py)?;
        let batches = (batches.into_iter())
            .map(|b| conform(b, &schema))
            .collect::<Result<Vec<_>, _>>()
            .map_err(arrow_error)?;
        let reader = RecordBatchIterator::new(batches.into_iter().map(Ok), schema);
        let stream = FFI_ArrowArrayStream::new(Box::new(reader));
        PyCapsule::new_with_value(py, stream, STREAM)
    }

    /// The result's schema as an Arrow C schema (a PyCapsule), for `pyarrow.schema`.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let schema = FFI_ArrowSchema::try_from(self.schema.as_ref()).map_err(arrow_error)?;
        PyCapsule::new_with_value(py, schema, SCHEMA)
    }

    /// The plan (`EXPLAIN`, or `EXPLAIN ANALYZE`, which runs the query) as text, then one
    /// line per top-k operator: where it runs, or why DataFusion's TopK was kept.
    #[pyo3(signature = (verbose = false, analyze = false))]
    fn explain(&self, py: Python<'_>, verbose: bool, analyze: bool) -> PyResult<String> {
        let frame = self.frame(py)?;
        let explained = frame.clone().explain(verbose, analyze).map_err(error)?;
        let (state, logical) = frame.into_parts();
        let (batches, report) = wait(py, async move {
            let batches = explained.collect().await?;
            let plan = state.create_physical_plan(&logical).await?;
            Ok::<_, DfError>((batches, topk_report(&state, &plan)))
        })
        .map_err(error)?;
        let mut text = pretty_format_batches(&batches)
            .map_err(arrow_error)?
            .to_string();
        for line in report {
            text.push('\n');
            text.push_str(&line);
        }
        Ok(text)
    }

    /// The first `n` rows as a table of text.
    #[pyo3(signature = (n = 20))]
    fn show_string(&self, py: Python<'_>, n: usize) -> PyResult<String> {
        let frame = self.frame(py)?.limit(0, Some(n)).map_err(error)?;
        let batches = wait(py, frame.collect()).map_err(error)?;
        Ok(pretty_format_batches(&batches)
            .map_err(arrow_error)?
            .to_string())
    }

    /// The number of rows the query returns.
    fn count(&self, py: Python<'_>) -> PyResult<usize> {
        let frame = self.frame(py)?;
        wait(py, frame.count()).map_err(error)
    }

    /// The names of the result's columns.
    fn columns(&self) -> Vec<String> {
        self.schema
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    }
}

/// The GPU the operator uses (`NVIDIA H200, …`), or `none (why)`.
#[pyfunction]
fn gpu_status() -> String {
    gpu_summary()
}

/// The tweet top-k queries of the benchmarks, as (name, SQL) pairs.
#[pyfunction]
fn tweet_queries() -> Vec<(String, String)> {
    QUERIES
        .iter()
        .map(|(name, sql)| (name.to_string(), sql.to_string()))
        .collect()
}

#[pymodule]
fn _internal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySessionContext>()?;
    m.add_class::<PyDataFrame>()?;
    m.add_function(wrap_pyfunction!(tweet_queries, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_status, m)?)?;
    m.add("DataFusionError", m.py().get_type::<DataFusionError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
