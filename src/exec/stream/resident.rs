//! The operator over a whole in-memory table on the GPU: when the input is a memory source and
//! the generated program reads only its columns, the program runs once over every row, its
//! input columns read from the device's column cache (uploaded into it on the first query),
//! and the host touches only the winners. Nothing is read from the scan: the batches come
//! straight from the memory source, and only the `k` winning rows' output columns are
//! evaluated, from those batches, as DataFusion evaluates a projection above its TopK.
//!
//! Row ids are positions in the table, partition by partition, the streaming path's input
//! order: ties resolve the same way on both paths.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, new_null_array};
use datafusion::arrow::compute::interleave;
use datafusion::arrow::datatypes::Schema;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::utils::collect_columns;

use super::{
    TopKRun, check_empty_batch, is_device_error, report_fallback, selection_spec,
    threshold_predicate,
};
use crate::config::FaultPoint;
use crate::cost::SelectionChoice;
use crate::device::watch::DeviceWatch;
use crate::exec::{memory_input, table_inputs};
use crate::select::SelectionSpec;
use crate::select::resident::select_table;

/// How a run over a resident table ended.
pub(super) enum Resident {
    /// The result.
    Done(RecordBatch),
    /// The table path does not apply (or the columns do not fit the cache): stream the input.
    Stream,
    /// The device failed: stream the input on the CPU path.
    Cpu,
}

impl TopKRun {
    /// The run over the whole table, where it applies (see the module documentation).
    pub(super) fn run_resident(&self) -> Result<Resident> {
        let spec = &self.spec;
        let (SelectionChoice::Cuda(algorithm), Some(program), Some(cache)) =
            (spec.choice, &spec.fusion.program, &spec.cache)
        else {
            return Ok(Resident::Stream);
        };
        // Selector-level faults are injected into the streaming selector.
        if spec.k == 0 || !matches!(spec.fault, FaultPoint::None | FaultPoint::Device(..)) {
            return Ok(Resident::Stream);
        }
        let (Some(memory), Some(device)) = (memory_input(&self.input), crate::device::gpu()) else {
            return Ok(Resident::Stream);
        };
        let schema = self.input.schema();
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let Some(inputs) = table_inputs(&memory, program, &names)? else {
            return Ok(Resident::Stream);
        };
        // DataFusion evaluates the filter, or the keys, on empty batches too.
        for batch in memory.batches().filter(|b| b.num_rows() == 0) {
            check_empty_batch(spec, &memory.project(batch)?)?;
        }
        let rows: usize = memory.batches().map(|b| b.num_rows()).sum();
        if rows == 0 {
            return Ok(Resident::Done(RecordBatch::new_empty(Arc::clone(
                &self.schema,
            ))));
        }
        let watch = DeviceWatch::new(
            spec.device_memory_limit,
            match spec.fault {
                FaultPoint::Device(op, n) => Some((op, n)),
                _ => None,
            },
            self.metrics.device_bytes_held.clone(),
            self.metrics.device_peak_bytes.clone(),
            self.metrics.pinned_bytes_held.clone(),
        );
        let selection = SelectionSpec {
            watch: Some(Arc::new(watch)),
            transfers: self.metrics.transfers.clone(),
            ..selection_spec(spec, Some(Arc::clone(program)))
        };
        // With `auto`, the sampled selection: the fused path's own final step.
        let algorithm = match selection.final_choice {
            Some(_) => crate::device::DeviceAlgorithm::Sample,
            None => algorithm,
        };
        let budget = cache.budget.unwrap_or(device.total_memory / 4);
        let selected = {
            let _timer = self.metrics.select_time.timer();
            select_table(&selection, &device, algorithm, budget, &inputs)
        };
        let selected = match selected {
            Ok(Some(selected)) => selected,
            Ok(None) => return Ok(Resident::Stream),
            Err(e) if is_device_error(&e) => {
                log::warn!("gpu-topk: the GPU selection failed, the CPU path runs it: {e}");
                report_fallback(&self.fallback, &e);
                self.metrics.gpu_fallbacks.add(1);
                return Ok(Resident::Cpu);
            }
            Err(e) => return Err(e),
        };
        if !selected.compile_time.is_zero() {
            self.metrics
                .compile_time
                .add_duration(selected.compile_time);
        }
        self.metrics.rows_in.add(rows);
        self.metrics.rows_passed_filter.add(selected.passed);
        let _timer = self.metrics.gather_time.timer();
        let positions = &selected.positions;
        if positions.len() == spec.k
            && let Some(&last) = positions.last()
        {
            self.publish_final_threshold(&memory, last)?;
        }
        let skip = spec.skip.min(positions.len());
        self.gather_positions(&memory, &positions[skip..])
            .map(Resident::Done)
    }

