//! The device run of [`GpuGroupTopKExec`](super::GpuGroupTopKExec): one selection of every
//! group over the whole in-memory table, for all output partitions at once (see the parent
//! module's documentation). Its whole-table selector comes from the top-k operator's entry
//! point, `crate::select::create_selector`, for the cost model's decision; this module reads
//! the table's inputs, hands the kept rows to the output partitions, and counts the run.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, UInt64Array, new_null_array};
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_plan::Partitioning;
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, Time,
};
use datafusion::physical_plan::repartition::BatchPartitioner;

use super::{GroupDevicePlan, RankFunction, batch_of};
use crate::device::{GroupRanking, GroupSpec, KeptPiece};
use crate::exec::metrics::device_watch;
use crate::fusion::{FusedProgram, KernelInput};
use crate::input::memory::{
    MemoryInput, RowLocator, gather_rows, memory_input, table_inputs, table_starts,
};
use crate::input::{ColumnImage, TableInput};
use crate::select::table::{GroupRows, TableSelection, TableSelector};
use crate::select::{InputForm, SelectionPlan, SelectionSpec, Selector, create_selector};

impl GroupDevicePlan {
    /// The selection the cost model decided: on the device, over the whole table.
    fn selection_plan(&self) -> SelectionPlan {
        SelectionPlan::Cuda {
            algorithm: self.selector_algorithm,
            input: InputForm::WholeTable,
        }
    }
}

impl RankFunction {
    /// The device's numbering of a group's kept rows.
    fn ranking(self) -> GroupRanking {
        match self {
            RankFunction::RowNumber => GroupRanking::RowNumber,
            RankFunction::Rank => GroupRanking::Rank,
            RankFunction::DenseRank => GroupRanking::DenseRank,
        }
    }
}

