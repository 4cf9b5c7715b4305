//! The operator's execution (see the module documentation of [`super`]): the plan's selector
//! built once, the input streamed partition by partition into it, and the fallbacks, which
//! are the operator's own: a whole table that cannot be read as one streams, and a device
//! error moves the selection to the CPU path. One input form a file: `host` (predicate and
//! keys evaluated by DataFusion, keys pushed), `fused` (raw columns pushed to the generated
//! program) and `whole_table` (one selection over every row).

use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::compute::prep_null_mask_filter;
use datafusion::arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::common::runtime::JoinSet;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

mod fused;
mod host;
mod parquet_table;
mod whole_table;

use super::TopKSpec;
use super::dynamic_filter::{Publisher, threshold_predicate};
use super::metrics::{TopKMetrics, device_watch};
use super::row_store::RowStore;
use crate::config::FaultPoint;
use crate::cost::{InputForm, SelectionPlan, policy};
use crate::fusion::FusedProgram;
use crate::select::{self, DeviceError, SelectionSpec, Selector, TopKSelector};
use fused::FusedPending;
use host::PendingKeys;
use whole_table::WholeTable;

pub(super) fn execute(
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    publisher: Publisher,
    metrics: &ExecutionPlanMetricsSet,
    fallback: Arc<Mutex<Option<String>>>,
    context: Arc<TaskContext>,
) -> Result<SendableRecordBatchStream> {
    if let Ok(mut reason) = fallback.lock() {
        *reason = None;
    }
    let run = TopKRun {
        fallback,
        reservation: MemoryConsumer::new("GpuTopKExec").register(context.memory_pool()),
        input,
        spec,
        schema: Arc::clone(&schema),
        publisher,
        metrics: TopKMetrics::new(metrics),
        context,
    };
    // No rows, no batch, as from DataFusion's TopK: an operator above (ours too) sees no
    // empty batch to evaluate its keys on.
    let output = futures::stream::once(async move { run.run().await })
        .filter(|batch| futures::future::ready(!matches!(batch, Ok(b) if b.num_rows() == 0)));
    Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
}

/// One execution of the operator.
struct TopKRun {
    /// Where the reason of a fallback is reported (EXPLAIN ANALYZE).
    fallback: Arc<Mutex<Option<String>>>,
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    publisher: Publisher,
    metrics: TopKMetrics,
    context: Arc<TaskContext>,
    reservation: MemoryReservation,
}

/// The predicate over a batch as a filter mask: NULL counts as false, as in `WHERE`.
fn predicate_mask(predicate: &Arc<dyn PhysicalExpr>, batch: &RecordBatch) -> Result<BooleanArray> {
    let mask = predicate.evaluate(batch)?.into_array(batch.num_rows())?;
    let mask: &BooleanArray = mask
        .as_boolean_opt()
        .ok_or_else(|| DataFusionError::Internal("filter predicate is not boolean".into()))?;
    Ok(match mask.null_count() {
        0 => mask.clone(),
        _ => prep_null_mask_filter(mask),
    })
}

/// DataFusion evaluates the filter on every input batch, and the sort keys on every batch that
/// reaches its TopK (an empty one too where no filter is below): an expression that fails
/// whatever the rows (a failing constant) fails on an empty batch too.
fn check_empty_batch(spec: &TopKSpec, batch: &RecordBatch) -> Result<()> {
    match &spec.filter {
        Some(predicate) => {
            predicate.evaluate(batch)?;
        }
        None => {
            for sort in spec.sort_exprs.iter() {
                sort.expr.evaluate(batch)?.into_array(0)?;
            }
        }
    }
    Ok(())
}

/// Records why a run left the GPU: the device error's own text.
fn report_fallback(fallback: &Mutex<Option<String>>, error: &DeviceError) {
    if let Ok(mut reason) = fallback.lock() {
        reason.get_or_insert(error.to_string());
    }
}

/// Where the selection runs. A run starts on the GPU when the plan says so and moves to the
/// CPU at the first device error ([`RunState::fall_back`]); it never moves back.
struct ActiveSelector {
    selector: Arc<dyn TopKSelector>,
    /// The generated program the selector runs (predicate and keys on the device), if any.
    program: Option<Arc<FusedProgram>>,
    /// Whether the selector can fail like a device (the GPU's, or one with an injected fault),
    /// to be taken over by the CPU path.
    fallible: bool,
}

