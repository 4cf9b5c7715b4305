//! [`GpuGroupTopKExec`]: top-k per group, `ROW_NUMBER()`, `RANK()` or `DENSE_RANK()` `OVER (PARTITION BY g…
//! ORDER BY k…)` filtered by `<= K`, as one operator.
//!
//! DataFusion plans such a query as a sort of the whole input by the group and order keys, a
//! window that numbers every row, and a filter that keeps K rows per group. The rule
//! ([`crate::rule`]) replaces the sort and the window:
//!
//! ```text
//! FilterExec rn <= K                                FilterExec rn <= K
//!   BoundedWindowAggExec ROW_NUMBER() …    ═▶         GpuGroupTopKExec K, sort order
//!     SortExec g…, k…                                    input
//!       input
//! ```
//!
//! Each output partition reads its input partition (all of them where the sort merged them
//! into one) and keeps the K best rows of every group as they arrive: a bounded max-heap per
//! group of (the row's sort key in arrow's row format, its position in the input), so a row
//! that cannot be among its group's K best is dropped at once and only K rows a group are held,
//! with the batches they point into. When the input ends it emits the kept rows in the sort's
//! order with their row numbers: the rows, columns and values the window would have given, in
//! the same partitions and order (the filter above stays, and passes them all). Rows whose keys
//! tie are numbered in input order, where DataFusion's sort leaves their order unspecified.
//! Under `RANK()` a group also keeps the rows whose key ties its K-th kept row's (they share
//! its rank), so it may return more than K rows; under `DENSE_RANK()` it keeps every row of
//! its K smallest distinct keys (an ordered map of at most K keys a group, each with its
//! rows).
//! On the CPU path held batches are reserved from DataFusion's memory pool.
//!
//! **On the GPU** ([`GroupDevicePlan`], where the rule found a whole in-memory table below the
//! hash repartition, with a filter and keys its generated code evaluates): a segmented sort.
//! The program's pass appends every passing row's composite key, the group keys in its high
//! bits and the order keys below, with the row's position in the table; the pairs are sorted on
//! the device, and the thread at each group's first pair walks the group and keeps its K best
//! rows with their numbers (kernels/groups.cu), written in sorted order. Where the column cache
//! holds every table column the output reads as fixed-width values (the group and order keys,
//! and the filter's columns, are there already), the device gathers the kept rows' values and
//! the host reads back those columns and numbers in pieces, building each piece's batches on
//! every core while the next crosses PCIe. The batches' arrays are slices of the pinned buffer
//! a piece arrived in, which goes back to the pool when they are dropped (up to
//! `gpu_topk.pinned_output_bytes`; pieces past it are copied out). Otherwise it reads back the
//! kept positions and gathers their rows from the table. Either way the host hashes the rows
//! into the window's output partitions as the repartition below would have, where an operator
//! above needs that partitioning; else it deals runs of rows in sort order to the partitions in
//! turn. Every output partition waits for that one run.
//!
//! The operator also takes the place of a projection of columns over the window (the rule
//! passes it with [`GpuGroupTopKExec::with_projection`]), and then outputs only those columns:
//! the device gathers and reads back only them. Ties are broken by table position,
//! deterministic whatever the arrival order. Any device failure runs the CPU path instead.
//!
//! Which pairs are sorted is the cost model's choice ([`GroupAlgorithm`]), by the number of
//! groups the rule estimates from a sample of the table (EXPLAIN shows it as `groups≈`) and
//! K: over many small groups all of them (`segmented-sort`); over few large groups only those
//! at or below their group's limit, the K-th key of a sample of the pairs (`group-threshold`),
//! a few thousand pairs where the table has millions; at K = 1 only those that equal their
//! group's smallest composite, found by atomic minima in a hash table of the groups
//! (`group-min`). Group and order keys are the top-k
//! operator's exact keys, and strings (or dictionaries of them) whose every value is at most
//! 16 bytes, none ending in a zero byte, compared by their bytes in the composite.
//!
//! Whether the device runs at all is the cost model's choice too (`gpu_topk.backend =
//! 'auto'`): the CPU path's calibrated time against the device's, for this run and for a warm
//! one (columns resident, program compiled). Where only a warm run would win, the CPU path
//! runs ([`GroupCpuPlan`]) and, once every output partition has ended it, the program is
//! compiled and the table's columns loaded into the column cache in the background
//! ([`GroupWarmUp`], `cache=warm-up` in EXPLAIN), starting the device where it is not, so that
//! the next run of the shape goes to the device. EXPLAIN shows the times weighed.
//!
//! # Structure
//!
//! This module holds the plan node. `device` runs the selection on the GPU (`DeviceRun`),
//! with the whole-table selector it gets from `crate::select::create_selector`, the top-k
//! operator's entry point, for the cost model's decision (the device, and the selector's
//! algorithm, that [`GroupDevicePlan`] carries). `heap` is the CPU path (`GroupHeaps`): it
//! streams the input into `crate::select::groups`, a bounded heap per group, which the CPU
//! calibration times too.

