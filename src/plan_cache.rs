//! Reusing the physical plans of repeated SQL: [`PlanCache`].
//!
//! Planning a top-k query (parsing, the logical optimizer, the physical planner, our rule and
//! its cost model) takes about as long as a warm query on the GPU runs. An application that
//! issues the same statements again and again (a dashboard, a service answering the same
//! question for new requests, `EXECUTE` of a prepared statement) can pass them through a
//! `PlanCache`, which keeps each statement's physical plan, keyed by its text, and hands out a
//! fresh copy of it (its execution state reset) while nothing the plan was built from changed.
//!
//! A plan is reused only while all of these hold; otherwise the statement is planned again:
//! - the session's settings are the same object (DataFusion copies them on every `SET`), and
//!   so are its functions and runtime;
//! - every table the statement names resolves to the same provider;
//! - every table the plan scans has the same contents: an in-memory table the same batches, a
//!   listing table (Parquet, CSV, …) the same files with the same sizes and modification times,
//!   a [`GpuTable`] is immutable; a plan scanning any other kind of table is not kept;
//! - the device state the cost model read is unchanged: whether each column it asked about is
//!   resident and each program compiled (observed while planning, [`observe_planning`]), and
//!   the device's status, calibration and cache budget ([`planning_generation`]); so a plan
//!   that chose the CPU before its columns were resident is replaced once they are, while
//!   other tables' loads leave it be;
//! - the plan folds no time-dependent function (`now()`, `current_date`, …).
//!
//! The kept plan is never executed: each execution gets a copy with its state reset
//! ([`reset_plan_states`]). DataFusion's dynamic filters (its TopK's, a hash join's) are
//! recreated in the copy of their producer, which still prunes with them, but the scans keep
//! the kept plan's filter, which never changes: a reused plan reads what the scan reads
//! without them. Our operator's filter stays linked to its scans and is set back to passing
//! every row for each copy.
//!
//! Statements other than queries and `EXECUTE` (DDL, DML, `SET`, `EXPLAIN`) run as
//! [`SessionContext::sql`] runs them, every time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::array::RecordBatch;
use datafusion::catalog::TableProvider;
use datafusion::catalog::view::ViewTable;
use datafusion::common::TableReference;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::{MemTable, source_as_provider};
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, LogicalPlan, Statement, Volatility};
use datafusion::physical_plan::execution_plan::reset_plan_states;
use datafusion::physical_plan::{ExecutionPlan, collect, execute_stream};
use datafusion::prelude::SessionContext;
use futures::TryStreamExt;

use crate::device::{PlanningObservations, observe_planning, planning_generation};
use crate::input::gpu_table::GpuTable;

/// Statements kept by [`PlanCache::new`].
const DEFAULT_CAPACITY: usize = 128;

/// Physical plans of repeated SQL statements, reused while the tables, settings and device
/// state they were planned from are unchanged (the module's documentation lists the checks).
/// One cache may serve several sessions and threads.
///
/// ```no_run
/// # async fn run(ctx: datafusion::prelude::SessionContext) -> datafusion::error::Result<()> {
/// use datafusion_gpu_topk::PlanCache;
/// let plans = PlanCache::new();
/// for _ in 0..100 {
///     let sql = "SELECT id FROM tweets ORDER BY retweet_count DESC LIMIT 10";
///     let batches = plans.collect(&ctx, sql).await?; // planned once, then reused
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PlanCache {
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    capacity: usize,
    clock: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A statement's plan, ready to execute, from [`PlanCache::plan`].
#[derive(Debug, Clone)]
pub struct CachedPlan {
    plan: Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    reused: bool,
}

/// How a [`PlanCache`] has served so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanCacheStats {
    /// Statements answered with a kept plan.
    pub hits: u64,
    /// Statements planned (not kept, kept plans no longer valid, or planned for the first time).
    pub misses: u64,
    /// Plans kept now.
    pub entries: usize,
}

impl CachedPlan {
    /// The physical plan.
    pub fn plan(&self) -> &Arc<dyn ExecutionPlan> {
        &self.plan
    }

    /// Whether the plan is a kept one (no planning was done for it).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// Runs the plan to the end.
    pub async fn collect(self) -> Result<Vec<RecordBatch>> {
        collect(self.plan, self.task).await
    }

    /// Runs the plan, its partitions merged into one stream.
    pub fn execute_stream(self) -> Result<SendableRecordBatchStream> {
        execute_stream(self.plan, self.task)
    }
}

