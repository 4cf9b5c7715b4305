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
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, Time};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

use super::TopKSpec;
use super::dynamic_filter::threshold_predicate;
use super::row_store::{RowStore, StoredBatch};
use crate::cost::SelectionChoice;
use crate::fusion::{self, FusedProgram, KernelInput};
use crate::select::{
    self, Admitted, ColumnsInput, RowIds, SelectInput, SelectionSpec, TopKSelector,
};

/// Metrics shown by `EXPLAIN ANALYZE`.
#[derive(Debug, Clone)]
struct TopKMetrics {
    rows_in: Count,
    rows_passed_filter: Count,
    output_rows: Count,
    gpu_fallbacks: Count,
    filter_time: Time,
    key_eval_time: Time,
    select_time: Time,
    retain_time: Time,
    gather_time: Time,
    /// Time this execution spent compiling (NVRTC) or loading its generated kernel: zero when
    /// the kernel was already in memory, as on a query's second run.
    compile_time: Time,
    /// The cost model's prediction of the operator's time (EXPLAIN ANALYZE shows it beside
    /// `operator_time`).
    predicted_time: Time,
    /// Wall time from the operator's start to its output: the selection of every partition's
    /// rows (and the wait for them), the final selection and the gather.
    operator_time: Time,
}

impl TopKMetrics {
    fn new(set: &ExecutionPlanMetricsSet) -> Self {
        let time = |name: &'static str| MetricBuilder::new(set).subset_time(name, 0);
        Self {
            rows_in: MetricBuilder::new(set).counter("rows_in", 0),
            rows_passed_filter: MetricBuilder::new(set).counter("rows_passed_filter", 0),
            output_rows: MetricBuilder::new(set).output_rows(0),
            gpu_fallbacks: MetricBuilder::new(set).counter("gpu_fallbacks", 0),
            filter_time: time("filter_time"),
            key_eval_time: time("key_eval_time"),
            select_time: time("select_time"),
            retain_time: time("retain_time"),
            gather_time: time("gather_time"),
            compile_time: time("compile_time"),
            predicted_time: time("predicted_time"),
            operator_time: time("operator_time"),
        }
    }
}

pub(super) fn execute(
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
    metrics: &ExecutionPlanMetricsSet,
    context: Arc<TaskContext>,
) -> Result<SendableRecordBatchStream> {
    let run = TopKRun {
        reservation: MemoryConsumer::new("GpuTopKExec").register(context.memory_pool()),
        input,
        spec,
        schema: Arc::clone(&schema),
        dynamic_filter,
        metrics: TopKMetrics::new(metrics),
        context,
    };
    Ok(Box::pin(RecordBatchStreamAdapter::new(
        schema,
        futures::stream::once(async move { run.run().await }),
    )))
}

/// One execution of the operator: what every attempt (GPU, then CPU fallback) shares.
struct TopKRun {
    input: Arc<dyn ExecutionPlan>,
    spec: Arc<TopKSpec>,
    schema: SchemaRef,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
    metrics: TopKMetrics,
    context: Arc<TaskContext>,
    reservation: MemoryReservation,
}