mod device;
mod heap;
#[cfg(test)]
mod tests;

use std::fmt::{self, Formatter};
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties, SendableRecordBatchStream,
};
use futures::{FutureExt, StreamExt};

use self::device::{DeviceMetrics, DeviceRun};
use self::heap::GroupHeaps;
use crate::config::FaultPoint;
use crate::cost::Prediction;
use crate::device::{DeviceAlgorithm, DeviceSlot, GroupAlgorithm};
use crate::fusion::FusedProgram;
use crate::keys::KeyLayout;
pub use crate::select::groups::RankFunction;

/// The device side of a per-group top-k over a whole in-memory table (see the module
/// documentation), as the rule planned it.
#[derive(Debug)]
pub struct GroupDevicePlan {
    /// The in-memory table the program reads (below the filter and projections it absorbed).
    pub table: Arc<dyn ExecutionPlan>,
    /// The program: the predicate, and the composite of the group keys then the order keys.
    pub program: Arc<FusedProgram>,
    pub layout: KeyLayout,
    /// The composite's lowest bit of the group keys.
    pub lo: u32,
    /// The operator's input columns as expressions over the table's.
    pub output_exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// How the device finds each group's best rows, as the cost model chose.
    pub algorithm: GroupAlgorithm,
    /// The algorithm the whole-table selector is built with, as the cost model chose (its
    /// groups' step is `algorithm`).
    pub selector_algorithm: DeviceAlgorithm,
    /// The device the cost model weighed, which runs the selection.
    pub device: DeviceSlot,
    /// Why the GPU (EXPLAIN VERBOSE), and the model's prediction.
    pub reason: String,
    pub prediction: Option<Prediction>,
    /// What the cost model weighed, as EXPLAIN shows it (`predicted_cpu=…, predicted_gpu=…`).
    pub weighed: Option<String>,
    /// A device failure to inject (`gpu_topk.inject_fault`).
    pub fault: FaultPoint,
    /// `gpu_topk.device_memory_limit`.
    pub device_memory_limit: usize,
    /// `gpu_topk.pinned_output_bytes`.
    pub pinned_output_bytes: usize,
}

/// The CPU path of a per-group top-k as the rule planned it: why, what the cost model weighed,
/// and the load of the column cache after the run.
#[derive(Debug, Default)]
pub struct GroupCpuPlan {
    /// Why the CPU path (EXPLAIN VERBOSE).
    pub reason: String,
    /// What the cost model weighed, as EXPLAIN shows it (`predicted_cpu=…, predicted_gpu=…`).
    pub weighed: Option<String>,
    /// The columns loaded after the run, where the device would win the next one with them.
    pub warm_up: Option<GroupWarmUp>,
}

/// What a CPU run's warm-up loads: the program the device would run, compiled, and the
/// table's columns it reads, in the column cache of `device` (started in the background
/// where it is not).
#[derive(Debug)]
pub struct GroupWarmUp {
    /// The in-memory table the program reads.
    pub table: Arc<dyn ExecutionPlan>,
    pub program: Arc<FusedProgram>,
    pub device: DeviceSlot,
}

impl GroupCpuPlan {
    /// Starts the plan's warm-up in the background, if any (one load at a time; one that does
    /// not fit the budget, or fails, leaves the cache as it was).
    fn start_warm_up(self: Arc<Self>, context: Arc<TaskContext>) {
        use crate::input::loader::{CacheLoader, load_inputs};
        let Some(device) = self.warm_up.as_ref().map(|w| w.device) else {
            return;
        };
        CacheLoader::spawn(device, move |loader| async move {
            let Some(warm) = self.warm_up.as_ref() else {
                return;
            };
            // The next run's plan counts a compile the program still needs.
            if let Err(e) = loader.compile(&warm.program) {
                log::debug!("gpu-topk: the generated program did not compile: {e}");
            }
            if let Err(e) = load_inputs(&warm.table, &context, &warm.program, &loader, false).await
            {
                log::debug!("gpu-topk: the columns were not loaded into the cache: {e}");
            }
        });
    }
}

