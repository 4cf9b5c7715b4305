//! [`GpuTopKExec`]: `ORDER BY … LIMIT k [OFFSET m]` fused with its filter, as one operator.
//!
//! The operator replaces DataFusion's `SortPreservingMergeExec` / `SortExec(TopK)` /
//! `GlobalLimitExec` (and the filter and column projection directly below them, see
//! [`crate::rule`]). It has one output partition and emits one sorted batch:
//!
//! 1. Every input partition is read concurrently (one task each, aborted when the stream is
//!    dropped, so the operator is cancellation-safe).
//! 2. Per batch: the fused predicate is evaluated (rows failing it go no further), then the
//!    sort-key expressions on the surviving rows. Rows get global row ids: partition, then
//!    position within the partition, which is the input order that ties are broken by.
//!    On the GPU with a generated program ([`crate::fusion`]) the batch goes to the device raw
//!    instead: the program evaluates predicate and keys and reports the rows it appended; the
//!    host evaluates only a predicate that does not translate.
//! 3. The key columns go to the selector ([`crate::select`]): CPU or GPU, chosen by
//!    [`crate::cost`]. It keeps the best `k` `(key, row id)` pairs and a running threshold.
//! 4. Late materialisation: only the output columns (and sort keys) of rows the selector admitted
//!    are kept (`row_store::RowStore`), and pruned as the selector evicts them.
//! 5. When the input ends, the winners' rows are gathered in order, `OFFSET` applied.
//!
//! The operator executes the plan the cost model made ([`TopKSpec::plan`]); it chooses
//! nothing, and owns only the fallbacks. Over a whole table (an in-memory `MemTable` or
//! [`crate::GpuTable`] whose columns the generated program reads, or a scan of Parquet files)
//! the device plan skips steps 1–4: the program runs once over every row, its columns read
//! from the device column cache (shipped into it on a miss), and only the winners' output
//! columns are gathered from the table's batches, or read from the files
//! (`stream::whole_table`, `parquet`). Where the columns do not fit the cache's budget, or
//! cannot be read as a table, the input streams as above. After a run on the CPU path whose
//! plan says so, the columns are loaded into the cache in the background, for the next query.
//!
//! A device error (or a row only the host gives DataFusion's outcome for) moves the selection to
//! the CPU mid-query without reading any input twice: a CPU selector takes over every retained
//! row (their sort keys are kept with them) and the batches of the failed push, and the other
//! partitions continue on the CPU path (`stream::Shared::fall_back`).
//!
//! The running threshold is published through a [`DynamicFilterPhysicalExpr`] that DataFusion's
//! `FilterPushdown(Post)` hands to the scans below, so they can skip row groups that cannot win.
//! The parts of a top-k split between devices share it: the best k-th key of any part goes to
//! every part's scans.
//! Memory for retained rows is reserved from DataFusion's memory pool.

mod aggregate_topk;
mod dynamic_filter;
mod group_topk;
mod metrics;
mod row_store;
mod stream;

pub use aggregate_topk::{
    AggregateBackend, AggregateCosting, AggregateDevicePlan, AggregateItem, AggregateKind,
    AggregateTopKSpec, AggregateWarmUp, GpuAggregateTopKExec, GroupKey,
};
use dynamic_filter::{Publisher, SharedThreshold};
pub use group_topk::{GpuGroupTopKExec, GroupCpuPlan, GroupDevicePlan, GroupWarmUp, RankFunction};

use std::fmt::{self, Formatter};
use std::sync::{Arc, Mutex};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::{Column, DynamicFilterPhysicalExpr, lit};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{
    ChildrenPropertiesMode, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::filter_pushdown::{
    ChildFilterDescription, ChildPushdownResult, FilterDescription, FilterPushdownPhase,
    FilterPushdownPropagation,
};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties, SendableRecordBatchStream,
};

use crate::config::FaultPoint;
use crate::cost::{InputForm, Prediction, SelectionChoice, SelectionPlan};
use crate::fusion::FusionPlan;
use crate::keys::KeyLayout;