impl TopKRun {
    async fn run(&self) -> Result<RecordBatch> {
        let _timer = self.metrics.operator_time.timer();
        let choice = self.spec.choice;
        let batch = match self.select_all(choice).await {
            Ok(batch) => batch,
            Err(e) if choice != SelectionChoice::Cpu && is_device_error(&e) => {
                // A GPU fault never loses the query: run it again on the CPU path.
                log::warn!("gpu-topk: {choice} failed, falling back to the CPU path: {e}");
                self.metrics.gpu_fallbacks.add(1);
                self.select_all(SelectionChoice::Cpu).await?
            }
            Err(e) => return Err(e),
        };
        self.dynamic_filter.mark_complete();
        self.metrics.output_rows.add(batch.num_rows());
        Ok(batch)
    }
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

/// Errors raised by the device path (as opposed to errors of the query itself, such as an
/// overflow in a sort expression, which the CPU path would raise too).
fn is_device_error(e: &DataFusionError) -> bool {
    matches!(e.find_root(), DataFusionError::External(_))
        || e.to_string().contains(crate::select::DEVICE_ERROR_TAG)
}

/// State shared by the partition tasks of one run.
struct Shared {
    spec: Arc<TopKSpec>,
    /// The generated program the selector runs (predicate and keys on the device), if any.
    program: Option<Arc<FusedProgram>>,
    selector: Arc<dyn TopKSelector>,
    store: Mutex<StoreState>,
    store_schema: SchemaRef,
    dynamic_filter: Arc<DynamicFilterPhysicalExpr>,
    reservation: MemoryReservation,
    metrics: TopKMetrics,
}

struct StoreState {
    rows: RowStore,
    /// Row id of the threshold last published to the dynamic filter.
    published: Option<u64>,
    /// That threshold as a predicate over the stored rows (their first sort key): rows failing
    /// it cannot win, so rows admitted wholesale ([`Admitted::All`]) are cut with it.
    prune: Option<Arc<dyn PhysicalExpr>>,
}

impl TopKRun {
    async fn select_all(&self, choice: SelectionChoice) -> Result<RecordBatch> {
        // The generated program runs where the selection runs: on the GPU.
        let program = match choice {
            SelectionChoice::Cuda(_) => self.spec.fusion.program.clone(),
            SelectionChoice::Cpu => None,
        };
        let selection = SelectionSpec {
            layout: self.spec.layout.clone(),
            k: self.spec.k,
            program: program.clone(),
            final_model: self.spec.prediction.as_ref().and_then(|p| p.model),
        };
        let selector = select::create_selector(&selection, &choice)?;
        if choice == self.spec.choice
            && let Some(prediction) = &self.spec.prediction
            && prediction.seconds.is_finite()
        {
            self.metrics
                .predicted_time
                .add_duration(std::time::Duration::from_secs_f64(prediction.seconds));
        }
        // (A zero duration would still count as 1 ns: DataFusion's timers never add nothing.)
        let compile_time = selector.compile_time();
        if !compile_time.is_zero() {
            self.metrics.compile_time.add_duration(compile_time);
        }
        let input_schema = self.input.schema();
        let first_key_type = self.spec.sort_exprs.first().expr.data_type(&input_schema)?;
        let mut fields: Vec<Field> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect();
        fields.push(Field::new("__gpu_topk_first_key", first_key_type, true));
        let shared = Arc::new(Shared {
            spec: Arc::clone(&self.spec),
            program,
            selector: Arc::clone(&selector),
            store: Mutex::new(StoreState {
                rows: RowStore::default(),
                published: None,
                prune: None,
            }),
            store_schema: Arc::new(Schema::new(fields)),
            dynamic_filter: Arc::clone(&self.dynamic_filter),
            reservation: self.reservation.new_empty(),
            metrics: self.metrics.clone(),
        });

        if self.spec.k > 0 {
            // One task per input partition; dropping the JoinSet (cancellation) aborts them all.
            let mut tasks = JoinSet::new();
            for partition in 0..self.input.output_partitioning().partition_count() {
                let mut stream = self.input.execute(partition, Arc::clone(&self.context))?;
                let shared = Arc::clone(&shared);
                tasks.spawn(async move {
                    let mut offset = 0u64;
                    let mut pending = Pending::default();
                    let mut fused = FusedPending::default();
                    while let Some(batch) = stream.next().await {
                        let batch = batch?;
                        if shared.program.is_some() {
                            shared.process_batch_fused(partition, offset, &batch, &mut fused)?;
                        } else {
                            shared.process_batch(partition, offset, &batch, &mut pending)?;
                        }
                        offset += batch.num_rows() as u64;
                    }
                    shared.flush(&mut pending)?;
                    shared.flush_fused(&mut fused)
                });
            }
            while let Some(result) = tasks.join_next().await {
                result.map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))??;
            }
        }

        let _timer = self.metrics.gather_time.timer();
        let winners = selector.finish()?;
        let skip = self.spec.skip.min(winners.len());
        let store = shared.store.lock().unwrap_or_else(|e| e.into_inner());
        store.rows.gather(&winners[skip..], &self.schema)
    }
}

/// Key columns of one partition waiting to be pushed as one larger batch (for selectors that
/// admit every row and prefer large pushes, i.e. the GPU).
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