/// State shared by the partition tasks of one run.
struct RunState {
    spec: Arc<TopKSpec>,
    store: Mutex<StoreState>,
    store_schema: SchemaRef,
    /// Index of the first sort key's column in the stored batches (the keys follow it).
    first_key: usize,
    publisher: Publisher,
    reservation: MemoryReservation,
    metrics: TopKMetrics,
    fallback: Arc<Mutex<Option<String>>>,
}

struct StoreState {
    rows: RowStore,
    /// Switched under this lock, so every row of the input is either stored before the switch
    /// (and handed to the CPU selector with the rest of the store) or processed on the CPU
    /// after it: a GPU push whose rows arrive after a switch is processed again.
    mode: Arc<ActiveSelector>,
    /// Row id of the threshold last published to the dynamic filter.
    published: Option<u64>,
    /// That threshold as a predicate over the stored rows (their first sort key): rows failing
    /// it cannot win, so rows admitted wholesale ([`select::Admitted::All`]) are cut with it.
    prune: Option<Arc<dyn PhysicalExpr>>,
}

/// What one partition task holds between batches.
#[derive(Default)]
struct PartitionState {
    pending: PendingKeys,
    fused: FusedPending,
}

impl PartitionState {
    /// Host memory of the held columns and batches.
    fn bytes(&self) -> usize {
        self.pending.bytes() + self.fused.bytes()
    }
}

