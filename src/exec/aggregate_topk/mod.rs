//! [`GpuAggregateTopKExec`]: `GROUP BY … ORDER BY … LIMIT k [OFFSET m]`, the top k groups of an
//! aggregation, as one operator.
//!
//! DataFusion plans such a query as an aggregation of every group followed by a TopK over
//! the groups. The rule ([`crate::rule`]) replaces the whole subtree:
//!
//! ```text
//! [GlobalLimitExec skip=m]
//!   [SortPreservingMergeExec fetch=k+m]
//!     [ProjectionExec]
//!       SortExec TopK fetch=k+m                      ═▶   GpuAggregateTopKExec k, offset,
//!         [ProjectionExec]                                  keys, aggregates, filter, order
//!           [FilterExec HAVING]                               (DataFusion's subtree, kept)
//!             AggregateExec Final | FinalPartitioned | Single
//!               [RepartitionExec hash | CoalescePartitionsExec]
//!                 [AggregateExec Partial]
//!                   [FilterExec WHERE]
//!                     scan (in-memory table, GpuTable, Parquet, CSV)
//! ```
//!
//! (`COUNT(DISTINCT x)`, which DataFusion plans as a second aggregation by the keys and `x`
//! below the first, is taken too.)
//!
//! # Algorithm
//!
//! What the operator computes is described by its [`AggregateTopKSpec`]: a pass over the
//! table evaluates the fused filter, the group keys and the aggregates' inputs, and folds each
//! passing row into its group's accumulators (a hash table of the groups, `NULL` a key of its
//! own); the groups' final values go through `HAVING` and the output projection, and a
//! selection by the query's order keeps the best `k` groups, of which the first `offset` are
//! dropped. Only those rows leave the operator.
//!
//! # Structure
//!
//! The operator keeps DataFusion's own subtree, from the top of the TopK down, as its child,
//! and takes over its schema, partitioning, order and boundedness. The CPU path executes that
//! subtree: its rows, columns, types and errors are DataFusion's. The device path
//! ([`AggregateDevicePlan`], its own module) computes a narrower set of shapes on the GPU in
//! one call, and runs the subtree where the device fails or declines. EXPLAIN shows the spec,
//! the groups the rule estimated from a sample of the table (`groups≈N`; `groups=?` where it
//! could not), the backend and why it was chosen, and what the cost model weighed
//! (`predicted_cpu=…, predicted_gpu=…, predicted_gpu_warm=…`); on the device the algorithm
//! (a hash aggregation, then the selection among the groups), and in EXPLAIN ANALYZE the
//! device's time in each (`device_aggregate_time`, `device_select_time`). Where the device
//! would win only with the columns resident, the CPU path runs and loads them into the column
//! cache after it ([`AggregateWarmUp`], `cache=warm-up` in EXPLAIN), for the next run.

mod device;

use std::fmt::{self, Formatter};
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::memory::MemoryStream;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, SendableRecordBatchStream,
};
use futures::{StreamExt, TryStreamExt};

use crate::device::DeviceSlot;
use crate::fusion::FusedProgram;

pub use device::AggregateDevicePlan;

/// One aggregate function the operator computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggregateKind {
    /// `COUNT(*)`: the rows of the group.
    CountStar,
    /// `COUNT(x)`: the group's rows where `x` is not NULL.
    Count,
    /// `COUNT(DISTINCT x)`: the distinct non-NULL values of `x` in the group.
    CountDistinct,
    Sum,
    Min,
    Max,
    Avg,
}

impl AggregateKind {
    pub fn name(self) -> &'static str {
        match self {
            AggregateKind::CountStar => "count_star",
            AggregateKind::Count => "count",
            AggregateKind::CountDistinct => "count_distinct",
            AggregateKind::Sum => "sum",
            AggregateKind::Min => "min",
            AggregateKind::Max => "max",
            AggregateKind::Avg => "avg",
        }
    }
}

/// A group key: its expression over the table's columns, its name and type in the
/// aggregation's output.
#[derive(Debug, Clone)]
pub struct GroupKey {
    pub expr: Arc<dyn PhysicalExpr>,
    pub name: String,
    pub data_type: DataType,
}

/// An aggregate: what it computes, over which input, into which type.
#[derive(Debug, Clone)]
pub struct AggregateItem {
    pub kind: AggregateKind,
    /// Its argument over the table's columns (`None` for `COUNT(*)`).
    pub input: Option<Arc<dyn PhysicalExpr>>,
    /// The argument's type (`None` for `COUNT(*)`).
    pub input_type: Option<DataType>,
    /// The type DataFusion outputs (`Int64` for counts, `Float64` for an integer `AVG`, …).
    pub output_type: DataType,
    /// Over the argument's distinct values (`COUNT(DISTINCT x)`).
    pub distinct: bool,
    /// Its column name in the aggregation's output.
    pub name: String,
}