/// Everything the rule decided about one top-k query. Expressions are over the input's schema.
#[derive(Debug, Clone)]
pub struct TopKSpec {
    pub sort_exprs: LexOrdering,
    /// The fused `WHERE` predicate, evaluated before the sort keys.
    pub filter: Option<Arc<dyn PhysicalExpr>>,
    /// One expression (a column or literal) per output column.
    pub output_exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// Rows to select: the query's fetch plus its offset.
    pub k: usize,
    /// Rows of the sorted result to skip (`OFFSET`).
    pub skip: usize,
    pub layout: KeyLayout,
    /// What the cost model decided: where, with which algorithm, over which input form, and
    /// whether the column cache is loaded after a run on the CPU path.
    pub plan: SelectionPlan,
    /// Why this backend, for EXPLAIN.
    pub reason: String,
    /// The cost model's prediction (with the GPU's calibration at hand).
    pub prediction: Option<Prediction>,
    /// Where the predicate and keys are evaluated when the selection runs on the GPU.
    pub fusion: FusionPlan,
    /// A device failure to inject (`gpu_topk.inject_fault`, for tests of the fallback).
    pub fault: FaultPoint,
    /// Most device bytes one execution's selection may hold (`gpu_topk.device_memory_limit`;
    /// 0: no limit).
    pub device_memory_limit: usize,
    /// One task's part of a distributed top-k: the engine merges the tasks' sorted outputs
    /// (and so may run this operator once per slice of its input).
    pub per_task: bool,
    /// The session's settings the operator was planned with: a worker plans it again with them.
    pub settings: crate::config::GpuTopKConfig,
    /// The device the selection runs on, where the rule split the input between devices
    /// (`None`: the process's device).
    pub device: Option<crate::device::DeviceSlot>,
}

/// Whether columns are being loaded into the column cache in the background after a run on
/// the CPU path (a plan's warm-up): a benchmark waits for it before timing the next query.
pub fn warming_up() -> bool {
    crate::input::loader::CacheLoader::busy()
}

impl TopKSpec {
    /// Whether the scans below may skip the rows the threshold rules out: only when nothing
    /// evaluated on a row can fail (every sort key a column, the filter made of comparisons of
    /// columns and literals). A row whose key or predicate fails (an overflow, a division by
    /// zero, a failing cast) must reach the operator, which then fails with DataFusion's
    /// error, whichever rows came first.
    pub fn scans_may_skip_rows(&self) -> bool {
        let keys = self
            .sort_exprs
            .iter()
            .all(|s| s.expr.downcast_ref::<Column>().is_some());
        keys && self
            .filter
            .as_ref()
            .is_none_or(crate::fusion::cannot_fail::predicate)
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct GpuTopKExec {
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
    metrics: ExecutionPlanMetricsSet,
    properties: Arc<PlanProperties>,
    /// Why the last execution left the GPU for the CPU path, if it did (EXPLAIN ANALYZE).
    fallback: Arc<Mutex<Option<String>>>,
    /// The threshold this operator shares with the other parts of a split top-k, if it is one.
    shared_threshold: Option<Arc<SharedThreshold>>,
    /// Why the aggregation below stays DataFusion's, where the rule would have taken it
    /// into a [`GpuAggregateTopKExec`] (EXPLAIN).
    aggregate_kept: Option<Arc<str>>,
}

impl GpuTopKExec {
    /// Builds the operator that replaces `replaced` (whose schema, ordering and equivalences
    /// it takes over: it yields the same rows in the same order).
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        spec: TopKSpec,
        replaced: &dyn ExecutionPlan,
    ) -> Result<Self> {
        let equivalences = replaced.properties().equivalence_properties().clone();
        Self::with_properties(input, spec, replaced.schema(), equivalences)
    }

    /// As [`Self::try_new`], with the output's schema and equivalences given.
    pub fn with_properties(
        input: Arc<dyn ExecutionPlan>,
        spec: TopKSpec,
        schema: SchemaRef,
        equivalences: datafusion::physical_expr::EquivalenceProperties,
    ) -> Result<Self> {
        if spec.output_exprs.len() != schema.fields().len() {
            return datafusion::common::internal_err!(
                "GpuTopKExec: {} output expressions for {} columns",
                spec.output_exprs.len(),
                schema.fields().len()
            );
        }
        let properties = PlanProperties::new(
            equivalences,
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            // The rule declines unbounded inputs; should one come through another way, the
            // sanity check still sees it.
            input.boundedness(),
        );
        let dynamic_filter = Arc::new(new_dynamic_filter(&spec.sort_exprs));
        Ok(Self {
            input,
            spec: Arc::new(spec),
            schema,
            dynamic_filter,
            metrics: ExecutionPlanMetricsSet::new(),
            properties: Arc::new(properties),
            fallback: Arc::default(),
            shared_threshold: None,
            aggregate_kept: None,
        })
    }

    /// Makes `parts` (operators over shares of one input, whose rows one merge ranks) share
    /// their threshold: the best k-th key of any part prunes every part's scans.
    pub(crate) fn share_threshold(mut parts: Vec<GpuTopKExec>) -> Vec<GpuTopKExec> {
        let filters = parts
            .iter()
            .map(|p| Arc::clone(&p.dynamic_filter))
            .collect();
        let shared = Arc::new(SharedThreshold::new(filters));
        for part in &mut parts {
            part.shared_threshold = Some(Arc::clone(&shared));
        }
        parts
    }

    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    pub fn spec(&self) -> &TopKSpec {
        &self.spec
    }

    /// Why the last execution moved from the GPU to the CPU path (a device error, the device
    /// memory limit, a failed compile), if it did.
    pub fn fallback_reason(&self) -> Option<String> {
        self.fallback.lock().ok().and_then(|r| r.clone())
    }

    /// The threshold filter this operator publishes to the scans below.
    pub fn dynamic_filter(&self) -> &Arc<DynamicFilterPhysicalExpr> {
        &self.dynamic_filter
    }

    fn with_input(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            input,
            spec: Arc::clone(&self.spec),
            schema: Arc::clone(&self.schema),
            // Kept across child replacement: the scans below hold this very filter.
            dynamic_filter: Arc::clone(&self.dynamic_filter),
            metrics: self.metrics.clone(),
            properties: Arc::clone(&self.properties),
            fallback: Arc::clone(&self.fallback),
            shared_threshold: self.shared_threshold.clone(),
            aggregate_kept: self.aggregate_kept.clone(),
        }
    }