/// The device run's counters.
pub(super) struct DeviceMetrics {
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
    pub(super) fn new(metrics: &ExecutionPlanMetricsSet) -> Self {
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
pub(super) struct DeviceRun {
    pub(super) plan: Arc<GroupDevicePlan>,
    pub(super) function: RankFunction,
    pub(super) k: usize,
    /// Each output column: an expression over the table, or (`None`) the row's number.
    pub(super) output: Vec<Option<Arc<dyn PhysicalExpr>>>,
    pub(super) schema: SchemaRef,
    pub(super) partitioning: Partitioning,
    pub(super) batch_size: usize,
    pub(super) metrics: DeviceMetrics,
}

impl DeviceRun {
    /// The output partitions, or `None` where the CPU path must run (the table is not in
    /// memory, its columns do not fit the cache, the device failed).
    pub(super) fn run(self) -> Option<Arc<Vec<Vec<RecordBatch>>>> {
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

    /// [`run`](Self::run)'s steps: the table's inputs, the selector, the selection (with the
    /// device's gather of the kept rows' columns where it can), and the host's gather of the
    /// kept rows where it cannot. `Ok(None)`: the table path does not apply.
    fn try_run(&self) -> Result<Option<Vec<Vec<RecordBatch>>>> {
        let plan = &self.plan;
        let Some(memory) = memory_input(&plan.table) else {
            return Ok(None);
        };
        let table_schema = plan.table.schema();
        let names: Vec<String> = (table_schema.fields().iter())
            .map(|f| f.name().clone())
            .collect();
        let Some(inputs) = table_inputs(&memory, &plan.program, &names)? else {
            return Ok(None);
        };
        let rows: usize = memory.batches().map(|b| b.num_rows()).sum();
        if rows == 0 || self.k == 0 {
            let partitions = self.partitioning.partition_count();
            return Ok(Some(vec![Vec::new(); partitions]));
        }
        let selector = self.selector()?;
        let read = self.table_reads(table_schema.fields().len());
        let gathered =
            DeviceGathered::plan(&plan.program, &self.output, &inputs, &read, &table_schema);
        let mut parts = OutputPartitions::new(&self.partitioning);
        let selected = {
            let _timer = self.metrics.select_time.timer();
            match self.select(&selector, &inputs, gathered.as_ref(), &mut parts)? {
                Some(selected) => selected,
                None => return Ok(None),
            }
        };
        let _timer = self.metrics.gather_time.timer();
        self.record(&selected);
        if gathered.is_some() {
            self.metrics.rows_gathered_on_device.add(selected.kept);
            return Ok(Some(parts.parts));
        }
        self.gather_from_table(&memory, &read, &selected).map(Some)
    }

    /// The whole-table selector of the cost model's decision, from the selectors' entry point
    /// as the top-k operator gets its own: on the decision's device, with the query's device
    /// accounting, and failing there where a fault is injected at a selector's step.
    fn selector(&self) -> Result<Box<TableSelector>> {
        let plan = &self.plan;
        let spec = SelectionSpec {
            program: Some(Arc::clone(&plan.program)),
            fault: plan.fault,
            watch: Some(device_watch(
                plan.device_memory_limit,
                plan.fault,
                &self.metrics.device_bytes_held,
                &self.metrics.device_peak_bytes,
                &self.metrics.pinned_bytes_held,
            )),
            device: plan.device,
            ..SelectionSpec::new(plan.layout.clone(), self.k)
        };
        match create_selector(&spec, &plan.selection_plan())? {
            Selector::WholeTable(selector) => Ok(selector),
            Selector::Streamed(_) => datafusion::common::internal_err!(
                "GpuGroupTopKExec: a whole-table plan was given a streaming selector"
            ),
        }
    }

    /// Which of the table's columns the output reads.
    fn table_reads(&self, columns: usize) -> Vec<bool> {
        let mut read = vec![false; columns];
        for expr in self.output.iter().flatten() {
            for column in collect_columns(expr) {
                if let Some(r) = read.get_mut(column.index()) {
                    *r = true;
                }
            }
        }
        read
    }

    /// The selection of every group's rows. Where the device gathers the kept rows' columns
    /// (`gathered`), their pieces are built into output rows and placed in `parts` as they
    /// arrive; else the selection holds the kept rows' positions. `None`: the table's columns
    /// do not fit the column cache.
    fn select(
        &self,
        selector: &TableSelector,
        inputs: &[TableInput<'_>],
        gathered: Option<&DeviceGathered>,
        parts: &mut OutputPartitions,
    ) -> Result<Option<TableSelection>> {
        let plan = &self.plan;
        let groups = GroupSpec {
            lo: plan.lo,
            ranking: self.function.ranking(),
            algorithm: plan.algorithm,
        };
        let mut sink;
        let rows_out = match gathered {
            Some(gathered) => {
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
        selector.select_groups(inputs, groups, rows_out)
    }

    /// Counts what the selection passed, kept and sorted, and the device's time in each phase.
    fn record(&self, selected: &TableSelection) {
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
    }

    /// The output partitions of the kept rows at the selection's positions, gathered from the
    /// table (its columns the output reads, `read`): in runs of a batch's size, gathered and
    /// hashed into the window's partitions on every core; each partition's pieces then follow
    /// in the runs' order, which is the sort's.
    fn gather_from_table(
        &self,
        memory: &MemoryInput<'_>,
        read: &[bool],
        selected: &TableSelection,
    ) -> Result<Vec<Vec<RecordBatch>>> {
        let (batches, located) = table_starts(memory);
        let size = self.batch_size.max(1);
        let runs: Vec<std::ops::Range<usize>> = (0..selected.positions.len())
            .step_by(size)
            .map(|at| at..(at + size).min(selected.positions.len()))
            .collect();
        let gathered = crate::input::strings::on_cores(runs, |run| {
            let kept = &selected.positions[run.clone()];
            self.output_parts(memory, &batches, &located, read, kept, &selected.ranks[run])
                .map_err(|e| crate::device::GpuError(e.to_string()))
        })
        .map_err(|e| DataFusionError::Execution(e.0))?;
        let mut parts = OutputPartitions::new(&self.partitioning);
        for run in gathered {
            parts.place(run);
        }
        Ok(parts.parts)
    }

    /// The output rows of the kept table positions `kept` (with their numbers `ranks`), each
    /// with the window's output partition it belongs to, as the repartition below the
    /// window hashed its rows.
    fn output_parts(
        &self,
        memory: &MemoryInput<'_>,
        batches: &[&RecordBatch],
        located: &RowLocator<'_>,
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
        gathered: &DeviceGathered,
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
        crate::input::strings::on_cores(runs, |run| {
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
        gathered: &DeviceGathered,
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
    /// the repartition below the window hashed its rows (else 0, for [`OutputPartitions`] to place).
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

/// The output partitions of a device run, filled with runs of rows in the sort's order: a
/// hashed run's pieces go to the partitions it names; under any other partitioning each run
/// goes to the next partition in turn (a partition then holds rows in the sort's order, which
/// is all that partitioning promises).
struct OutputPartitions {
    parts: Vec<Vec<RecordBatch>>,
    hashed: bool,
    next: usize,
}

impl OutputPartitions {
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
struct DeviceGathered {
    inputs: Vec<usize>,
    schema: SchemaRef,
    exprs: Vec<Option<Arc<dyn PhysicalExpr>>>,
}

impl DeviceGathered {
    /// The device gather of the table columns `read`, or `None` where one of them is not a
    /// program input of fixed-width values (strings, booleans, columns only the output
    /// reads): the host then gathers the kept rows from the table.
    fn plan(
        program: &FusedProgram,
        output_exprs: &[Option<Arc<dyn PhysicalExpr>>],
        inputs: &[TableInput<'_>],
        read: &[bool],
        table_schema: &SchemaRef,
    ) -> Option<Self> {
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
                    && given.image == ColumnImage::Values
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
        Some(Self {
            inputs: at,
            schema,
            exprs,
        })
    }
}