impl Default for PlanCache {
    fn default() -> Self {
        Self::new()
    }
}

impl PlanCache {
    /// A cache keeping the plans of up to 128 statements.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// A cache keeping the plans of up to `capacity` statements, the least recently used
    /// dropped first (0 keeps none).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            entries: Mutex::default(),
            capacity,
            clock: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Runs `sql` in `ctx` to the end, reusing its plan where it can.
    pub async fn collect(&self, ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>> {
        self.plan(ctx, sql).await?.collect().await
    }

    /// The plan of `sql` in `ctx`: a kept one, reset for another execution, where it is still
    /// valid, else a new one (kept where it can be). Statements other than queries and
    /// `EXECUTE` take effect here, as with [`SessionContext::sql`].
    pub async fn plan(&self, ctx: &SessionContext, sql: &str) -> Result<CachedPlan> {
        let found = self.lock().get(sql).cloned();
        if let Some(entry) = found {
            if entry.valid(ctx, sql).await {
                entry.last_use.store(self.tick(), Ordering::Relaxed);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(CachedPlan {
                    plan: reset_plan_states(Arc::clone(&entry.plan))?,
                    task: Arc::clone(&entry.task),
                    reused: true,
                });
            }
            self.lock().remove(sql);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let (planned, entry) = plan_statement(ctx, sql).await?;
        if let Some(entry) = entry.filter(|_| self.capacity > 0) {
            entry.last_use.store(self.tick(), Ordering::Relaxed);
            let mut entries = self.lock();
            if entries.len() >= self.capacity && !entries.contains_key(sql) {
                let oldest = entries
                    .iter()
                    .min_by_key(|(_, e)| e.last_use.load(Ordering::Relaxed))
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    entries.remove(&oldest);
                }
            }
            entries.insert(sql.to_string(), Arc::new(entry));
        }
        Ok(planned)
    }

    /// Counts of reuses and plannings, and the plans kept.
    pub fn stats(&self) -> PlanCacheStats {
        PlanCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.lock().len(),
        }
    }

    /// Drops every kept plan.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// A kept plan and what it was planned from.
#[derive(Debug)]
struct Entry {
    plan: Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    session: String,
    options: Arc<ConfigOptions>,
    functions: u64,
    runtime: usize,
    generation: u64,
    /// The columns' residency and the programs' compilation the cost model saw.
    observations: PlanningObservations,
    /// The tables the statement names, as they resolved.
    names: Vec<(TableReference, Arc<dyn TableProvider>)>,
    /// The tables the plan scans, with what they held.
    contents: Vec<Contents>,
    /// For `EXECUTE`, the prepared statement's plan with its parameters' values: the name may
    /// be deallocated and prepared again as another statement.
    executed: Option<LogicalPlan>,
    last_use: AtomicU64,
}

/// What a scanned table held when the plan was made.
#[derive(Debug)]
enum Contents {
    /// An in-memory table: its partitions' batches (held, so no new batch can take the
    /// address of a kept one).
    Memory(Arc<dyn TableProvider>, Vec<Vec<RecordBatch>>),
    /// A listing table: its files (path, size, modification time).
    Files(Arc<dyn TableProvider>, Vec<(String, u64, i64)>),
}

impl Entry {
    /// Whether the plan may still be used in `ctx` to run `sql`.
    async fn valid(&self, ctx: &SessionContext, sql: &str) -> bool {
        if planning_generation() != self.generation
            || ctx.session_id() != self.session
            || !self.observations.hold()
        {
            return false;
        }
        {
            let state = ctx.state_ref();
            let state = state.read();
            if !Arc::ptr_eq(state.config().options(), &self.options)
                || functions_fingerprint(&state) != self.functions
                || Arc::as_ptr(state.runtime_env()) as usize != self.runtime
            {
                return false;
            }
        }
        for (name, provider) in &self.names {
            match ctx.table_provider(name.clone()).await {
                Ok(now) if Arc::ptr_eq(&now, provider) => {}
                _ => return false,
            }
        }
        for contents in &self.contents {
            if !contents.unchanged(ctx).await {
                return false;
            }
        }
        match &self.executed {
            Some(kept) => matches!(executed_plan(ctx, sql).await, Ok(now) if &now == kept),
            None => true,
        }
    }
}

impl Contents {
    /// The contents of a scanned table, or `None` for a kind whose contents cannot be told.
    async fn of(ctx: &SessionContext, provider: &Arc<dyn TableProvider>) -> Option<Self> {
        let any = provider;
        if let Some(memory) = any.downcast_ref::<MemTable>() {
            let mut partitions = Vec::with_capacity(memory.batches.len());
            for partition in &memory.batches {
                partitions.push(partition.read().await.clone());
            }
            return Some(Contents::Memory(Arc::clone(provider), partitions));
        }
        if any.downcast_ref::<ListingTable>().is_some() {
            let files = list_files(ctx, provider).await?;
            return Some(Contents::Files(Arc::clone(provider), files));
        }
        None
    }