impl Shared {
    fn lock_store(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pushes the pending rows of a partition as one batch.
    fn flush(&self, pending: &mut Pending) -> Result<()> {
        if pending.rows() == 0 {
            return Ok(());
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
        let admitted = self.selector.push(SelectInput {
            keys: &columns,
            row_ids,
        })?;
        if admitted != Admitted::All {
            return datafusion::common::internal_err!(
                "a selector that prefers batched pushes must admit every row"
            );
        }
        *pending = Pending::default();
        // A push may have moved the threshold (the partition's last push included).
        self.publish_threshold(&mut self.lock_store())
    }

    /// Filter, key evaluation, selection and retention of one input batch.
    fn process_batch(
        &self,
        partition: usize,
        offset: u64,
        batch: &RecordBatch,
        pending: &mut Pending,
    ) -> Result<()> {
        let n = batch.num_rows();
        if n == 0 {
            return Ok(());
        }
        let metrics = &self.metrics;
        metrics.rows_in.add(n);
        let first_id = select::row_id(partition, offset);

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
                if passed == n {
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
        metrics.rows_passed_filter.add(m);

        // 2. The ranking keys, on the surviving rows only (as DataFusion evaluates them).
        let keys: Vec<ArrayRef> = {
            let _timer = metrics.key_eval_time.timer();
            self.spec
                .sort_exprs
                .iter()
                .map(|s| s.expr.evaluate(&filtered)?.into_array(m))
                .collect::<Result<_>>()?
        };

        // 3. Selection.
        let row_ids = match &explicit_ids {
            Some(ids) => RowIds::Explicit(ids),
            None => RowIds::Range(first_id),
        };
        let batched = self.selector.preferred_push_rows();
        let admitted = if batched > 0 {
            pending.add(keys.clone(), row_ids, m);
            if pending.rows() >= batched {
                self.flush(pending)?;
            }
            Admitted::All
        } else {
            let _timer = metrics.select_time.timer();
            self.selector.push(SelectInput {
                keys: &keys,
                row_ids,
            })?
        };

        // 4. Late materialisation: keep the output columns of admitted rows only.
        let _timer = metrics.retain_time.timer();
        let mut columns: Vec<ArrayRef> = self
            .spec
            .output_exprs
            .iter()
            .map(|e| e.evaluate(&filtered)?.into_array(m))
            .collect::<Result<_>>()?;
        columns.push(Arc::clone(&keys[0]));
        let admitted_all = admitted == Admitted::All;
        let (columns, ids) = match admitted {
            Admitted::All => (columns, None),
            Admitted::Indices(indices) if indices.is_empty() => return Ok(()),
            Admitted::Indices(indices) if indices.len() == m => (columns, None),
            Admitted::Indices(indices) => {
                let ids: Vec<u64> = indices.iter().map(|&i| row_ids.get(i as usize)).collect();
                let indices = UInt32Array::from(indices);
                let columns = columns
                    .iter()
                    .map(|c| take(c.as_ref(), &indices, None))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                (columns, Some(ids))
            }
        };
        let retained = RecordBatch::try_new(Arc::clone(&self.store_schema), columns)?;
        let mut rows = match (ids, explicit_ids) {
            (Some(ids), _) | (None, Some(ids)) => StoredBatch::list(ids, retained),
            (None, None) => StoredBatch::range(first_id, retained),
        };
        let prune = self.lock_store().prune.clone();
        if admitted_all && let Some(prune) = prune {
            match rows.filter(&prune)? {
                Some(kept) => rows = kept,
                None => return Ok(()),
            }
        }
        let mut store = self.lock_store();
        store.rows.insert(rows);
        if store.rows.wants_retain(self.spec.k)
            && let Some(live) = self.selector.live_row_ids()?
        {
            store.rows.retain(&live)?;
        }
        self.reservation.try_resize(store.rows.bytes())?;
        self.publish_threshold(&mut store)
    }

    /// The fused path's per-batch work: the predicate on the host only when the program does
    /// not evaluate it; everything else happens in [`flush_fused`](Self::flush_fused).
    fn process_batch_fused(
        &self,
        partition: usize,
        offset: u64,
        batch: &RecordBatch,
        pending: &mut FusedPending,
    ) -> Result<()> {
        let n = batch.num_rows();
        if n == 0 {
            return Ok(());
        }
        self.metrics.rows_in.add(n);
        let program = self.program.as_ref().expect("the fused path has a program");
        let first_id = select::row_id(partition, offset);
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
        pending.rows += n;
        if pending.rows >= self.selector.preferred_push_rows() {
            self.flush_fused(pending)?;
        }
        Ok(())
    }

    /// Pushes a partition's pending batches to the program, then keeps the output columns of
    /// the rows it appended.
    fn flush_fused(&self, pending: &mut FusedPending) -> Result<()> {
        if pending.rows == 0 {
            return Ok(());
        }
        let pending = std::mem::take(pending);
        let program = self.program.as_ref().expect("the fused path has a program");
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
            self.selector.push_columns(ColumnsInput {
                columns: &columns,
                first_id: pending.first_id,
            })?
        };
        self.metrics.rows_passed_filter.add(admitted.passed);

        // Late materialisation of the appended rows, batch by batch.
        let _timer = self.metrics.retain_time.timer();
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
                let mut columns: Vec<ArrayRef> = self
                    .spec
                    .output_exprs
                    .iter()
                    .map(|e| e.evaluate(&taken)?.into_array(m))
                    .collect::<Result<_>>()?;
                columns.push(
                    self.spec
                        .sort_exprs
                        .first()
                        .expr
                        .evaluate(&taken)?
                        .into_array(m)?,
                );
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
        for rows in stored {
            store.rows.insert(rows);
        }
        self.reservation.try_resize(store.rows.bytes())?;
        self.publish_threshold(&mut store)
    }

    /// Tightens the dynamic filter when the selector's threshold moved.
    fn publish_threshold(&self, store: &mut StoreState) -> Result<()> {
        let Some(id) = self.selector.threshold_row_id() else {
            return Ok(());
        };
        if store.published == Some(id) {
            return Ok(());
        }
        let Some(value) = store.rows.key_value(id)? else {
            return Ok(()); // not stored yet: its push is still in flight
        };
        store.published = Some(id);
        let first = self.spec.sort_exprs.first();
        if let Some(predicate) = threshold_predicate(first, &value)? {
            self.dynamic_filter.update(predicate)?;
        }
        // The same bound over the stored rows' key column drops rows that can no longer win.
        let key_index = self.store_schema.fields().len() - 1;
        let stored_key = PhysicalSortExpr::new(
            Arc::new(Column::new(
                self.store_schema.field(key_index).name(),
                key_index,
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