impl TopKRun {
    async fn run(&self) -> Result<RecordBatch> {
        let _timer = self.metrics.operator_time.timer();
        if let Some(prediction) = &self.spec.prediction
            && prediction.seconds.is_finite()
        {
            self.metrics
                .predicted_time
                .add_duration(std::time::Duration::from_secs_f64(prediction.seconds));
        }
        let plan = self.spec.plan;
        let streamed = match plan.input() {
            InputForm::Streamed => plan,
            InputForm::WholeTable => match self.run_whole_table(&plan).await? {
                WholeTable::Done(batch) => {
                    self.publisher.own.mark_complete();
                    self.metrics.output_rows.add(batch.num_rows());
                    return Ok(batch);
                }
                // A prefix layout's selection, and one whose program reads whole string
                // columns, run on the device over whole tables only.
                WholeTable::Stream => {
                    let whole_tables_only = !self.spec.layout.exact()
                        || (self.spec.fusion.program.as_ref()).is_some_and(|p| p.reads_strings());
                    policy::streamed_after_table(plan, whole_tables_only)
                }
                WholeTable::Cpu => policy::after_device_error(),
                WholeTable::Ties => policy::after_unranked_ties(),
            },
        };
        let shared = Arc::new(self.start(&streamed)?);
        if self.spec.k > 0 {
            // One task per input partition; dropping the JoinSet (cancellation) aborts them all.
            let mut tasks = JoinSet::new();
            for partition in 0..self.input.output_partitioning().partition_count() {
                let mut stream = self.input.execute(partition, Arc::clone(&self.context))?;
                let shared = Arc::clone(&shared);
                tasks.spawn(async move {
                    let mut offset = 0u64;
                    let mut local = PartitionState::default();
                    // The batches this partition holds for its next push, in the memory pool.
                    let held = shared.reservation.new_empty();
                    while let Some(batch) = stream.next().await {
                        let batch = batch?;
                        let first_id = select::row_id(partition, offset);
                        shared.offer(first_id, &batch, &mut local)?;
                        held.try_resize(local.bytes())?;
                        offset += batch.num_rows() as u64;
                    }
                    shared.flush(&mut local.pending)?;
                    shared.flush_fused(&mut local.fused)
                });
            }
            while let Some(result) = tasks.join_next().await {
                result.map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))??;
            }
        }

        let _timer = self.metrics.gather_time.timer();
        let winners = shared.finish()?;
        let skip = self.spec.skip.min(winners.len());
        let batch = shared
            .lock_store()
            .rows
            .gather(&winners[skip..], &self.schema)?;
        self.publisher.own.mark_complete();
        self.metrics.output_rows.add(batch.num_rows());
        if plan.warm_up() {
            self.warm_up();
        }
        Ok(batch)
    }

    /// What a selector of this run selects, with the query's device accounting and injected
    /// fault; `program`: the generated program it runs, if any.
    fn selection_spec(&self, program: Option<Arc<FusedProgram>>) -> SelectionSpec {
        let spec = &self.spec;
        let watch = device_watch(
            spec.device_memory_limit,
            spec.fault,
            &self.metrics.device_bytes_held,
            &self.metrics.device_peak_bytes,
            &self.metrics.pinned_bytes_held,
        );
        SelectionSpec {
            program,
            final_choice: spec
                .prediction
                .as_ref()
                .and_then(|p| p.model)
                .map(|m| Arc::new(m) as Arc<dyn select::FinalChoice>),
            fault: spec.fault,
            watch: Some(watch),
            transfers: self.metrics.transfers.clone(),
            refined_rows: self.metrics.rows_refined.clone(),
            device: spec.device.unwrap_or_default(),
            ..SelectionSpec::new(spec.layout.clone(), spec.k)
        }
    }

    /// Records a fallback from the GPU (`what` failed) and its reason, where `error` is a
    /// device error; returns whether it was one.
    fn fell_back(&self, what: &str, error: &DataFusionError) -> bool {
        let Some(device) = DeviceError::find(error) else {
            return false;
        };
        log::warn!("gpu-topk: {what} failed, the CPU path runs it: {device}");
        report_fallback(&self.fallback, device);
        self.metrics.gpu_fallbacks.add(1);
        true
    }

    /// The shared state of a streamed run, with the selector of `plan` (the CPU one where the
    /// GPU's cannot be built).
    fn start(&self, plan: &SelectionPlan) -> Result<RunState> {
        let program = match plan {
            SelectionPlan::Cuda { .. } => self.spec.fusion.program.clone(),
            SelectionPlan::Cpu { .. } => None,
        };
        let selection = self.selection_spec(program.clone());
        let fallible =
            plan.choice() != select::SelectionChoice::Cpu || self.spec.fault != FaultPoint::None;
        let mode = match select::create_selector(&selection, plan) {
            Ok(Selector::Streamed(selector)) => ActiveSelector {
                selector,
                program,
                fallible,
            },
            Ok(Selector::WholeTable(_)) => {
                return datafusion::common::internal_err!(
                    "a streamed run was given a whole-table selector"
                );
            }
            Err(e) if fallible && self.fell_back(&plan.choice().to_string(), &e) => {
                cpu_selector(&self.spec)?
            }
            Err(e) => return Err(e),
        };
        // (A zero duration would still count as 1 ns: DataFusion's timers never add nothing.)
        let compile_time = mode.selector.compile_time();
        if !compile_time.is_zero() {
            self.metrics.compile_time.add_duration(compile_time);
        }
        let input_schema = self.input.schema();
        let mut fields: Vec<Field> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect();
        let first_key = fields.len();
        for (i, sort) in self.spec.sort_exprs.iter().enumerate() {
            let key_type = sort.expr.data_type(&input_schema)?;
            fields.push(Field::new(format!("__gpu_topk_key_{i}"), key_type, true));
        }
        Ok(RunState {
            spec: Arc::clone(&self.spec),
            store: Mutex::new(StoreState {
                rows: RowStore::default(),
                mode: Arc::new(mode),
                published: None,
                prune: None,
            }),
            store_schema: Arc::new(Schema::new(fields)),
            first_key,
            publisher: self.publisher.clone(),
            reservation: self.reservation.new_empty(),
            metrics: self.metrics.clone(),
            fallback: Arc::clone(&self.fallback),
        })
    }
}

/// The CPU path's selector, which takes over after a device error.
fn cpu_selector(spec: &TopKSpec) -> Result<ActiveSelector> {
    let selection = SelectionSpec::new(spec.layout.clone(), spec.k);
    let selector = match select::create_selector(&selection, &policy::after_device_error())? {
        Selector::Streamed(selector) => selector,
        Selector::WholeTable(_) => {
            return datafusion::common::internal_err!("the CPU path streams its input");
        }
    };
    Ok(ActiveSelector {
        selector,
        program: None,
        fallible: false,
    })
}