    async fn unchanged(&self, ctx: &SessionContext) -> bool {
        match self {
            Contents::Memory(provider, kept) => {
                let Some(memory) = provider.downcast_ref::<MemTable>() else {
                    return false;
                };
                for (partition, kept) in memory.batches.iter().zip(kept) {
                    let now = partition.read().await;
                    let same = now.len() == kept.len()
                        && now.iter().zip(kept).all(|(a, b)| same_batch(a, b));
                    if !same {
                        return false;
                    }
                }
                memory.batches.len() == kept.len()
            }
            Contents::Files(provider, kept) => {
                list_files(ctx, provider).await.as_ref() == Some(kept)
            }
        }
    }
}

/// Whether two batches are the same data (the same arrays), not merely equal.
fn same_batch(a: &RecordBatch, b: &RecordBatch) -> bool {
    a.num_rows() == b.num_rows()
        && a.num_columns() == b.num_columns()
        && a.columns()
            .iter()
            .zip(b.columns())
            .all(|(x, y)| Arc::ptr_eq(x, y))
}

/// A listing table's files, sorted; `None` where they cannot be listed.
async fn list_files(
    ctx: &SessionContext,
    provider: &Arc<dyn TableProvider>,
) -> Option<Vec<(String, u64, i64)>> {
    let listing = provider.downcast_ref::<ListingTable>()?;
    let state = ctx.state();
    let extension = &listing.options().file_extension;
    let mut files = Vec::new();
    for url in listing.table_paths() {
        let store = state.runtime_env().object_store(url).ok()?;
        let metas: Vec<_> = url
            .list_all_files(&state, store.as_ref(), extension)
            .await
            .ok()?
            .try_collect()
            .await
            .ok()?;
        files.extend(metas.into_iter().map(|m| {
            let modified = m.last_modified.timestamp_nanos_opt().unwrap_or(i64::MIN);
            (m.location.to_string(), m.size, modified)
        }));
    }
    files.sort_unstable();
    Some(files)
}

/// Identifies the session's functions: a function registered or replaced changes it.
fn functions_fingerprint(state: &datafusion::execution::SessionState) -> u64 {
    fn mix(seed: u64, address: usize) -> u64 {
        // Order-independent: the maps iterate in no fixed order.
        seed.wrapping_add(
            (address as u64 ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(0xff51_afd7_ed55_8ccd),
        )
    }
    let mut fingerprint = 0u64;
    for f in state.scalar_functions().values() {
        fingerprint = mix(fingerprint, Arc::as_ptr(f) as usize);
    }
    for f in state.aggregate_functions().values() {
        fingerprint = mix(fingerprint, Arc::as_ptr(f) as usize);
    }
    for f in state.window_functions().values() {
        fingerprint = mix(fingerprint, Arc::as_ptr(f) as usize);
    }
    fingerprint
}

/// The tables `sql` names and its logical plan, unoptimized, in the session's dialect.
async fn statement_plan(
    ctx: &SessionContext,
    sql: &str,
) -> Result<(Vec<TableReference>, LogicalPlan)> {
    let state = ctx.state();
    let dialect = state.config().options().sql_parser.dialect;
    let statement = state.sql_to_statement(sql, &dialect)?;
    let references = state.resolve_table_references(&statement)?;
    Ok((references, state.statement_to_plan(statement).await?))
}

/// Plans `sql` as [`SessionContext::sql`] would, and the entry that keeps the plan where it
/// may be reused.
async fn plan_statement(ctx: &SessionContext, sql: &str) -> Result<(CachedPlan, Option<Entry>)> {
    let (references, logical) = statement_plan(ctx, sql).await?;
    let execute = matches!(&logical, LogicalPlan::Statement(Statement::Execute(_)));
    let keepable = match &logical {
        LogicalPlan::Statement(Statement::Execute(_)) => true,
        LogicalPlan::Statement(_)
        | LogicalPlan::Ddl(_)
        | LogicalPlan::Dml(_)
        | LogicalPlan::Copy(_)
        | LogicalPlan::Explain(_)
        | LogicalPlan::Analyze(_)
        | LogicalPlan::DescribeTable(_) => false,
        _ => true,
    };
    if !keepable {
        let frame = ctx.sql(sql).await?;
        let task = Arc::new(frame.task_ctx());
        let plan = frame.create_physical_plan().await?;
        return Ok((
            CachedPlan {
                plan,
                task,
                reused: false,
            },
            None,
        ));
    }
    let frame = ctx.execute_logical_plan(logical).await?;
    let task = Arc::new(frame.task_ctx());
    let logical = frame.logical_plan().clone();
    let (options, functions, runtime) = {
        let state = ctx.state_ref();
        let state = state.read();
        (
            Arc::clone(state.config().options()),
            functions_fingerprint(&state),
            Arc::as_ptr(state.runtime_env()) as usize,
        )
    };
    let generation = planning_generation();
    let (plan, observations) = observe_planning(frame.create_physical_plan()).await;
    let plan = plan?;
    // The kept plan is never executed itself, only copies of it with their state reset: a
    // dynamic filter of DataFusion's (its TopK, a hash join) is replaced in the copy of its
    // producer while the scans keep the kept plan's, which no run ever updates.
    let planned = CachedPlan {
        plan: reset_plan_states(Arc::clone(&plan))?,
        task: Arc::clone(&task),
        reused: false,
    };
    let Some(contents) = scanned_contents(ctx, &logical).await else {
        return Ok((planned, None));
    };
    let mut names = Vec::with_capacity(references.len());
    for name in references {
        let Ok(provider) = ctx.table_provider(name.clone()).await else {
            return Ok((planned, None));
        };
        names.push((name, provider));
    }
    let entry = Entry {
        plan,
        task,
        session: ctx.session_id(),
        options,
        functions,
        runtime,
        generation,
        observations,
        names,
        contents,
        executed: execute.then_some(logical),
        last_use: AtomicU64::new(0),
    };
    Ok((planned, Some(entry)))
}

/// The plan an `EXECUTE` statement runs now: the prepared plan with the parameters' values.
async fn executed_plan(ctx: &SessionContext, sql: &str) -> Result<LogicalPlan> {
    let (_, logical) = statement_plan(ctx, sql).await?;
    Ok(ctx
        .execute_logical_plan(logical)
        .await?
        .logical_plan()
        .clone())
}

/// The contents of every table `plan` scans (views' tables included), or `None` where a plan
/// made from it could not be reused: a table whose contents cannot be told, a function whose
/// value depends on when the statement is planned.
async fn scanned_contents(ctx: &SessionContext, plan: &LogicalPlan) -> Option<Vec<Contents>> {
    let mut providers: Vec<Arc<dyn TableProvider>> = Vec::new();
    let mut pending = vec![plan.clone()];
    let mut reusable = true;
    while let Some(plan) = pending.pop() {
        plan.apply_with_subqueries(|node| {
            if let LogicalPlan::TableScan(scan) = node {
                match source_as_provider(&scan.source) {
                    Ok(provider) => match provider.downcast_ref::<ViewTable>() {
                        Some(view) => pending.push(view.logical_plan().clone()),
                        None => providers.push(provider),
                    },
                    Err(_) => reusable = false,
                }
            }
            node.apply_expressions(|expr| {
                expr.apply(|e| {
                    if let Expr::ScalarFunction(f) = e
                        && f.func.signature().volatility == Volatility::Stable
                    {
                        reusable = false;
                    }
                    Ok(TreeNodeRecursion::Continue)
                })
            })?;
            Ok(if reusable {
                TreeNodeRecursion::Continue
            } else {
                TreeNodeRecursion::Stop
            })
        })
        .ok()?;
        if !reusable {
            return None;
        }
    }
    let mut contents = Vec::with_capacity(providers.len());
    for provider in providers {
        if provider.downcast_ref::<GpuTable>().is_some() {
            continue;
        }
        contents.push(Contents::of(ctx, &provider).await?);
    }
    Some(contents)
}