/// Everything the rule translated of one top-k over an aggregate (see the module
/// documentation).
///
/// Two schemas: the group keys, the aggregates' inputs and `filter` are over the columns of
/// `table`; `having`, `order` and `output` are over the aggregation's output, the group keys
/// then the aggregates, in the order of `group_keys` and `aggregates`.
#[derive(Debug, Clone)]
pub struct AggregateTopKSpec {
    /// The scan the operator reads (an in-memory table, a `GpuTable`, Parquet or CSV files).
    pub table: Arc<dyn ExecutionPlan>,
    pub group_keys: Vec<GroupKey>,
    pub aggregates: Vec<AggregateItem>,
    /// The `WHERE` predicate evaluated before the aggregation, fused into the pass.
    pub filter: Option<Arc<dyn PhysicalExpr>>,
    /// The `HAVING` predicate, evaluated on each group's final values.
    pub having: Option<Arc<dyn PhysicalExpr>>,
    /// The query's order over the groups, with each key's direction and NULL placement.
    pub order: LexOrdering,
    /// Each output column: its expression and name.
    pub output: Vec<(Arc<dyn PhysicalExpr>, String)>,
    /// Groups to select: the query's fetch plus its offset.
    pub k: usize,
    /// Groups of the sorted result dropped first (`OFFSET`).
    pub offset: usize,
}

impl AggregateTopKSpec {
    /// The aggregates as EXPLAIN lists them: `count_star`, `sum(v@2)`, `count_distinct(s@1)`.
    fn describe_aggregates(&self) -> String {
        let items: Vec<String> = (self.aggregates.iter())
            .map(|a| match &a.input {
                Some(input) => format!("{}({input})", a.kind.name()),
                None => a.kind.name().to_string(),
            })
            .collect();
        items.join(", ")
    }
}

/// Where the operator runs, and why (EXPLAIN).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AggregateBackend {
    /// DataFusion's subtree, for this reason.
    Cpu(String),
    /// The device, by this plan (DataFusion's subtree where it fails or declines).
    Cuda(Arc<AggregateDevicePlan>),
}

/// What the rule estimated and the cost model weighed for the operator (EXPLAIN), and the
/// load of the column cache after a CPU run.
#[derive(Debug, Clone, Default)]
pub struct AggregateCosting {
    /// The groups of the keys the rule estimated from a sample of the table (`None`: unknown).
    pub groups: Option<usize>,
    /// What the cost model weighed, as EXPLAIN shows it (`predicted_cpu=…, predicted_gpu=…`).
    pub weighed: Option<String>,
    /// Why the device (EXPLAIN VERBOSE; the CPU path's reason is its backend's).
    pub reason: Option<String>,
    /// The columns loaded after a CPU run, where the device would win the next one with them.
    pub warm_up: Option<AggregateWarmUp>,
}

/// What a CPU run's warm-up loads: the table's columns the device path reads (the program's
/// inputs), into the column cache of `device` (started in the background where it is not).
#[derive(Debug, Clone)]
pub struct AggregateWarmUp {
    pub program: Arc<FusedProgram>,
    pub device: DeviceSlot,
}