/// The device run's output partitions, shared by every output partition's stream; `None`:
/// the CPU path runs instead.
type SharedDeviceRun = Arc<tokio::sync::OnceCell<Option<Arc<Vec<Vec<RecordBatch>>>>>>;

/// See the module documentation.
#[derive(Debug)]
pub struct GpuGroupTopKExec {
    input: Arc<dyn ExecutionPlan>,
    function: RankFunction,
    /// The replaced sort's order: the group keys first, then the window's order keys.
    ordering: LexOrdering,
    /// How many of `ordering`'s leading keys are the group keys.
    group_keys: usize,
    /// Rows kept per group.
    k: usize,
    /// Each output column's place among the window's columns (the input's, then the number).
    columns: Vec<usize>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
    /// The GPU plan, where the rule placed the selection there.
    device: Option<Arc<GroupDevicePlan>>,
    /// The CPU path's plan, where the selection is not on the GPU.
    cpu: Arc<GroupCpuPlan>,
    /// The output partitions whose CPU run has not ended: the last to end starts the plan's
    /// warm-up.
    cpu_running: Arc<std::sync::atomic::AtomicUsize>,
    /// The groups among the rows that pass, estimated at planning where the input is an
    /// in-memory table (EXPLAIN shows it).
    groups: Option<usize>,
    shared: SharedDeviceRun,
}