impl RunState {
    fn lock_store(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn active(&self) -> Arc<ActiveSelector> {
        Arc::clone(&self.lock_store().mode)
    }

    /// Offers one input batch of a partition, whose first row has id `first_id`.
    fn offer(&self, first_id: u64, batch: &RecordBatch, local: &mut PartitionState) -> Result<()> {
        if batch.num_rows() == 0 {
            return check_empty_batch(&self.spec, batch);
        }
        self.metrics.rows_in.add(batch.num_rows());
        let mode = self.active();
        if mode.program.is_some() {
            return self.process_batch_fused(&mode, first_id, batch, &mut local.fused);
        }
        if !mode.fallible {
            // Batches this partition held for the GPU's program go first (row ids keep order).
            self.flush_fused(&mut local.fused)?;
            local.pending = PendingKeys::default(); // stored before the switch: the CPU has them
        }
        self.process_batch(first_id, batch, &mut local.pending)
    }

    /// Whether `error` is a device error of a fallible selection: the selection then moves
    /// to the CPU ([`fall_back`](Self::fall_back)) and the caller goes on there.
    fn falls_back(&self, mode: &ActiveSelector, error: &DataFusionError) -> Result<bool> {
        match DeviceError::find(error) {
            Some(device) if mode.fallible => {
                self.fall_back(device)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Moves the selection to the CPU after a device error: a CPU selector takes over every
    /// stored row (a superset of the GPU's candidates: the GPU only ever drops rows that cannot
    /// win) and selects the rest of the input. Idempotent: the first caller switches.
    fn fall_back(&self, error: &DeviceError) -> Result<()> {
        let mut store = self.lock_store();
        if !store.mode.fallible {
            return Ok(());
        }
        log::warn!("gpu-topk: the GPU selection failed, the CPU path continues it: {error}");
        report_fallback(&self.fallback, error);
        self.metrics.gpu_fallbacks.add(1);
        let mode = cpu_selector(&self.spec)?;
        store
            .rows
            .for_each_keys(self.first_key, |input| mode.selector.push(input).map(drop))?;
        store.mode = Arc::new(mode);
        self.publish_threshold(&mut store)
    }

    /// Ends the selection: the winners' row ids in output order.
    fn finish(&self) -> Result<Vec<u64>> {
        let mode = self.active();
        match mode.selector.finish() {
            Err(e) if self.falls_back(&mode, &e)? => self.active().selector.finish(),
            result => result,
        }
    }

    /// Tightens the dynamic filter when the selector's threshold moved.
    fn publish_threshold(&self, store: &mut StoreState) -> Result<()> {
        let Some(id) = store.mode.selector.threshold_row_id() else {
            return Ok(());
        };
        if store.published == Some(id) {
            return Ok(());
        }
        let Some(value) = store.rows.key_value(id, self.first_key)? else {
            return Ok(()); // not stored yet: its push is still in flight
        };
        store.published = Some(id);
        let first = self.spec.sort_exprs.first();
        // Not for floats (Parquet statistics leave NaNs out, so a scan would prune row groups
        // whose NaNs belong in the answer) nor dictionaries: see `compares_with_threshold`.
        if self.spec.layout.specs()[0].compares_with_threshold() && self.spec.scans_may_skip_rows()
        {
            self.publisher.publish(first, value.clone())?;
        }
        // The same bound over the stored rows' key column drops rows that can no longer win.
        let stored_key = PhysicalSortExpr::new(
            Arc::new(Column::new(
                self.store_schema.field(self.first_key).name(),
                self.first_key,
            )),
            first.options,
        );
        store.prune = threshold_predicate(&stored_key, &value)?;
        // Rows arriving from now on are cut before they are stored; the rows already stored are
        // cut when they have grown enough since the last cut (amortised O(1) per row).
        if store.rows.wants_retain(self.spec.k)
            && let Some(prune) = store.prune.clone()
        {
            store.rows.retain_where(&prune)?;
            self.reservation.try_resize(store.rows.bytes())?;
        }
        Ok(())
    }
}