    /// Why the aggregation below stays DataFusion's, where the rule says so.
    pub fn aggregate_kept(&self) -> Option<&str> {
        self.aggregate_kept.as_deref()
    }

    /// The operator showing in EXPLAIN why the aggregation below it stays DataFusion's.
    pub fn with_aggregate_kept(&self, why: &str) -> Self {
        let mut exec = self.with_input(Arc::clone(&self.input));
        exec.aggregate_kept = Some(why.into());
        exec
    }
}

fn new_dynamic_filter(sort_exprs: &LexOrdering) -> DynamicFilterPhysicalExpr {
    let first_key = Arc::clone(&sort_exprs.first().expr);
    DynamicFilterPhysicalExpr::new(vec![first_key], lit(true))
}

impl DisplayAs for GpuTopKExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut Formatter) -> fmt::Result {
        let spec = &self.spec;
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(
                    f,
                    "GpuTopKExec: k={}, skip={}, expr=[{}]",
                    spec.k, spec.skip, spec.sort_exprs
                )?;
                if let Some(filter) = &spec.filter {
                    write!(f, ", filter=[{filter}]")?;
                }
                let choice = spec.plan.choice();
                write!(f, ", key_bits={}", spec.layout.total_bits())?;
                if !spec.layout.exact() {
                    f.write_str(", ties=refined")?;
                }
                write!(
                    f,
                    ", backend={}, algorithm={}",
                    choice.backend(),
                    choice.algorithm()
                )?;
                let verbose = matches!(t, DisplayFormatType::Verbose);
                if let Some(prediction) = &spec.prediction {
                    write!(f, ", {}", prediction.describe(verbose))?;
                }
                if choice != SelectionChoice::Cpu {
                    write!(f, ", eval=[{}]", spec.fusion.describe(verbose))?;
                    if spec.plan.input() == InputForm::WholeTable {
                        f.write_str(", cache=on")?;
                    }
                }
                if spec.plan.warm_up() {
                    f.write_str(", cache=warm-up")?;
                }
                if spec.per_task {
                    f.write_str(", per_task")?;
                }
                if let Some(device) = spec.device {
                    write!(f, ", device={device}")?;
                }
                if verbose {
                    write!(f, ", reason=[{}]", spec.reason)?;
                }
                if let Ok(current) = self.dynamic_filter.current()
                    && !current.eq(&lit(true))
                {
                    write!(f, ", threshold=[{current}]")?;
                }
                if let Some(reason) = self.fallback_reason() {
                    write!(f, ", fell_back=[{reason}]")?;
                }
                if let Some(why) = &self.aggregate_kept {
                    write!(f, ", aggregate=[DataFusion's: {why}]")?;
                }
                Ok(())
            }
            DisplayFormatType::TreeRender => {
                writeln!(f, "{}", spec.sort_exprs)?;
                writeln!(
                    f,
                    "limit={} skip={}",
                    spec.k - spec.skip.min(spec.k),
                    spec.skip
                )?;
                writeln!(f, "backend={}", spec.plan.choice())?;
                if let Some(prediction) = &spec.prediction {
                    writeln!(f, "{}", prediction.describe(false))?;
                }
                Ok(())
            }
        }
    }
}

