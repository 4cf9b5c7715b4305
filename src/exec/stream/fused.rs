//! The fused path: a partition's raw input batches go, in larger pushes, to the query's
//! generated program on the device ([`crate::fusion`]), which evaluates predicate and keys and
//! reports the rows it appended; the host evaluates only a predicate that does not translate,
//! and keeps the output columns of the appended rows. After a device error the batches go
//! through the host path instead.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array};
use datafusion::arrow::compute::take_record_batch;
use datafusion::error::Result;

use super::host::PendingKeys;
use super::{ActiveSelector, RunState, predicate_mask};
use crate::exec::row_store::StoredBatch;
use crate::fusion::{self, FusedProgram, KernelInput};
use crate::select::ColumnsInput;

/// Input batches of one partition waiting to be pushed, as one larger batch, to a selector that
/// runs the generated program. Their rows have consecutive ids from `first_id`.
#[derive(Default)]
pub(super) struct FusedPending {
    batches: Vec<RecordBatch>,
    /// Each batch's host-evaluated predicate, when the program takes one.
    predicates: Vec<ArrayRef>,
    first_id: u64,
    rows: usize,
}

impl FusedPending {
    /// Host memory of the held batches and predicates.
    pub(super) fn bytes(&self) -> usize {
        let predicates = self.predicates.iter().map(|a| a.get_array_memory_size());
        let batches = self.batches.iter().map(RecordBatch::get_array_memory_size);
        predicates.sum::<usize>() + batches.sum::<usize>()
    }

    /// The batches with the row id of each one's first row.
    fn with_ids(&self) -> impl Iterator<Item = (u64, &RecordBatch)> {
        self.batches.iter().scan(self.first_id, |next, batch| {
            let first = *next;
            *next += batch.num_rows() as u64;
            Some((first, batch))
        })
    }
}

impl RunState {
    /// The fused path's per-batch work: the predicate on the host only when the program does
    /// not evaluate it; everything else happens in [`flush_fused`](Self::flush_fused).
    pub(super) fn process_batch_fused(
        &self,
        mode: &Arc<ActiveSelector>,
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
    pub(super) fn flush_fused(&self, pending: &mut FusedPending) -> Result<()> {
        if pending.rows == 0 {
            return Ok(());
        }
        let pending = std::mem::take(pending);
        let mode = self.active();
        match &mode.program {
            Some(program) => match self.push_fused(&mode, program, &pending) {
                Ok(true) => Ok(()),
                // The selection moved to the CPU meanwhile: these rows are not stored.
                Ok(false) => self.process_on_cpu(&pending),
                Err(e) if self.falls_back(&mode, &e)? => self.process_on_cpu(&pending),
                Err(e) => Err(e),
            },
            None => self.process_on_cpu(&pending),
        }
    }

    /// The batches of a push, through the CPU path (its selector is the current one).
    fn process_on_cpu(&self, pending: &FusedPending) -> Result<()> {
        for (first_id, batch) in pending.with_ids() {
            self.process_batch(first_id, batch, &mut PendingKeys::default())?;
        }
        Ok(())
    }

    /// One push to the generated program. `Ok(false)`: the rows were not stored, because the
    /// selection moved to the CPU while the push ran.
    fn push_fused(
        &self,
        mode: &Arc<ActiveSelector>,
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
                        KernelInput::StringPrefix(_)
                        | KernelInput::StringColumn(_)
                        | KernelInput::StringCodes(_) => {
                            return datafusion::common::internal_err!(
                                "a streamed selection was given a program over a whole table's \
                                 string image"
                            );
                        }
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
}