    /// Publishes the k-th winner's first key to the dynamic filter, as the streaming path
    /// does with its running threshold (nothing below reads the table again, but operators
    /// that share the filter see where the answer ends).
    fn publish_final_threshold(
        &self,
        memory: &crate::exec::memory::MemoryInput<'_>,
        position: u64,
    ) -> Result<()> {
        let first = self.spec.sort_exprs.first();
        let (batch, row) = locate(memory, position)?;
        let row = memory.project(batch)?.slice(row, 1);
        let key = first.expr.evaluate(&row)?.into_array(1)?;
        // Not for floats, as on the streaming path (Parquet statistics leave NaNs out).
        if key.data_type().is_floating() || !self.spec.scans_may_skip_rows() {
            return Ok(());
        }
        let value = datafusion::common::ScalarValue::try_from_array(&key, 0)?;
        if let Some(predicate) = threshold_predicate(first, &value)? {
            self.dynamic_filter.update(predicate)?;
        }
        Ok(())
    }

    /// The output rows at `positions` of the table (its non-empty batches back to back).
    fn gather_positions(
        &self,
        memory: &crate::exec::memory::MemoryInput<'_>,
        positions: &[u64],
    ) -> Result<RecordBatch> {
        if positions.is_empty() {
            return Ok(RecordBatch::new_empty(Arc::clone(&self.schema)));
        }
        let (batches, starts) = table_starts(memory);
        // Each winner's batch (numbered among the batches that hold winners) and row.
        let mut slots = std::collections::HashMap::new();
        let mut holding: Vec<&RecordBatch> = Vec::new();
        let at: Vec<(usize, usize)> = positions
            .iter()
            .map(|&p| {
                let b = starts.partition_point(|&s| s <= p) - 1;
                let slot = *slots.entry(b).or_insert_with(|| {
                    holding.push(batches[b]);
                    holding.len() - 1
                });
                (slot, (p - starts[b]) as usize)
            })
            .collect();
        // The input columns the output reads, gathered in winner order; the others as NULLs.
        let input = self.input.schema();
        let mut read = vec![false; input.fields().len()];
        for expr in &self.spec.output_exprs {
            for column in collect_columns(expr) {
                if let Some(r) = read.get_mut(column.index()) {
                    *r = true;
                }
            }
        }
        let k = positions.len();
        let columns = (memory.columns.iter().zip(&read).zip(input.fields()))
            .map(|((&c, &read), field)| {
                Ok(if read {
                    let arrays: Vec<&dyn Array> =
                        holding.iter().map(|b| b.column(c).as_ref()).collect();
                    interleave(&arrays, &at)?
                } else {
                    new_null_array(field.data_type(), k)
                })
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let fields = input
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true));
        let rows =
            RecordBatch::try_new(Arc::new(Schema::new(fields.collect::<Vec<_>>())), columns)?;
        // The winners' rows are the operator's memory, as DataFusion's TopK reserves its heap.
        self.reservation.try_grow(rows.get_array_memory_size())?;
        let columns: Vec<ArrayRef> = self
            .spec
            .output_exprs
            .iter()
            .map(|e| e.evaluate(&rows)?.into_array(k))
            .collect::<Result<_>>()?;
        let output = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        self.reservation.try_grow(output.get_array_memory_size())?;
        Ok(output)
    }
}

/// The table's non-empty batches and the position of each one's first row (a `GpuTable`
/// worked them out once).
fn table_starts<'a>(
    memory: &crate::exec::memory::MemoryInput<'a>,
) -> (Vec<&'a RecordBatch>, std::borrow::Cow<'a, [u64]>) {
    if let Some(table) = memory.table {
        return (
            table.batches.iter().collect(),
            std::borrow::Cow::Borrowed(&table.starts),
        );
    }
    let batches: Vec<&RecordBatch> = memory.batches().filter(|b| b.num_rows() > 0).collect();
    let mut starts = Vec::with_capacity(batches.len());
    let mut next = 0u64;
    for batch in &batches {
        starts.push(next);
        next += batch.num_rows() as u64;
    }
    (batches, std::borrow::Cow::Owned(starts))
}

/// The batch and row of the table's row at `position`.
fn locate<'a>(
    memory: &crate::exec::memory::MemoryInput<'a>,
    position: u64,
) -> Result<(&'a RecordBatch, usize)> {
    let (batches, starts) = table_starts(memory);
    let b = starts.partition_point(|&s| s <= position);
    match b.checked_sub(1) {
        Some(b) if position - starts[b] < batches[b].num_rows() as u64 => {
            Ok((batches[b], (position - starts[b]) as usize))
        }
        _ => Err(DataFusionError::Internal(format!(
            "winning position {position} is outside the table"
        ))),
    }
}