impl GpuGroupTopKExec {
    /// The operator in place of `window` (a `ROW_NUMBER()` window whose output is `input`'s
    /// columns and the row number) over a sort by `ordering` of `input`, its first
    /// `group_keys` keys the `PARTITION BY` keys. It takes over the window's schema,
    /// partitioning, order and equivalences.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        function: RankFunction,
        ordering: LexOrdering,
        group_keys: usize,
        k: usize,
        window: &dyn ExecutionPlan,
    ) -> Result<Self> {
        let schema = window.schema();
        if schema.fields().len() != input.schema().fields().len() + 1 {
            return datafusion::common::internal_err!(
                "GpuGroupTopKExec: a window of {} columns over an input of {}",
                schema.fields().len(),
                input.schema().fields().len()
            );
        }
        if group_keys > ordering.len() {
            return datafusion::common::internal_err!(
                "GpuGroupTopKExec: {group_keys} group keys in an order of {}",
                ordering.len()
            );
        }
        Ok(Self {
            columns: (0..schema.fields().len()).collect(),
            input,
            function,
            ordering,
            group_keys,
            k,
            schema,
            properties: Arc::clone(window.properties()),
            metrics: ExecutionPlanMetricsSet::new(),
            device: None,
            cpu: Arc::default(),
            cpu_running: Arc::new(window.output_partitioning().partition_count().into()),
            groups: None,
            shared: SharedDeviceRun::default(),
        })
    }

    /// The operator in place of `projection`, a projection of columns over it: it outputs
    /// only those columns, with the projection's schema, partitioning and order. Where the
    /// projection drops a group key, the output's partitioning is unknown and the device run
    /// spreads the kept rows over the partitions without hashing them.
    pub fn with_projection(self, projection: &ProjectionExec) -> Result<Self> {
        let picks = (projection.expr().iter())
            .map(|e| e.expr.downcast_ref::<Column>().map(Column::index))
            .collect::<Option<Vec<_>>>();
        match picks {
            Some(picks) => self.in_place_of(projection, Some(&picks)),
            None => datafusion::common::internal_err!(
                "GpuGroupTopKExec: a projection of other than its columns"
            ),
        }
    }

    /// The operator in place of `filter` over it, whose predicate every row it keeps passes
    /// (a bound on the number at K or above): it outputs the filter's columns, with the
    /// filter's schema and properties.
    pub fn in_place_of_filter(self, filter: &FilterExec) -> Result<Self> {
        let picks = filter.projection().as_ref().map(|p| p.to_vec());
        self.in_place_of(filter, picks.as_deref())
    }

    /// The operator in place of `above`, an operator over it that outputs its columns
    /// `picks` (all where `None`), with `above`'s schema and properties.
    fn in_place_of(mut self, above: &dyn ExecutionPlan, picks: Option<&[usize]>) -> Result<Self> {
        let over = above.children().first().map(|c| c.schema().fields().len());
        if over != Some(self.schema.fields().len()) {
            return datafusion::common::internal_err!(
                "GpuGroupTopKExec: {} over another schema",
                above.name()
            );
        }
        if let Some(picks) = picks {
            let columns = (picks.iter())
                .map(|&i| self.columns.get(i).copied())
                .collect::<Option<Vec<_>>>();
            let Some(columns) = columns else {
                return datafusion::common::internal_err!(
                    "GpuGroupTopKExec: {} picks past its columns",
                    above.name()
                );
            };
            self.columns = columns;
        }
        self.schema = above.schema();
        self.properties = Arc::clone(above.properties());
        let outputs = self.properties.output_partitioning().partition_count();
        self.cpu_running = Arc::new(outputs.into());
        Ok(self)
    }

    /// The operator claiming no partitioning of its output where it claims the window's
    /// hash partitioning (for when no operator above needs it): the device run then spreads
    /// the kept rows over the partitions without hashing them. `None` where it claims none.
    pub fn without_hash_partitioning(&self) -> Option<Self> {
        let Partitioning::Hash(_, count) = self.properties.output_partitioning() else {
            return None;
        };
        let unknown = Partitioning::UnknownPartitioning(*count);
        let mut exec = self.copy_over(Arc::clone(&self.input));
        exec.properties = Arc::new(self.properties.as_ref().clone().with_partitioning(unknown));
        Some(exec)
    }

    /// The operator over `input`, with fresh metrics and no run shared with this one.
    fn copy_over(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            input,
            function: self.function,
            ordering: self.ordering.clone(),
            group_keys: self.group_keys,
            k: self.k,
            columns: self.columns.clone(),
            schema: Arc::clone(&self.schema),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
            device: self.device.clone(),
            cpu: Arc::clone(&self.cpu),
            cpu_running: Arc::new(
                self.properties
                    .output_partitioning()
                    .partition_count()
                    .into(),
            ),
            groups: self.groups,
            shared: SharedDeviceRun::default(),
        }
    }

    /// The operator with the planner's estimate of the number of groups.
    pub fn with_groups_estimate(mut self, groups: Option<usize>) -> Self {
        self.groups = groups;
        self
    }

    /// The operator selecting on the GPU by `plan`.
    pub fn with_device(mut self, plan: GroupDevicePlan) -> Self {
        self.device = Some(Arc::new(plan));
        self
    }

    /// The operator on the CPU path, by `plan`.
    pub fn with_cpu_plan(mut self, plan: GroupCpuPlan) -> Self {
        self.cpu = Arc::new(plan);
        self
    }

    /// Whether it selects on the GPU.
    pub fn on_device(&self) -> bool {
        self.device.is_some()
    }

    /// Rows kept per group.
    pub fn k(&self) -> usize {
        self.k
    }

    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
    /// Output partition `partition`'s CPU path.
    fn group_heaps(&self, partition: usize, context: &TaskContext) -> GroupHeaps {
        let reservation = MemoryConsumer::new(format!("GpuGroupTopKExec[{partition}]"))
            .register(context.memory_pool());
        GroupHeaps {
            function: self.function,
            ordering: self.ordering.clone(),
            group_keys: self.group_keys,
            k: self.k,
            columns: self.columns.clone(),
            schema: Arc::clone(&self.schema),
            input_schema: self.input.schema(),
            batch_size: context.session_config().batch_size(),
            reservation,
            baseline: BaselineMetrics::new(&self.metrics, partition),
            groups_metric: MetricBuilder::new(&self.metrics).counter("groups", partition),
        }
    }

    /// The device run by `plan`, for every output partition at once.
    fn device_run(&self, plan: &Arc<GroupDevicePlan>, context: &TaskContext) -> DeviceRun {
        let rank = self.input.schema().fields().len();
        let output = (self.columns.iter())
            .map(|&c| (c != rank).then(|| Arc::clone(&plan.output_exprs[c])))
            .collect();
        DeviceRun {
            plan: Arc::clone(plan),
            function: self.function,
            k: self.k,
            output,
            schema: Arc::clone(&self.schema),
            partitioning: self.properties.output_partitioning().clone(),
            batch_size: context.session_config().batch_size(),
            metrics: DeviceMetrics::new(&self.metrics),
        }
    }
}

