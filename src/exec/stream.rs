//! The operator's execution (see the module documentation of [`super`]).

use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch, UInt32Array};
use datafusion::arrow::compute::kernels::take::take;
use datafusion::arrow::compute::{
    concat, filter_record_batch, prep_null_mask_filter, take_record_batch,
};
use datafusion::arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::common::runtime::JoinSet;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::physical_expr::expressions::{Column, DynamicFilterPhysicalExpr};
use datafusion::physical_expr::{PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, Time,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

mod resident;

use super::TopKSpec;
use super::dynamic_filter::threshold_predicate;
use super::row_store::{RowStore, StoredBatch};
use crate::config::FaultPoint;
use crate::cost::SelectionChoice;
use crate::device::watch::DeviceWatch;
use crate::fusion::{self, FusedProgram, KernelInput};
use crate::select::{
    self, Admitted, ColumnsInput, RowIds, SelectInput, SelectionSpec, TopKSelector, TransferMetrics,
};

/// Metrics shown by `EXPLAIN ANALYZE`.
#[derive(Debug, Clone)]
struct TopKMetrics {
    rows_in: Count,
    rows_passed_filter: Count,
    output_rows: Count,
    gpu_fallbacks: Count,
    /// Device and pinned host bytes the selection holds now (zero once a run is over) and
    /// the most device bytes it held at once.
    device_bytes_held: Gauge,
    pinned_bytes_held: Gauge,
    device_peak_bytes: Gauge,
    filter_time: Time,
    key_eval_time: Time,
    select_time: Time,
    retain_time: Time,
    gather_time: Time,
    /// Time spent decoding a Parquet input's columns for the column cache.
    read_time: Time,
    /// Time this execution spent compiling (NVRTC) or loading its generated kernel: zero when
    /// the kernel was already in memory, as on a query's second run.
    compile_time: Time,
    /// The cost model's prediction of the operator's time (EXPLAIN ANALYZE shows it beside
    /// `operator_time`).
    predicted_time: Time,
    /// Wall time from the operator's start to its output: the selection of every partition's
    /// rows (and the wait for them), the final selection and the gather.
    operator_time: Time,
    /// The device selection's input: pushes served by the column cache or shipped, and bytes.
    transfers: TransferMetrics,
}

impl TopKMetrics {
    fn new(set: &ExecutionPlanMetricsSet) -> Self {
        let time = |name: &'static str| MetricBuilder::new(set).subset_time(name, 0);
        Self {
            rows_in: MetricBuilder::new(set).counter("rows_in", 0),
            rows_passed_filter: MetricBuilder::new(set).counter("rows_passed_filter", 0),
            output_rows: MetricBuilder::new(set).output_rows(0),
            gpu_fallbacks: MetricBuilder::new(set).counter("gpu_fallbacks", 0),
            device_bytes_held: MetricBuilder::new(set).gauge("device_bytes_held", 0),
            pinned_bytes_held: MetricBuilder::new(set).gauge("pinned_bytes_held", 0),
            device_peak_bytes: MetricBuilder::new(set).gauge("device_peak_bytes", 0),
            filter_time: time("filter_time"),
            key_eval_time: time("key_eval_time"),
            select_time: time("select_time"),
            retain_time: time("retain_time"),
            gather_time: time("gather_time"),
            read_time: time("read_time"),
            compile_time: time("compile_time"),
            predicted_time: time("predicted_time"),
            operator_time: time("operator_time"),
            transfers: TransferMetrics {
                cache_hits: MetricBuilder::new(set).counter("cache_hits", 0),
                cache_misses: MetricBuilder::new(set).counter("cache_misses", 0),
                resident_bytes: MetricBuilder::new(set).counter("resident_bytes", 0),
                uploaded_bytes: MetricBuilder::new(set).counter("uploaded_bytes", 0),
                upload_time: time("upload_time"),
            },
        }
    }
}

pub(super) fn execute(
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
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
        dynamic_filter,
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
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
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

/// Errors raised by the device path (as opposed to errors of the query itself, such as an
/// overflow in a sort expression, which the CPU path would raise too).
fn is_device_error(e: &DataFusionError) -> bool {
    matches!(e.find_root(), DataFusionError::External(_))
        || e.to_string().contains(crate::select::DEVICE_ERROR_TAG)
}

/// Records why a run left the GPU (the device error's text, without the tag).
fn report_fallback(fallback: &Mutex<Option<String>>, error: &DataFusionError) {
    let text = error.to_string();
    let text = match text.find(crate::select::DEVICE_ERROR_TAG) {
        Some(at) => text[at + crate::select::DEVICE_ERROR_TAG.len()..]
            .trim()
            .to_string(),
        None => text,
    };
    if let Ok(mut reason) = fallback.lock() {
        reason.get_or_insert(text);
    }
}

/// Where the selection runs. A run starts on the GPU when the cost model chose it and moves to
/// the CPU at the first device error ([`Shared::fall_back`]); it never moves back.
struct Mode {
    selector: Arc<dyn TopKSelector>,
    /// The generated program the selector runs (predicate and keys on the device), if any.
    program: Option<Arc<FusedProgram>>,
    /// Whether the selector can fail like a device (the GPU's, or one with an injected fault),
    /// to be taken over by the CPU path.
    fallible: bool,
}

/// State shared by the partition tasks of one run.
struct Shared {
    spec: Arc<TopKSpec>,
    store: Mutex<StoreState>,
    store_schema: SchemaRef,
    /// Index of the first sort key's column in the stored batches (the keys follow it).
    first_key: usize,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
    reservation: MemoryReservation,
    metrics: TopKMetrics,
    fallback: Arc<Mutex<Option<String>>>,
}

struct StoreState {
    rows: RowStore,
    /// Switched under this lock, so every row of the input is either stored before the switch
    /// (and handed to the CPU selector with the rest of the store) or processed on the CPU
    /// after it: a GPU push whose rows arrive after a switch is processed again.
    mode: Arc<Mode>,
    /// Row id of the threshold last published to the dynamic filter.
    published: Option<u64>,
    /// That threshold as a predicate over the stored rows (their first sort key): rows failing
    /// it cannot win, so rows admitted wholesale ([`Admitted::All`]) are cut with it.
    prune: Option<Arc<dyn PhysicalExpr>>,
}

/// What one partition task holds between batches.
#[derive(Default)]
struct PartitionState {
    pending: Pending,
    fused: FusedPending,
}

impl PartitionState {
    /// Host memory of the held columns and batches.
    fn bytes(&self) -> usize {
        let keys = self.pending.keys.iter().flatten();
        let arrays = keys.chain(&self.fused.predicates);
        arrays.map(|a| a.get_array_memory_size()).sum::<usize>()
            + 8 * self.pending.ids.capacity()
            + (self.fused.batches.iter())
                .map(RecordBatch::get_array_memory_size)
                .sum::<usize>()
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
        let on_cpu = match self.run_whole_table().await? {
            resident::Resident::Done(batch) => {
                self.dynamic_filter.mark_complete();
                self.metrics.output_rows.add(batch.num_rows());
                return Ok(batch);
            }
            resident::Resident::Stream => false,
            resident::Resident::Cpu => true,
        };
        let shared = Arc::new(self.start(on_cpu)?);
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
        self.dynamic_filter.mark_complete();
        self.metrics.output_rows.add(batch.num_rows());
        if self.spec.warm_up {
            self.warm_up();
        }
        Ok(batch)
    }

    /// The shared state, with the selector the cost model chose (the CPU one if the GPU's
    /// cannot be built, or `on_cpu`).
    fn start(&self, on_cpu: bool) -> Result<Shared> {
        let choice = match on_cpu {
            true => SelectionChoice::Cpu,
            false => self.spec.choice,
        };
        let program = match choice {
            SelectionChoice::Cuda(_) => self.spec.fusion.program.clone(),
            SelectionChoice::Cpu => None,
        };
        let fault = self.spec.fault;
        let device_fault = match fault {
            FaultPoint::Device(op, n) => Some((op, n)),
            _ => None,
        };
        let watch = DeviceWatch::new(
            self.spec.device_memory_limit,
            device_fault,
            self.metrics.device_bytes_held.clone(),
            self.metrics.device_peak_bytes.clone(),
            self.metrics.pinned_bytes_held.clone(),
        );
        let selection = SelectionSpec {
            fault,
            watch: Some(Arc::new(watch)),
            transfers: self.metrics.transfers.clone(),
            ..selection_spec(&self.spec, program.clone())
        };
        let fallible = choice != SelectionChoice::Cpu || fault != FaultPoint::None;
        let mode = match select::create_selector(&selection, &choice) {
            Ok(selector) => Mode {
                selector,
                program,
                fallible,
            },
            Err(e) if fallible && is_device_error(&e) => {
                log::warn!("gpu-topk: {choice} unavailable, running on the CPU path: {e}");
                report_fallback(&self.fallback, &e);
                self.metrics.gpu_fallbacks.add(1);
                cpu_mode(&self.spec)?
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
        Ok(Shared {
            spec: Arc::clone(&self.spec),
            store: Mutex::new(StoreState {
                rows: RowStore::default(),
                mode: Arc::new(mode),
                published: None,
                prune: None,
            }),
            store_schema: Arc::new(Schema::new(fields)),
            first_key,
            dynamic_filter: Arc::clone(&self.dynamic_filter),
            reservation: self.reservation.new_empty(),
            metrics: self.metrics.clone(),
            fallback: Arc::clone(&self.fallback),
        })
    }
}

/// What the selector selects; `program`: the generated program it runs, if any.
fn selection_spec(spec: &TopKSpec, program: Option<Arc<FusedProgram>>) -> SelectionSpec {
    SelectionSpec {
        program,
        final_choice: spec
            .prediction
            .as_ref()
            .and_then(|p| p.model)
            .map(|m| Arc::new(m) as Arc<dyn select::FinalChoice>),
        ..SelectionSpec::new(spec.layout.clone(), spec.k)
    }
}

fn cpu_mode(spec: &TopKSpec) -> Result<Mode> {
    Ok(Mode {
        selector: select::create_selector(&selection_spec(spec, None), &SelectionChoice::Cpu)?,
        program: None,
        fallible: false,
    })
}

/// Key columns of one partition waiting to be pushed as one larger batch (for selectors that
/// admit every row and prefer large pushes, i.e. the GPU). Their rows are already stored.
#[derive(Default)]
struct Pending {
    keys: Vec<Vec<ArrayRef>>,
    /// Row ids of the pending rows, in order.
    ids: Vec<u64>,
    /// Whether `ids` is one consecutive range (then it is not uploaded).
    consecutive: bool,
}

impl Pending {
    fn rows(&self) -> usize {
        self.ids.len()
    }

    fn add(&mut self, keys: Vec<ArrayRef>, row_ids: RowIds<'_>, rows: usize) {
        let contiguous = match (self.ids.last(), row_ids) {
            (None, RowIds::Range(_)) => true,
            (Some(&last), RowIds::Range(start)) => self.consecutive && start == last + 1,
            (_, RowIds::Explicit(_)) => false,
        };
        self.consecutive = contiguous;
        self.ids.extend((0..rows).map(|i| row_ids.get(i)));
        self.keys.push(keys);
    }
}

/// Input batches of one partition waiting to be pushed, as one larger batch, to a selector that
/// runs the generated program. Their rows have consecutive ids from `first_id`.
#[derive(Default)]
struct FusedPending {
    batches: Vec<RecordBatch>,
    /// Each batch's host-evaluated predicate, when the program takes one.
    predicates: Vec<ArrayRef>,
    first_id: u64,
    rows: usize,
}

impl FusedPending {
    /// The batches with the row id of each one's first row.
    fn with_ids(&self) -> impl Iterator<Item = (u64, &RecordBatch)> {
        self.batches.iter().scan(self.first_id, |next, batch| {
            let first = *next;
            *next += batch.num_rows() as u64;
            Some((first, batch))
        })
    }
}

impl Shared {
    fn lock_store(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mode(&self) -> Arc<Mode> {
        Arc::clone(&self.lock_store().mode)
    }

    /// Offers one input batch of a partition, whose first row has id `first_id`.
    fn offer(&self, first_id: u64, batch: &RecordBatch, local: &mut PartitionState) -> Result<()> {
        if batch.num_rows() == 0 {
            return check_empty_batch(&self.spec, batch);
        }
        self.metrics.rows_in.add(batch.num_rows());
        let mode = self.mode();
        if mode.program.is_some() {
            return self.process_batch_fused(&mode, first_id, batch, &mut local.fused);
        }
        if !mode.fallible {
            // Batches this partition held for the GPU's program go first (row ids keep order).
            self.flush_fused(&mut local.fused)?;
            local.pending = Pending::default(); // stored before the switch: the CPU has them
        }
        self.process_batch(&mode, first_id, batch, &mut local.pending)
    }

    /// Moves the selection to the CPU after a device error: a CPU selector takes over every
    /// stored row (a superset of the GPU's candidates: the GPU only ever drops rows that cannot
    /// win) and selects the rest of the input. Idempotent: the first caller switches.
    fn fall_back(&self, error: &DataFusionError) -> Result<()> {
        let mut store = self.lock_store();
        if !store.mode.fallible {
            return Ok(());
        }
        log::warn!("gpu-topk: the GPU selection failed, the CPU path continues it: {error}");
        report_fallback(&self.fallback, error);
        self.metrics.gpu_fallbacks.add(1);
        let mode = cpu_mode(&self.spec)?;
        store
            .rows
            .for_each_keys(self.first_key, |input| mode.selector.push(input).map(drop))?;
        store.mode = Arc::new(mode);
        self.publish_threshold(&mut store)
    }

    /// Ends the selection: the winners' row ids in output order.
    fn finish(&self) -> Result<Vec<u64>> {
        let mode = self.mode();
        match mode.selector.finish() {
            Err(e) if mode.fallible && is_device_error(&e) => {
                self.fall_back(&e)?;
                self.mode().selector.finish()
            }
            result => result,
        }
    }

    /// Pushes the pending rows of a partition as one batch (their rows are stored already).
    fn flush(&self, pending: &mut Pending) -> Result<()> {
        if pending.rows() == 0 {
            return Ok(());
        }
        let pending = std::mem::take(pending);
        let mode = self.mode();
        if !mode.fallible {
            return Ok(()); // stored before the switch: the CPU selector has them
        }
        let _timer = self.metrics.select_time.timer();
        let columns = (0..self.spec.sort_exprs.len())
            .map(|c| {
                let parts: Vec<&dyn Array> = pending.keys.iter().map(|k| k[c].as_ref()).collect();
                Ok(concat(&parts)?)
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let row_ids = if pending.consecutive {
            RowIds::Range(pending.ids[0])
        } else {
            RowIds::Explicit(&pending.ids)
        };
        let admitted = match mode.selector.push(SelectInput {
            keys: &columns,
            row_ids,
        }) {
            Ok(admitted) => admitted,
            Err(e) if is_device_error(&e) => return self.fall_back(&e),
            Err(e) => return Err(e),
        };
        if admitted != Admitted::All {
            return datafusion::common::internal_err!(
                "a selector that prefers batched pushes must admit every row"
            );
        }
        // A push may have moved the threshold (the partition's last push included).
        self.publish_threshold(&mut self.lock_store())
    }

    /// Filter, key evaluation, selection and retention of one input batch, with the selector
    /// of `mode` (which evaluates no program).
    fn process_batch(
        &self,
        mode: &Arc<Mode>,
        first_id: u64,
        batch: &RecordBatch,
        pending: &mut Pending,
    ) -> Result<()> {
        let metrics = &self.metrics;

        // 1. The fused predicate.
        let mut explicit_ids: Option<Vec<u64>> = None;
        let filtered = match &self.spec.filter {
            None => batch.clone(),
            Some(predicate) => {
                let _timer = metrics.filter_time.timer();
                let mask = predicate_mask(predicate, batch)?;
                let passed = mask.true_count();
                if passed == 0 {
                    return Ok(());
                }
                if passed == batch.num_rows() {
                    batch.clone()
                } else {
                    explicit_ids = Some(
                        mask.values()
                            .set_indices()
                            .map(|i| first_id + i as u64)
                            .collect(),
                    );
                    filter_record_batch(batch, &mask)?
                }
            }
        };
        let m = filtered.num_rows();

        // 2. The ranking keys, on the surviving rows only (as DataFusion evaluates them).
        let keys: Vec<ArrayRef> = {
            let _timer = metrics.key_eval_time.timer();
            self.spec
                .sort_exprs
                .iter()
                .map(|s| s.expr.evaluate(&filtered)?.into_array(m))
                .collect::<Result<_>>()?
        };

        // 3. Selection: a selector that prefers large pushes admits every row, and gets the
        //    keys once the rows are stored (step 5).
        let row_ids = match &explicit_ids {
            Some(ids) => RowIds::Explicit(ids),
            None => RowIds::Range(first_id),
        };
        let batched = mode.selector.preferred_push_rows() > 0;
        let admitted = if batched {
            Admitted::All
        } else {
            let _timer = metrics.select_time.timer();
            match mode.selector.push(SelectInput {
                keys: &keys,
                row_ids,
            }) {
                Ok(admitted) => admitted,
                Err(e) if mode.fallible && is_device_error(&e) => {
                    // Nothing of this batch is stored yet: the CPU path takes it whole.
                    self.fall_back(&e)?;
                    return self.process_batch(&self.mode(), first_id, batch, pending);
                }
                Err(e) => return Err(e),
            }
        };

        // 4. Late materialisation: keep the output columns (and keys) of admitted rows only.
        let retain_timer = metrics.retain_time.timer();
        let mut columns: Vec<ArrayRef> = self
            .spec
            .output_exprs
            .iter()
            .map(|e| e.evaluate(&filtered)?.into_array(m))
            .collect::<Result<_>>()?;
        columns.extend(keys.iter().cloned());
        let (columns, ids) = match &admitted {
            Admitted::All => (columns, None),
            Admitted::Indices(indices) if indices.is_empty() => {
                metrics.rows_passed_filter.add(m);
                return Ok(());
            }
            Admitted::Indices(indices) if indices.len() == m => (columns, None),
            Admitted::Indices(indices) => {
                let ids: Vec<u64> = indices.iter().map(|&i| row_ids.get(i as usize)).collect();
                let indices = UInt32Array::from(indices.clone());
                let columns = columns
                    .iter()
                    .map(|c| take(c.as_ref(), &indices, None))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                (columns, Some(ids))
            }
        };
        let retained = RecordBatch::try_new(Arc::clone(&self.store_schema), columns)?;
        let mut rows = Some(match (ids, explicit_ids.clone()) {
            (Some(ids), _) | (None, Some(ids)) => StoredBatch::list(ids, retained),
            (None, None) => StoredBatch::range(first_id, retained),
        });
        let prune = self.lock_store().prune.clone();
        if batched
            && let Some(prune) = prune
            && let Some(all) = rows.take()
        {
            rows = all.filter(&prune)?;
        }
        {
            let mut store = self.lock_store();
            if !Arc::ptr_eq(&store.mode, mode) {
                // The selection moved to the CPU while this batch was on its way: the CPU
                // selector has not seen it.
                drop(store);
                drop(retain_timer);
                let mode = self.mode();
                return self.process_batch(&mode, first_id, batch, pending);
            }
            metrics.rows_passed_filter.add(m);
            if let Some(rows) = rows {
                store.rows.insert(rows);
                if store.rows.wants_retain(self.spec.k)
                    && let Some(live) = mode.selector.live_row_ids()?
                {
                    store.rows.retain(&live)?;
                }
                self.reservation.try_resize(store.rows.bytes())?;
            }
            self.publish_threshold(&mut store)?;
        }
        drop(retain_timer);

        // 5. The batched push, after the rows are stored: should it fail, the CPU selector
        //    takes them over from the store.
        if batched {
            pending.add(keys, row_ids, m);
            if pending.rows() >= mode.selector.preferred_push_rows() {
                self.flush(pending)?;
            }
        }
        Ok(())
    }

    /// The fused path's per-batch work: the predicate on the host only when the program does
    /// not evaluate it; everything else happens in [`flush_fused`](Self::flush_fused).
    fn process_batch_fused(
        &self,
        mode: &Arc<Mode>,
        first_id: u64,
        batch: &RecordBatch,
        pending: &mut FusedPending,
    ) -> Result<()> {
        let program = mode.program.as_ref().expect("the fused path has a program");
        let predicate = match (&self.spec.filter, program.host_predicate()) {
            (Some(predicate), true) => {
                let _timer = self.metrics.filter_time.timer();
                let mask = predicate_mask(predicate, batch)?;
                if mask.true_count() == 0 {
                    return Ok(());
                }
                Some(Arc::new(mask) as ArrayRef)
            }
            _ => None,
        };
        if pending.rows > 0
            && (pending.first_id + pending.rows as u64 != first_id // ids must stay consecutive
                || !program.same_dictionaries(&pending.batches[0], batch))
        {
            self.flush_fused(pending)?;
        }
        if pending.rows == 0 {
            pending.first_id = first_id;
        }
        pending.batches.push(batch.clone());
        pending.predicates.extend(predicate);
        pending.rows += batch.num_rows();
        if pending.rows >= mode.selector.preferred_push_rows() {
            self.flush_fused(pending)?;
        }
        Ok(())
    }

    /// Pushes a partition's pending batches to the program, then keeps the output columns and
    /// keys of the rows it appended. After a device error (this push's or another's) the
    /// batches go through the CPU path instead.
    fn flush_fused(&self, pending: &mut FusedPending) -> Result<()> {
        if pending.rows == 0 {
            return Ok(());
        }
        let pending = std::mem::take(pending);
        let mode = self.mode();
        match &mode.program {
            Some(program) => match self.push_fused(&mode, program, &pending) {
                Ok(true) => Ok(()),
                // The selection moved to the CPU meanwhile: these rows are not stored.
                Ok(false) => self.process_on_cpu(&pending),
                Err(e) if is_device_error(&e) => {
                    self.fall_back(&e)?;
                    self.process_on_cpu(&pending)
                }
                Err(e) => Err(e),
            },
            None => self.process_on_cpu(&pending),
        }
    }

    /// The batches of a push, through the CPU path (its selector is the current one).
    fn process_on_cpu(&self, pending: &FusedPending) -> Result<()> {
        let mode = self.mode();
        for (first_id, batch) in pending.with_ids() {
            self.process_batch(&mode, first_id, batch, &mut Pending::default())?;
        }
        Ok(())
    }

    /// One push to the generated program. `Ok(false)`: the rows were not stored, because the
    /// selection moved to the CPU while the push ran.
    fn push_fused(
        &self,
        mode: &Arc<Mode>,
        program: &FusedProgram,
        pending: &FusedPending,
    ) -> Result<bool> {
        let admitted = {
            let _timer = self.metrics.select_time.timer();
            let columns: Vec<Vec<ArrayRef>> = program
                .inputs
                .iter()
                .map(|input| {
                    Ok(match input {
                        KernelInput::Column(c) => pending
                            .batches
                            .iter()
                            .map(|b| Arc::clone(b.column(*c)))
                            .collect(),
                        KernelInput::HostPredicate => pending.predicates.clone(),
                        KernelInput::DictionaryCodes(c) => pending
                            .batches
                            .iter()
                            .map(|b| fusion::dictionary_codes(b.column(*c)))
                            .collect::<Result<_>>()?,
                        // The push's batches share one dictionary (`process_batch_fused`).
                        KernelInput::DictionaryMatch { column, values } => {
                            vec![fusion::dictionary_match(
                                pending.batches[0].column(*column),
                                values,
                            )?]
                        }
                    })
                })
                .collect::<Result<_>>()?;
            mode.selector.push_columns(ColumnsInput {
                columns: &columns,
                first_id: pending.first_id,
            })?
        };

        // Late materialisation of the appended rows, batch by batch.
        let retain_timer = self.metrics.retain_time.timer();
        let mut rows = admitted.rows.as_slice();
        let mut stored = Vec::new();
        let mut base = 0u32;
        for batch in &pending.batches {
            let len = batch.num_rows() as u32;
            let (mine, rest) = rows.split_at(rows.partition_point(|&r| r < base + len));
            rows = rest;
            if !mine.is_empty() {
                let indices = UInt32Array::from_iter_values(mine.iter().map(|r| r - base));
                let taken = take_record_batch(batch, &indices)?;
                let m = taken.num_rows();
                let columns: Vec<ArrayRef> = self
                    .spec
                    .output_exprs
                    .iter()
                    .chain(self.spec.sort_exprs.iter().map(|s| &s.expr))
                    .map(|e| e.evaluate(&taken)?.into_array(m))
                    .collect::<Result<_>>()?;
                let retained = RecordBatch::try_new(Arc::clone(&self.store_schema), columns)?;
                let ids = mine
                    .iter()
                    .map(|&r| pending.first_id + u64::from(r))
                    .collect();
                stored.push(StoredBatch::list(ids, retained));
            }
            base += len;
        }
        let mut store = self.lock_store();
        if !Arc::ptr_eq(&store.mode, mode) {
            return Ok(false);
        }
        self.metrics.rows_passed_filter.add(admitted.passed);
        for rows in stored {
            store.rows.insert(rows);
        }
        self.reservation.try_resize(store.rows.bytes())?;
        self.publish_threshold(&mut store)?;
        drop(retain_timer);
        Ok(true)
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
        // Not for floats: Parquet statistics leave NaNs out, so a scan would prune row groups
        // whose NaNs (greatest, or as −NaN smallest) belong in the answer.
        let float_key = self
            .store_schema
            .field(self.first_key)
            .data_type()
            .is_floating();
        if !float_key
            && self.spec.scans_may_skip_rows()
            && let Some(predicate) = threshold_predicate(first, &value)?
        {
            self.dynamic_filter.update(predicate)?;
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