impl AggregateWarmUp {
    /// Starts loading `table`'s columns in the background (one load at a time; one that does
    /// not fit the budget, or fails, leaves the cache as it was).
    fn start(&self, table: Arc<dyn ExecutionPlan>, context: Arc<TaskContext>) {
        use crate::input::loader::{CacheLoader, load_inputs};
        let program = Arc::clone(&self.program);
        CacheLoader::spawn(self.device, move |loader| async move {
            if let Err(e) = load_inputs(&table, &context, &program, &loader, false).await {
                log::debug!("gpu-topk: the columns were not loaded into the cache: {e}");
            }
        });
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct GpuAggregateTopKExec {
    /// DataFusion's plan of the query, from the top of its TopK down.
    plan: Arc<dyn ExecutionPlan>,
    spec: Arc<AggregateTopKSpec>,
    backend: AggregateBackend,
    costing: AggregateCosting,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl GpuAggregateTopKExec {
    /// The operator in place of `plan` (DataFusion's TopK over the aggregation), computing
    /// `spec` on `backend`. It takes over `plan`'s schema and properties.
    pub fn new(
        plan: Arc<dyn ExecutionPlan>,
        spec: AggregateTopKSpec,
        backend: AggregateBackend,
    ) -> Self {
        Self {
            properties: Arc::clone(plan.properties()),
            plan,
            spec: Arc::new(spec),
            backend,
            costing: AggregateCosting::default(),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The operator with what the rule estimated and the cost model weighed.
    pub fn with_costing(mut self, costing: AggregateCosting) -> Self {
        self.costing = costing;
        self
    }

    pub fn spec(&self) -> &AggregateTopKSpec {
        &self.spec
    }

    pub fn costing(&self) -> &AggregateCosting {
        &self.costing
    }

    pub fn backend(&self) -> &AggregateBackend {
        &self.backend
    }

    /// DataFusion's subtree the CPU path runs.
    pub fn plan(&self) -> &Arc<dyn ExecutionPlan> {
        &self.plan
    }
}

impl DisplayAs for GpuAggregateTopKExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut Formatter) -> fmt::Result {
        let spec = &self.spec;
        let keys: Vec<String> = (spec.group_keys.iter())
            .map(|g| g.expr.to_string())
            .collect();
        write!(
            f,
            "GpuAggregateTopKExec: k={}, offset={}, keys=[{}], aggregates=[{}], order=[{}]",
            spec.k,
            spec.offset,
            keys.join(", "),
            spec.describe_aggregates(),
            spec.order
        )?;
        if let Some(filter) = &spec.filter {
            write!(f, ", filter=[{filter}]")?;
        }
        if let Some(having) = &spec.having {
            write!(f, ", having=[{having}]")?;
        }
        match self.costing.groups {
            Some(groups) => write!(f, ", groups≈{groups}")?,
            None => f.write_str(", groups=?")?,
        }
        let costing = &self.costing;
        match &self.backend {
            AggregateBackend::Cpu(reason) => write!(f, ", backend=cpu, reason=[{reason}]")?,
            AggregateBackend::Cuda(plan) => write!(
                f,
                ", backend=cuda, algorithm=hash, selection={}",
                plan.selection.name()
            )?,
        }
        if let Some(weighed) = &costing.weighed {
            write!(f, ", {weighed}")?;
        }
        if costing.warm_up.is_some() && matches!(self.backend, AggregateBackend::Cpu(_)) {
            f.write_str(", cache=warm-up")?;
        }
        match &costing.reason {
            Some(reason) if matches!(t, DisplayFormatType::Verbose) => {
                write!(f, ", reason=[{reason}]")
            }
            _ => Ok(()),
        }
    }
}

impl ExecutionPlan for GpuAggregateTopKExec {
    fn name(&self) -> &str {
        "GpuAggregateTopKExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.plan]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for sort in self.spec.order.iter() {
            if f(&sort.expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
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
            return datafusion::common::internal_err!(
                "GpuAggregateTopKExec takes exactly one child"
            );
        }
        let plan = children.swap_remove(0);
        Ok(Arc::new(Self {
            properties: Arc::clone(plan.properties()),
            plan,
            spec: Arc::clone(&self.spec),
            backend: self.backend.clone(),
            costing: self.costing.clone(),
            metrics: ExecutionPlanMetricsSet::new(),
        }))
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

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let plan = match &self.backend {
            AggregateBackend::Cpu(_) => return self.cpu_run(partition, context),
            AggregateBackend::Cuda(plan) => Arc::clone(plan),
        };
        if partition != 0 {
            return datafusion::common::internal_err!(
                "GpuAggregateTopKExec on the device has one partition, asked for {partition}"
            );
        }
        let metrics = device::DeviceMetrics::new(&self.metrics);
        let (spec, subtree, schema) = (
            Arc::clone(&self.spec),
            Arc::clone(&self.plan),
            self.schema(),
        );
        let output = Arc::clone(&schema);
        let run = async move {
            match device::run(&spec, &plan, Arc::clone(&output), &metrics) {
                Ok(Some(batch)) => {
                    let stream = MemoryStream::try_new(vec![batch], output, None)?;
                    Ok(Box::pin(stream) as SendableRecordBatchStream)
                }
                outcome => {
                    if let Err(e) = outcome {
                        log::warn!("gpu-topk: the device's aggregation failed: {e}");
                    }
                    // DataFusion's answer, after a device failure or where the device declined.
                    metrics.gpu_fallbacks.add(1);
                    subtree.execute(partition, context)
                }
            }
        };
        let stream = futures::stream::once(run).try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

impl GpuAggregateTopKExec {
    /// DataFusion's subtree, followed by the plan's warm-up, if any, once its rows are out.
    fn cpu_run(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let rows = self.plan.execute(partition, Arc::clone(&context))?;
        let Some(warm_up) = self.costing.warm_up.clone() else {
            return Ok(rows);
        };
        let table = Arc::clone(&self.spec.table);
        let after = futures::stream::once(async move {
            warm_up.start(table, context);
            None
        })
        .filter_map(futures::future::ready);
        let stream = rows.chain(after);
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            stream,
        )))
    }
}