impl DisplayAs for GpuGroupTopKExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut Formatter) -> fmt::Result {
        let (groups, order) = self.ordering.split_at(self.group_keys);
        let list = |exprs: &[datafusion::physical_expr::PhysicalSortExpr]| {
            exprs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(
            f,
            "GpuGroupTopKExec: k={}, partition_by=[{}], order_by=[{}], function={}",
            self.k,
            list(groups),
            list(order),
            self.function.name()
        )?;
        if self.columns.len() != self.input.schema().fields().len() + 1 {
            let rank = self.input.schema().fields().len();
            let names: Vec<&str> = (self.schema.fields().iter().zip(&self.columns))
                .map(|(f, &c)| match c == rank {
                    true => self.function.name(),
                    false => f.name().as_str(),
                })
                .collect();
            write!(f, ", output=[{}]", names.join(", "))?;
        }
        if let Some(groups) = self.groups {
            write!(f, ", groups≈{groups}")?;
        }
        let verbose = matches!(t, DisplayFormatType::Verbose);
        match &self.device {
            Some(device) => {
                write!(f, ", backend=cuda, algorithm={}", device.algorithm.name())?;
                if let Some(prediction) = &device.prediction {
                    write!(f, ", {}", prediction.describe(verbose))?;
                }
                if let Some(weighed) = &device.weighed {
                    write!(f, ", {weighed}")?;
                }
                if verbose {
                    write!(f, ", reason=[{}]", device.reason)?;
                }
            }
            None => {
                f.write_str(", backend=cpu")?;
                if let Some(weighed) = &self.cpu.weighed {
                    write!(f, ", {weighed}")?;
                }
                if self.cpu.warm_up.is_some() {
                    f.write_str(", cache=warm-up")?;
                }
                if verbose && !self.cpu.reason.is_empty() {
                    write!(f, ", reason=[{}]", self.cpu.reason)?;
                }
            }
        }
        Ok(())
    }
}

impl ExecutionPlan for GpuGroupTopKExec {
    fn name(&self) -> &str {
        "GpuGroupTopKExec"
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
        for sort in self.ordering.iter() {
            if f(&sort.expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
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
            return datafusion::common::internal_err!("GpuGroupTopKExec takes exactly one child");
        }
        Ok(Arc::new(self.copy_over(children.swap_remove(0))))
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
        let input = Arc::clone(&self.input);
        self.replace_children(
            vec![input],
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let outputs = self.properties.output_partitioning().partition_count();
        let inputs = self.input.output_partitioning().partition_count();
        if partition >= outputs {
            return datafusion::common::internal_err!(
                "GpuGroupTopKExec has {outputs} output partitions, asked for {partition}"
            );
        }
        // One output partition a input partition, or one for all of them.
        let read: Vec<usize> = if outputs == inputs {
            vec![partition]
        } else if outputs == 1 {
            (0..inputs).collect()
        } else {
            return datafusion::common::internal_err!(
                "GpuGroupTopKExec: {outputs} output partitions over {inputs} input partitions"
            );
        };
        let input = Arc::clone(&self.input);
        let heaps = self.group_heaps(partition, &context);
        // The CPU path, its input executed only when it runs; the last partition to end it
        // starts the plan's warm-up.
        let task = Arc::clone(&context);
        let warm_up = (self.device.is_none())
            .then(|| self.cpu.warm_up.as_ref().map(|_| Arc::clone(&self.cpu)))
            .flatten();
        let running = Arc::clone(&self.cpu_running);
        let cpu = async move {
            let streams = read
                .into_iter()
                .map(|p| input.execute(p, Arc::clone(&task)))
                .collect::<Result<Vec<_>>>()?;
            let output = heaps.run(streams).await?;
            let last = running.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1;
            if let Some(plan) = warm_up.filter(|_| last) {
                plan.start_warm_up(task);
            }
            Ok(output)
        };
        let run: futures::future::BoxFuture<'static, Result<Vec<RecordBatch>>> = match &self.device
        {
            None => cpu.boxed(),
            Some(plan) => {
                let device = self.device_run(plan, &context);
                let shared = Arc::clone(&self.shared);
                async move {
                    let parts = shared.get_or_init(|| async move { device.run() }).await;
                    match parts {
                        Some(parts) => Ok(parts[partition].clone()),
                        None => cpu.await,
                    }
                }
                .boxed()
            }
        };
        let schema = Arc::clone(&self.schema);
        let output = futures::stream::once(run)
            .map(|batches| match batches {
                Ok(batches) => futures::stream::iter(batches.into_iter().map(Ok)).boxed(),
                Err(e) => futures::stream::iter(vec![Err(e)]).boxed(),
            })
            .flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

/// A batch of `rows` rows of `columns`, which may be none (`count(*)` above reads none).
fn batch_of(
    schema: SchemaRef,
    columns: Vec<ArrayRef>,
    rows: usize,
) -> std::result::Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    use datafusion::arrow::array::RecordBatchOptions;
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    RecordBatch::try_new_with_options(schema, columns, &options)
}
