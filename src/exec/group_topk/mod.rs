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

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Formatter};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array, new_null_array};
use datafusion::arrow::compute::interleave;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::arrow::row::{RowConverter, Rows, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet, Time,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::BatchPartitioner;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties, SendableRecordBatchStream,
};
use futures::{FutureExt, StreamExt};

use super::stream::{gather_rows, table_starts};
use crate::config::FaultPoint;
use crate::cost::Prediction;
use crate::device::watch::DeviceWatch;
use crate::device::{DeviceAlgorithm, GroupAlgorithm, GroupRanking, GroupSpec, KeptPiece};
use crate::fusion::{FusedProgram, KernelInput};
use crate::keys::KeyLayout;
use crate::select::SelectionSpec;
use crate::select::table::GroupRows;

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
    /// Why the GPU (EXPLAIN VERBOSE), and the model's prediction.
    pub reason: String,
    pub prediction: Option<Prediction>,
    /// A device failure to inject (`gpu_topk.inject_fault`).
    pub fault: FaultPoint,
    /// `gpu_topk.device_memory_limit`.
    pub device_memory_limit: usize,
    /// `gpu_topk.pinned_output_bytes`.
    pub pinned_output_bytes: usize,
}

/// The device run's output partitions, shared by every output partition's stream; `None`:
/// the CPU path runs instead.
type SharedRun = Arc<tokio::sync::OnceCell<Option<Arc<Vec<Vec<RecordBatch>>>>>>;

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
    /// Why the CPU path (EXPLAIN VERBOSE), where it is not.
    cpu_reason: String,
    /// The groups among the rows that pass, estimated at planning where the input is an
    /// in-memory table (EXPLAIN shows it).
    groups: Option<usize>,
    shared: SharedRun,
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
            cpu_reason: String::new(),
            groups: None,
            shared: SharedRun::default(),
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
            cpu_reason: self.cpu_reason.clone(),
            groups: self.groups,
            shared: SharedRun::default(),
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

    /// The operator on the CPU path, for `reason`.
    pub fn with_cpu_reason(mut self, reason: String) -> Self {
        self.cpu_reason = reason;
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
                if verbose {
                    write!(f, ", reason=[{}]", device.reason)?;
                }
            }
            None => {
                f.write_str(", backend=cpu")?;
                if verbose && !self.cpu_reason.is_empty() {
                    write!(f, ", reason=[{}]", self.cpu_reason)?;
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
        let reservation = MemoryConsumer::new(format!("GpuGroupTopKExec[{partition}]"))
            .register(context.memory_pool());
        let groups = Selection {
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
        };
        // The CPU path, its input executed only when it runs.
        let task = Arc::clone(&context);
        let cpu = async move {
            let streams = read
                .into_iter()
                .map(|p| input.execute(p, Arc::clone(&task)))
                .collect::<Result<Vec<_>>>()?;
            groups.run(streams).await
        };
        let run: futures::future::BoxFuture<'static, Result<Vec<RecordBatch>>> = match &self.device
        {
            None => cpu.boxed(),
            Some(plan) => {
                let rank = self.input.schema().fields().len();
                let output = (self.columns.iter())
                    .map(|&c| (c != rank).then(|| Arc::clone(&plan.output_exprs[c])))
                    .collect();
                let device = DeviceRun {
                    plan: Arc::clone(plan),
                    function: self.function,
                    k: self.k,
                    output,
                    schema: Arc::clone(&self.schema),
                    partitioning: self.properties.output_partitioning().clone(),
                    batch_size: context.session_config().batch_size(),
                    metrics: DeviceMetrics::new(&self.metrics),
                };
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

/// The device run's counters.
struct DeviceMetrics {
    gpu_fallbacks: Count,
    rows_passed_filter: Count,
    rows_kept: Count,
    /// Pairs the device sorted: all that passed, or those below their groups' limits.
    rows_sorted: Count,
    select_time: Time,
    /// Device time (CUDA events) of the pass, the sort with the groups' limits, and the walk
    /// with the read-back: parts of `select_time`.
    device_pass_time: Time,
    device_sort_time: Time,
    device_keep_time: Time,
    /// The host's building of the output rows from the kept rows: their gather from the
    /// table, or (inside `select_time`) from the columns the device gathered.
    gather_time: Time,
    /// Kept rows whose columns the device gathered.
    rows_gathered_on_device: Count,
    device_bytes_held: Gauge,
    device_peak_bytes: Gauge,
    pinned_bytes_held: Gauge,
}

impl DeviceMetrics {
    fn new(metrics: &ExecutionPlanMetricsSet) -> Self {
        let builder = || MetricBuilder::new(metrics);
        Self {
            gpu_fallbacks: builder().global_counter("gpu_fallbacks"),
            rows_passed_filter: builder().global_counter("rows_passed_filter"),
            rows_kept: builder().global_counter("rows_kept"),
            rows_sorted: builder().global_counter("rows_sorted"),
            select_time: builder().subset_time("select_time", 0),
            device_pass_time: builder().subset_time("device_pass_time", 0),
            device_sort_time: builder().subset_time("device_sort_time", 0),
            device_keep_time: builder().subset_time("device_keep_time", 0),
            gather_time: builder().subset_time("gather_time", 0),
            rows_gathered_on_device: builder().global_counter("rows_gathered_on_device"),
            device_bytes_held: builder().global_gauge("device_bytes_held"),
            device_peak_bytes: builder().global_gauge("device_peak_bytes"),
            pinned_bytes_held: builder().global_gauge("pinned_bytes_held"),
        }
    }
}

/// The selection of every group on the device, for all output partitions at once.
struct DeviceRun {
    plan: Arc<GroupDevicePlan>,
    function: RankFunction,
    k: usize,
    /// Each output column: an expression over the table, or (`None`) the row's number.
    output: Vec<Option<Arc<dyn PhysicalExpr>>>,
    schema: SchemaRef,
    partitioning: Partitioning,
    batch_size: usize,
    metrics: DeviceMetrics,
}

impl DeviceRun {
    /// The output partitions, or `None` where the CPU path must run (the table is not in
    /// memory, its columns do not fit the cache, the device failed).
    fn run(self) -> Option<Arc<Vec<Vec<RecordBatch>>>> {
        match self.try_run() {
            Ok(parts) => parts.map(Arc::new),
            Err(e) => {
                log::warn!(
                    "gpu-topk: the GPU per-group selection failed, the CPU path runs it: {e}"
                );
                self.metrics.gpu_fallbacks.add(1);
                None
            }
        }
    }

    fn try_run(&self) -> Result<Option<Vec<Vec<RecordBatch>>>> {
        use crate::select::table::TableSelector;

        let plan = &self.plan;
        let Some(memory) = crate::exec::memory_input(&plan.table) else {
            return Ok(None);
        };
        let table_schema = plan.table.schema();
        let names: Vec<String> = (table_schema.fields().iter())
            .map(|f| f.name().clone())
            .collect();
        let Some(inputs) = crate::exec::table_inputs(&memory, &plan.program, &names)? else {
            return Ok(None);
        };
        let partitions = self.partitioning.partition_count();
        let rows: usize = memory.batches().map(|b| b.num_rows()).sum();
        if rows == 0 || self.k == 0 {
            return Ok(Some(vec![Vec::new(); partitions]));
        }
        let Some(device) = crate::device::gpu() else {
            return Ok(None);
        };
        if matches!(
            plan.fault,
            FaultPoint::Create | FaultPoint::Push(_) | FaultPoint::Finish
        ) {
            return Err(DataFusionError::Execution(format!(
                "injected fault: {}",
                plan.fault
            )));
        }
        let mut spec = SelectionSpec::new(plan.layout.clone(), self.k);
        spec.program = Some(Arc::clone(&plan.program));
        spec.watch = Some(Arc::new(DeviceWatch::new(
            plan.device_memory_limit,
            match plan.fault {
                FaultPoint::Device(op, n) => Some((op, n)),
                _ => None,
            },
            self.metrics.device_bytes_held.clone(),
            self.metrics.device_peak_bytes.clone(),
            self.metrics.pinned_bytes_held.clone(),
        )));
        let ranking = match self.function {
            RankFunction::RowNumber => GroupRanking::RowNumber,
            RankFunction::Rank => GroupRanking::Rank,
            RankFunction::DenseRank => GroupRanking::DenseRank,
        };
        // The table's columns the output reads.
        let mut read = vec![false; table_schema.fields().len()];
        for expr in self.output.iter().flatten() {
            for column in collect_columns(expr) {
                if let Some(r) = read.get_mut(column.index()) {
                    *r = true;
                }
            }
        }
        let gathered = device_gathered(&plan.program, &self.output, &inputs, &read, &table_schema);
        let mut parts = Spread::new(&self.partitioning);
        let selected = {
            let _timer = self.metrics.select_time.timer();
            let selector = TableSelector::new(&spec, device, DeviceAlgorithm::Sample)?;
            let groups = GroupSpec {
                lo: plan.lo,
                ranking,
                algorithm: plan.algorithm,
            };
            let mut sink;
            let rows_out = match &gathered {
                Some(gathered) => {
                    let parts = &mut parts;
                    sink = move |piece: KeptPiece<'_>| -> Result<()> {
                        let _timer = self.metrics.gather_time.timer();
                        for run in self.piece_parts(gathered, &piece)? {
                            parts.place(run);
                        }
                        Ok(())
                    };
                    Some(GroupRows {
                        inputs: gathered.inputs.clone(),
                        ranks: self.output.iter().any(Option::is_none),
                        lend: plan.pinned_output_bytes,
                        sink: &mut sink,
                    })
                }
                None => None,
            };
            match selector.select_groups(&inputs, groups, rows_out)? {
                Some(selected) => selected,
                None => return Ok(None),
            }
        };
        let _timer = self.metrics.gather_time.timer();
        self.metrics.rows_passed_filter.add(selected.passed);
        self.metrics.rows_kept.add(selected.kept);
        self.metrics.rows_sorted.add(selected.sorted);
        let phases = [
            &self.metrics.device_pass_time,
            &self.metrics.device_sort_time,
            &self.metrics.device_keep_time,
        ];
        for (time, ms) in phases.into_iter().zip(selected.group_phases_ms) {
            time.add_duration(std::time::Duration::from_secs_f64(
                f64::from(ms.max(0.0)) / 1e3,
            ));
        }
        if gathered.is_some() {
            self.metrics.rows_gathered_on_device.add(selected.kept);
            return Ok(Some(parts.parts));
        }
        let (batches, located) = table_starts(&memory);
        // The kept rows in runs of a batch's size, gathered and hashed into the window's
        // partitions on every core; each partition's pieces then follow in the runs' order,
        // which is the sort's.
        let size = self.batch_size.max(1);
        let runs: Vec<std::ops::Range<usize>> = (0..selected.positions.len())
            .step_by(size)
            .map(|at| at..(at + size).min(selected.positions.len()))
            .collect();
        let gathered = crate::select::table::on_cores(runs, |run| {
            let kept = &selected.positions[run.clone()];
            self.output_parts(
                &memory,
                &batches,
                &located,
                &read,
                kept,
                &selected.ranks[run],
            )
            .map_err(|e| crate::device::GpuError(e.to_string()))
        })
        .map_err(|e| DataFusionError::Execution(e.0))?;
        let mut parts = Spread::new(&self.partitioning);
        for run in gathered {
            parts.place(run);
        }
        Ok(Some(parts.parts))
    }

    /// The output rows of the kept table positions `kept` (with their numbers `ranks`), each
    /// with the window's output partition it belongs to, as the repartition below the
    /// window hashed its rows.
    fn output_parts(
        &self,
        memory: &crate::exec::memory::MemoryInput<'_>,
        batches: &[&RecordBatch],
        located: &super::stream::RowLocator<'_>,
        read: &[bool],
        kept: &[u64],
        ranks: &[u64],
    ) -> Result<Vec<(usize, RecordBatch)>> {
        let table_schema = self.plan.table.schema();
        let n = kept.len();
        let columns = gather_rows(memory, batches, located, kept, read)?;
        let columns: Vec<ArrayRef> = (columns.into_iter().zip(table_schema.fields()))
            .map(|(c, field)| c.unwrap_or_else(|| new_null_array(field.data_type(), n)))
            .collect();
        let fields = (table_schema.fields().iter()).map(|f| f.as_ref().clone().with_nullable(true));
        let rows =
            RecordBatch::try_new(Arc::new(Schema::new(fields.collect::<Vec<_>>())), columns)?;
        let ranks: ArrayRef = Arc::new(UInt64Array::from(ranks.to_vec()));
        self.partitioned(&rows, &self.output, ranks)
    }

    /// The output rows of a piece of kept rows whose columns the device gathered, in runs
    /// built and hashed into the window's partitions on every core, in order. A run is a
    /// batch's size for each partition, so that it hashes into about a batch a partition.
    fn piece_parts(
        &self,
        gathered: &Gathered,
        piece: &KeptPiece<'_>,
    ) -> Result<Vec<Vec<(usize, RecordBatch)>>> {
        let partitions = match &self.partitioning {
            Partitioning::Hash(_, count) => (*count).max(1),
            _ => 1,
        };
        let size = self.batch_size.max(1) * partitions;
        let runs: Vec<std::ops::Range<usize>> = (0..piece.rows)
            .step_by(size)
            .map(|at| at..(at + size).min(piece.rows))
            .collect();
        crate::select::table::on_cores(runs, |run| {
            self.gathered_run(gathered, piece, run)
                .map_err(|e| crate::device::GpuError(e.to_string()))
        })
        .map_err(|e| DataFusionError::Execution(e.0))
    }

    /// Rows `run` of a piece of kept rows as arrays over their read-back bytes (the pinned
    /// memory itself where the piece is lent, else copies), then as
    /// [`partitioned`](Self::partitioned) output rows.
    fn gathered_run(
        &self,
        gathered: &Gathered,
        piece: &KeptPiece<'_>,
        run: std::ops::Range<usize>,
    ) -> Result<Vec<(usize, RecordBatch)>> {
        use datafusion::arrow::array::{ArrayData, make_array};
        use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer, ScalarBuffer};
        let n = run.len();
        let columns = (gathered.schema.fields().iter().zip(&piece.columns))
            .map(|(field, (values, validity))| {
                let width = values.len() / piece.rows.max(1);
                let values = piece.buffer(&values[run.start * width..run.end * width]);
                let nulls = validity.map(|bits| {
                    let bytes = &bits[run.start / 8..run.end.div_ceil(8)];
                    NullBuffer::new(BooleanBuffer::new(piece.buffer(bytes), run.start % 8, n))
                });
                let nulls = nulls.filter(|n| n.null_count() > 0);
                let data = ArrayData::builder(field.data_type().clone())
                    .len(n)
                    .add_buffer(values)
                    .nulls(nulls)
                    .build()?;
                Ok(make_array(data))
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let rows = batch_of(Arc::clone(&gathered.schema), columns, n)?;
        let ranks: ArrayRef = match piece.ranks {
            Some(bytes) => {
                let bytes = piece.buffer(&bytes[8 * run.start..8 * run.end]);
                Arc::new(UInt64Array::new(ScalarBuffer::new(bytes, 0, n), None))
            }
            // Every number is 1 (k = 1), or no output reads them.
            None if gathered.exprs.iter().any(Option::is_none) => {
                Arc::new(UInt64Array::from_value(1, n))
            }
            None => Arc::new(UInt64Array::new_null(0)),
        };
        self.partitioned(&rows, &gathered.exprs, ranks)
    }

    /// The operator's output rows, `exprs` over `rows` (`None`: their numbers `ranks`), each
    /// with the window's output partition it belongs to where that is a hash partitioning, as
    /// the repartition below the window hashed its rows (else 0, for [`Spread`] to place).
    fn partitioned(
        &self,
        rows: &RecordBatch,
        exprs: &[Option<Arc<dyn PhysicalExpr>>],
        ranks: ArrayRef,
    ) -> Result<Vec<(usize, RecordBatch)>> {
        let n = rows.num_rows();
        let arrays = (exprs.iter())
            .map(|e| match e {
                Some(e) => e.evaluate(rows)?.into_array(n),
                None => Ok(Arc::clone(&ranks)),
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let batch = batch_of(Arc::clone(&self.schema), arrays, n)?;
        let mut parts = Vec::new();
        match &self.partitioning {
            Partitioning::Hash(exprs, count) if *count > 1 => {
                let hash = Partitioning::Hash(exprs.clone(), *count);
                let mut partitioner = BatchPartitioner::try_new(hash, Time::new(), 0, 1)?;
                partitioner.partition(batch, |p, b| {
                    parts.push((p, b));
                    Ok(())
                })?;
            }
            _ => parts.push((0, batch)),
        }
        Ok(parts)
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

/// The output partitions of a device run, filled with runs of rows in the sort's order: a
/// hashed run's pieces go to the partitions it names; under any other partitioning each run
/// goes to the next partition in turn (a partition then holds rows in the sort's order, which
/// is all that partitioning promises).
struct Spread {
    parts: Vec<Vec<RecordBatch>>,
    hashed: bool,
    next: usize,
}

impl Spread {
    fn new(partitioning: &Partitioning) -> Self {
        Self {
            parts: vec![Vec::new(); partitioning.partition_count().max(1)],
            hashed: matches!(partitioning, Partitioning::Hash(..)),
            next: 0,
        }
    }

    fn place(&mut self, run: Vec<(usize, RecordBatch)>) {
        for (p, batch) in run {
            let p = match self.hashed {
                true => p,
                false => {
                    self.next += 1;
                    (self.next - 1) % self.parts.len()
                }
            };
            self.parts[p].push(batch);
        }
    }
}

/// The kept rows' columns that the device gathers (where the column cache holds every table
/// column the output reads, as fixed-width values): the program inputs holding them, in
/// table order, the schema of those columns, and the output expressions over it (`None`: the
/// row's number).
struct Gathered {
    inputs: Vec<usize>,
    schema: SchemaRef,
    exprs: Vec<Option<Arc<dyn PhysicalExpr>>>,
}

/// The device gather of the table columns `read` (see [`Gathered`]), or `None` where one of
/// them is not a program input of fixed-width values (strings, booleans, columns only the
/// output reads): the host then gathers the kept rows from the table.
fn device_gathered(
    program: &FusedProgram,
    output_exprs: &[Option<Arc<dyn PhysicalExpr>>],
    inputs: &[crate::select::table::TableInput<'_>],
    read: &[bool],
    table_schema: &SchemaRef,
) -> Option<Gathered> {
    use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
    let mut at = Vec::new();
    let mut fields = Vec::new();
    let mut index = vec![usize::MAX; read.len()];
    for (c, _) in read.iter().enumerate().filter(|(_, r)| **r) {
        let field = table_schema.fields().get(c)?;
        field.data_type().primitive_width()?;
        let i = (program.inputs.iter().zip(inputs)).position(|(input, given)| {
            matches!(input, KernelInput::Column(x) if *x == c)
                && given.lookup.is_none()
                && given.image == crate::select::table::Image::Values
        })?;
        index[c] = fields.len();
        at.push(i);
        fields.push(field.as_ref().clone().with_nullable(true));
    }
    let schema = Arc::new(Schema::new(fields));
    let exprs = output_exprs
        .iter()
        .map(|e| {
            let Some(e) = e else { return Ok(None) };
            Arc::clone(e)
                .transform(|e| {
                    let Some(column) = e.downcast_ref::<Column>() else {
                        return Ok(Transformed::no(e));
                    };
                    let expr: Arc<dyn PhysicalExpr> =
                        Arc::new(Column::new(column.name(), index[column.index()]));
                    Ok(Transformed::yes(expr))
                })
                .data()
                .map(Some)
        })
        .collect::<Result<Vec<_>>>()
        .ok()?;
    Some(Gathered {
        inputs: at,
        schema,
        exprs,
    })
}

/// The window function whose value the operator gives each row it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankFunction {
    /// `ROW_NUMBER()`: 1, 2, … in sort order, ties in input order.
    RowNumber,
    /// `RANK()`: one past the rows whose key is smaller; tied keys share it, and a group may
    /// keep more than K rows.
    Rank,
    /// `DENSE_RANK()`: one past the distinct keys smaller than the row's; a group keeps every
    /// row of its K smallest keys.
    DenseRank,
}

impl RankFunction {
    fn name(self) -> &'static str {
        match self {
            RankFunction::RowNumber => "row_number",
            RankFunction::Rank => "rank",
            RankFunction::DenseRank => "dense_rank",
        }
    }
}

/// One output partition's selection.
struct Selection {
    function: RankFunction,
    ordering: LexOrdering,
    group_keys: usize,
    k: usize,
    /// Each output column's place among the input's columns then the number.
    columns: Vec<usize>,
    schema: SchemaRef,
    input_schema: SchemaRef,
    batch_size: usize,
    reservation: MemoryReservation,
    baseline: BaselineMetrics,
    groups_metric: Count,
}

/// A kept row: where it lies among the held batches (its sort key is row `row` of its
/// batch's key rows), its position in the input (ties) and its group.
#[derive(Debug, Clone, Copy)]
struct Kept {
    batch: u32,
    row: u32,
    position: u64,
    group: u32,
}

/// Numbers the groups by their encoded keys (arrow's row format) in order of arrival: the keys
/// in one buffer, and a map from each key's hash to its latest group, groups of equal hashes
/// chained. Millions of groups cost a few buffers, not an allocation each. (DataFusion's hash
/// map hashes the keys and again their hashes: a hash is cheap next to a key's comparison.)
#[derive(Default)]
struct GroupIds {
    bytes: Vec<u8>,
    /// Where each group's key ends in `bytes`.
    ends: Vec<usize>,
    latest: datafusion::common::HashMap<u64, u32>,
    /// Per group, the previous group of the same hash (`u32::MAX`: none).
    previous: Vec<u32>,
}

impl GroupIds {
    /// The group of `key`, numbered next where it is new.
    fn id(&mut self, key: &[u8]) -> usize {
        use std::hash::BuildHasher;
        let hash = self.latest.hasher().hash_one(key);
        let mut at = self.latest.get(&hash).copied().unwrap_or(u32::MAX);
        while at != u32::MAX {
            if self.key(at as usize) == key {
                return at as usize;
            }
            at = self.previous[at as usize];
        }
        let id = self.ends.len();
        self.previous
            .push(self.latest.insert(hash, id as u32).unwrap_or(u32::MAX));
        self.bytes.extend_from_slice(key);
        self.ends.push(self.bytes.len());
        id
    }

    /// Group `id`'s key.
    fn key(&self, id: usize) -> &[u8] {
        let start = match id {
            0 => 0,
            _ => self.ends[id - 1],
        };
        &self.bytes[start..self.ends[id]]
    }
}

impl Selection {
    async fn run(self, streams: Vec<SendableRecordBatchStream>) -> Result<Vec<RecordBatch>> {
        let fields = |exprs: &[datafusion::physical_expr::PhysicalSortExpr]| -> Result<_> {
            let input = &self.input_schema;
            exprs
                .iter()
                .map(|s| {
                    Ok(SortField::new_with_options(
                        s.expr.data_type(input)?,
                        s.options,
                    ))
                })
                .collect::<Result<Vec<_>>>()
        };
        let sort_converter = RowConverter::new(fields(&self.ordering)?)?;
        let group_converter = RowConverter::new(fields(&self.ordering[..self.group_keys])?)?;
        // Each group's number, and its kept rows in ascending (key, position) order.
        let mut groups = GroupIds::default();
        let mut members: Vec<Vec<Kept>> = Vec::new();
        // Under RANK(), per group the rows beyond its K kept ones whose key ties the K-th's.
        let mut ties: Vec<Vec<Kept>> = Vec::new();
        // Under DENSE_RANK(), per group its K smallest keys (encoded), each with its rows.
        let dense = self.function == RankFunction::DenseRank;
        let mut distinct: Vec<BTreeMap<Box<[u8]>, Vec<Kept>>> = Vec::new();
        // Held batches with their key rows, and how many kept rows each still holds.
        let mut batches: Vec<Option<(RecordBatch, Rows)>> = Vec::new();
        let mut live: Vec<usize> = Vec::new();
        let mut position = 0u64;
        for mut stream in streams {
            while let Some(batch) = stream.next().await {
                let batch = batch?;
                let _timer = self.baseline.elapsed_compute().timer();
                let n = batch.num_rows();
                if n == 0 || self.k == 0 {
                    position += n as u64;
                    continue;
                }
                let columns = (self.ordering.iter())
                    .map(|s| s.expr.evaluate(&batch)?.into_array(n))
                    .collect::<Result<Vec<ArrayRef>>>()?;
                let keys = sort_converter.convert_columns(&columns)?;
                let group_rows = group_converter.convert_columns(&columns[..self.group_keys])?;
                let index = batches.len();
                batches.push(Some((batch, keys)));
                live.push(0);
                for row in 0..n {
                    let gid = groups.id(group_rows.row(row).as_ref());
                    if gid == members.len() {
                        // Vec::new and BTreeMap::new allocate nothing until a row arrives.
                        members.push(Vec::new());
                        ties.push(Vec::new());
                        if dense {
                            distinct.push(BTreeMap::new());
                        }
                    }
                    let heap = &mut members[gid];
                    let new = Kept {
                        batch: index as u32,
                        row: row as u32,
                        position: position + row as u64,
                        group: gid as u32,
                    };
                    let key = |k: &Kept| {
                        let (_, rows) = batches[k.batch as usize].as_ref().expect("held");
                        rows.row(k.row as usize)
                    };
                    let less = |a: &Kept, b: &Kept| (key(a), a.position) < (key(b), b.position);
                    let mut released = Vec::new();
                    if dense {
                        let keys = &mut distinct[gid];
                        let row_key = key(&new);
                        if keys.len() == self.k
                            && keys
                                .last_key_value()
                                .is_some_and(|(last, _)| row_key.as_ref() > last.as_ref())
                        {
                            continue;
                        }
                        keys.entry(row_key.as_ref().into()).or_default().push(new);
                        if keys.len() > self.k
                            && let Some((_, gone)) = keys.pop_last()
                        {
                            released = gone;
                        }
                    } else if heap.len() < self.k {
                        // Heap order only matters once the group holds K rows (most groups
                        // of a query with many small groups never do).
                        heap.push(new);
                        if heap.len() == self.k {
                            for i in (0..heap.len() / 2).rev() {
                                sift_down(heap, i, less);
                            }
                        }
                    } else {
                        let ranked = self.function == RankFunction::Rank;
                        match key(&new).cmp(&key(&heap[0])) {
                            std::cmp::Ordering::Equal if ranked => ties[gid].push(new),
                            std::cmp::Ordering::Greater => continue,
                            _ if !less(&new, &heap[0]) => continue,
                            _ => {
                                // The group's worst kept row goes (under RANK() it stays a
                                // tie while the new K-th row has its key).
                                let evicted = std::mem::replace(&mut heap[0], new);
                                sift_down(heap, 0, less);
                                if ranked && key(&evicted) == key(&heap[0]) {
                                    ties[gid].push(evicted);
                                } else {
                                    released.push(evicted);
                                    released.append(&mut ties[gid]);
                                }
                            }
                        }
                    }
                    live[index] += 1;
                    for gone in released {
                        let at = gone.batch as usize;
                        live[at] -= 1;
                        if live[at] == 0
                            && at != index
                            && let Some((batch, rows)) = batches[at].take()
                        {
                            self.reservation
                                .shrink(batch.get_array_memory_size() + rows.size());
                        }
                    }
                }
                position += n as u64;
                if live[index] == 0 {
                    batches[index] = None;
                } else if let Some((batch, rows)) = &batches[index] {
                    self.reservation
                        .try_grow(batch.get_array_memory_size() + rows.size())?;
                }
            }
        }
        let _timer = self.baseline.elapsed_compute().timer();
        self.groups_metric.add(members.len());
        if batches.len() > u32::MAX as usize {
            return datafusion::common::internal_err!("GpuGroupTopKExec: more than 2^32 batches");
        }
        // In sort order (group keys first, so each group's rows are consecutive), numbered
        // 1, 2, … within their group; under RANK() a row whose key ties the previous row's
        // takes its number.
        // The groups in the order of their keys (the sort's leading keys, encoded alike), each
        // group's rows sorted on their own: small sorts over few rows each.
        let key = |k: &Kept| {
            let (_, rows) = batches[k.batch as usize].as_ref().expect("held");
            rows.row(k.row as usize)
        };
        let mut order: Vec<u32> = (0..members.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| groups.key(a as usize).cmp(groups.key(b as usize)));
        drop(groups);
        let mut kept: Vec<Kept> = Vec::with_capacity(members.iter().map(Vec::len).sum());
        for gid in order {
            let gid = gid as usize;
            let start = kept.len();
            kept.append(&mut members[gid]);
            kept.append(&mut ties[gid]);
            if dense {
                kept.extend(std::mem::take(&mut distinct[gid]).into_values().flatten());
            }
            kept[start..].sort_unstable_by(|a, b| (key(a), a.position).cmp(&(key(b), b.position)));
        }
        let mut numbers: Vec<u64> = Vec::with_capacity(kept.len());
        let mut group_start = 0;
        for (i, k) in kept.iter().enumerate() {
            let next = match numbers.last() {
                Some(&n) if kept[i - 1].group == k.group => match self.function {
                    RankFunction::Rank if key(&kept[i - 1]) == key(k) => n,
                    // One past the rows before it in its group.
                    RankFunction::Rank => (i - group_start) as u64 + 1,
                    RankFunction::RowNumber => n + 1,
                    RankFunction::DenseRank if key(&kept[i - 1]) == key(k) => n,
                    RankFunction::DenseRank => n + 1,
                },
                _ => {
                    group_start = i;
                    1
                }
            };
            numbers.push(next);
        }
        let held: Vec<(usize, &RecordBatch)> = (batches.iter().enumerate())
            .filter_map(|(i, b)| b.as_ref().map(|(b, _)| (i, b)))
            .collect();
        let slot: HashMap<usize, usize> = (held.iter().enumerate())
            .map(|(s, (i, _))| (*i, s))
            .collect();
        let at: Vec<(usize, usize)> = (kept.iter())
            .map(|k| (slot[&(k.batch as usize)], k.row as usize))
            .collect();
        let mut output = Vec::new();
        let rank = self.input_schema.fields().len();
        for (chunk, numbers) in at
            .chunks(self.batch_size.max(1))
            .zip(numbers.chunks(self.batch_size.max(1)))
        {
            let arrays = (self.columns.iter())
                .map(|&c| {
                    if c == rank {
                        return Ok(Arc::new(UInt64Array::from(numbers.to_vec())) as ArrayRef);
                    }
                    let sources: Vec<&dyn Array> =
                        held.iter().map(|(_, b)| b.column(c).as_ref()).collect();
                    Ok(interleave(&sources, chunk)?)
                })
                .collect::<Result<Vec<ArrayRef>>>()?;
            let batch = batch_of(Arc::clone(&self.schema), arrays, chunk.len())
                .map_err(|e| DataFusionError::ArrowError(Box::new(e), None))?;
            self.baseline.record_output(batch.num_rows());
            output.push(batch);
        }
        self.baseline.done();
        Ok(output)
    }
}

/// Restores the max-heap order (by `less`) of `heap` from its element `i` down.
fn sift_down(heap: &mut [Kept], mut i: usize, less: impl Fn(&Kept, &Kept) -> bool) {
    loop {
        let (left, right) = (2 * i + 1, 2 * i + 2);
        let mut largest = i;
        if left < heap.len() && less(&heap[largest], &heap[left]) {
            largest = left;
        }
        if right < heap.len() && less(&heap[largest], &heap[right]) {
            largest = right;
        }
        if largest == i {
            break;
        }
        heap.swap(i, largest);
        i = largest;
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// Equal keys get one number, in order of arrival, whatever their length (the empty key,
    /// and keys that are prefixes of others, included); each key reads back as it came.
    #[test]
    fn group_ids_number_keys_in_order_of_arrival() {
        let mut ids = GroupIds::default();
        let keys: Vec<Vec<u8>> = (0..20_000u32)
            .map(|i| {
                let n = (i % 23) as usize;
                (0..n)
                    .map(|j| (i.wrapping_mul(31) >> (j % 4)) as u8)
                    .collect()
            })
            .collect();
        let mut first: Vec<Vec<u8>> = Vec::new();
        let mut known: HashMap<Vec<u8>, usize> = HashMap::new();
        for round in 0..2 {
            for key in &keys {
                let id = ids.id(key);
                match known.get(key) {
                    Some(&at) => assert_eq!(id, at, "{key:?}"),
                    None => {
                        assert_eq!(round, 0);
                        assert_eq!(id, first.len());
                        known.insert(key.clone(), id);
                        first.push(key.clone());
                    }
                }
            }
        }
        assert!(first.len() > 1000, "{} distinct keys", first.len());
        for (id, key) in first.iter().enumerate() {
            assert_eq!(ids.key(id), key.as_slice());
        }
    }
}