impl ExecutionPlan for GpuTopKExec {
    fn name(&self) -> &str {
        "GpuTopKExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        let spec = &self.spec;
        let dynamic: Arc<dyn PhysicalExpr> = self.dynamic_filter.clone();
        let exprs = spec
            .sort_exprs
            .iter()
            .map(|s| &s.expr)
            .chain(spec.filter.iter())
            .chain(spec.output_exprs.iter())
            .chain(std::iter::once(&dynamic));
        for expr in exprs {
            if f(expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn dynamic_expressions_produced(&self) -> Vec<Arc<dyn PhysicalExpr>> {
        vec![self.dynamic_filter.clone()]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return datafusion::common::internal_err!("GpuTopKExec takes exactly one child");
        }
        // Our properties come from the replaced subtree's output, which a new child (e.g. a scan
        // with a pushed-down filter) does not change.
        Ok(Arc::new(self.with_input(children.swap_remove(0))))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        // The scans below hold this very filter, so it is set back to passing every row rather
        // than replaced: the next execution (a recursive query's next round, a reused plan)
        // must neither prune by the last run's threshold nor lose the pushdown.
        self.dynamic_filter.update(lit(true))?;
        if let Some(shared) = &self.shared_threshold {
            shared.reset();
        }
        let mut fresh = self.with_input(Arc::clone(&self.input));
        fresh.metrics = ExecutionPlanMetricsSet::new();
        fresh.fallback = Arc::default();
        Ok(Arc::new(fresh))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return datafusion::common::internal_err!(
                "GpuTopKExec has one output partition, asked for {partition}"
            );
        }
        // A coalesce below is a distributed engine's stage boundary (the rule drops it
        // otherwise): its input's partitions are read in order, so that ties stay in order.
        let input = match self.input.downcast_ref::<CoalescePartitionsExec>() {
            Some(coalesce) if coalesce.fetch().is_none() => Arc::clone(coalesce.input()),
            _ => Arc::clone(&self.input),
        };
        stream::execute(
            input,
            Arc::clone(&self.spec),
            Arc::clone(&self.schema),
            Publisher {
                own: Arc::clone(&self.dynamic_filter),
                shared: self.shared_threshold.clone(),
            },
            &self.metrics,
            Arc::clone(&self.fallback),
            context,
        )
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn fetch(&self) -> Option<usize> {
        Some(self.spec.k - self.spec.skip.min(self.spec.k))
    }

    fn gather_filters_for_pushdown(
        &self,
        phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        // Filters from above must stay above a LIMIT; our own threshold goes down.
        let mut child = ChildFilterDescription::all_unsupported(&parent_filters);
        if phase == FilterPushdownPhase::Post
            && config.optimizer.enable_topk_dynamic_filter_pushdown
        {
            child = child.with_self_filter(self.dynamic_filter.clone());
        }
        Ok(FilterDescription::new().with_child(child))
    }

    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        Ok(FilterPushdownPropagation::if_all(child_pushdown_result))
    }
}
