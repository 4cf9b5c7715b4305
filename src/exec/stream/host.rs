//! The host path: DataFusion evaluates the predicate and the sort keys of each batch, and the
//! keys go to the selector (the CPU's, or the GPU's without a generated program, which takes
//! them in larger pushes); the output columns of the rows it admits are kept.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array};
use datafusion::arrow::compute::kernels::take::take;
use datafusion::arrow::compute::{concat, filter_record_batch};
use datafusion::error::Result;

use super::{ActiveSelector, RunState, predicate_mask};
use crate::exec::row_store::StoredBatch;
use crate::select::{Admitted, RowIds, SelectInput};

/// Key columns of one partition waiting to be pushed as one larger batch (for selectors that
/// admit every row and prefer large pushes, i.e. the GPU). Their rows are already stored.
#[derive(Default)]
pub(super) struct PendingKeys {
    keys: Vec<Vec<ArrayRef>>,
    /// Row ids of the pending rows, in order.
    ids: Vec<u64>,
    /// Whether `ids` is one consecutive range (then it is not uploaded).
    consecutive: bool,
}

impl PendingKeys {
    fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Host memory of the held key columns and ids.
    pub(super) fn bytes(&self) -> usize {
        let keys = self.keys.iter().flatten();
        keys.map(|a| a.get_array_memory_size()).sum::<usize>() + 8 * self.ids.capacity()
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

/// One batch's rows that passed the predicate, with their sort keys and ids.
struct Evaluated {
    filtered: RecordBatch,
    keys: Vec<ArrayRef>,
    first_id: u64,
    /// One id per row where the predicate dropped rows (else they run from `first_id`).
    explicit_ids: Option<Vec<u64>>,
}

impl Evaluated {
    fn row_ids(&self) -> RowIds<'_> {
        match &self.explicit_ids {
            Some(ids) => RowIds::Explicit(ids),
            None => RowIds::Range(self.first_id),
        }
    }
}

impl RunState {
    /// One input batch through the host path: predicate, keys, selection, retention. Where
    /// the selection moves to the CPU on the way (this batch's device error, or another
    /// partition's), the selector that got the batch is gone and nothing of it was stored: it
    /// goes through the new one (the CPU's, which never moves).
    pub(super) fn process_batch(
        &self,
        first_id: u64,
        batch: &RecordBatch,
        pending: &mut PendingKeys,
    ) -> Result<()> {
        let Some(evaluated) = self.evaluate(first_id, batch)? else {
            return Ok(());
        };
        while !self.select_and_retain(&self.active(), &evaluated, pending)? {}
        Ok(())
    }

    /// The fused predicate, then the ranking keys on the surviving rows only (as DataFusion
    /// evaluates them); `None` where no row passed.
    fn evaluate(&self, first_id: u64, batch: &RecordBatch) -> Result<Option<Evaluated>> {
        let metrics = &self.metrics;
        let mut explicit_ids = None;
        let filtered = match &self.spec.filter {
            None => batch.clone(),
            Some(predicate) => {
                let _timer = metrics.filter_time.timer();
                let mask = predicate_mask(predicate, batch)?;
                let passed = mask.true_count();
                if passed == 0 {
                    return Ok(None);
                }
                if passed == batch.num_rows() {
                    batch.clone()
                } else {
                    let ids = mask.values().set_indices().map(|i| first_id + i as u64);
                    explicit_ids = Some(ids.collect());
                    filter_record_batch(batch, &mask)?
                }
            }
        };
        let m = filtered.num_rows();
        let keys = {
            let _timer = metrics.key_eval_time.timer();
            (self.spec.sort_exprs.iter())
                .map(|s| s.expr.evaluate(&filtered)?.into_array(m))
                .collect::<Result<_>>()?
        };
        Ok(Some(Evaluated {
            filtered,
            keys,
            first_id,
            explicit_ids,
        }))
    }

    /// Selection and retention of an evaluated batch with the selector of `mode`; `false`
    /// where the selection moved to the CPU before the batch was stored.
    fn select_and_retain(
        &self,
        mode: &Arc<ActiveSelector>,
        evaluated: &Evaluated,
        pending: &mut PendingKeys,
    ) -> Result<bool> {
        let metrics = &self.metrics;
        let m = evaluated.filtered.num_rows();
        let row_ids = evaluated.row_ids();

        // Selection: a selector that prefers large pushes admits every row, and gets the keys
        // once the rows are stored (below).
        let batched = mode.selector.preferred_push_rows() > 0;
        let admitted = if batched {
            Admitted::All
        } else {
            let _timer = metrics.select_time.timer();
            let input = SelectInput {
                keys: &evaluated.keys,
                row_ids,
            };
            match mode.selector.push(input) {
                Ok(admitted) => admitted,
                // Nothing of this batch is stored yet: the CPU path takes it whole.
                Err(e) if self.falls_back(mode, &e)? => return Ok(false),
                Err(e) => return Err(e),
            }
        };

        // Late materialisation: keep the output columns (and keys) of admitted rows only.
        let retain_timer = metrics.retain_time.timer();
        let filtered = &evaluated.filtered;
        let mut columns: Vec<ArrayRef> = (self.spec.output_exprs.iter())
            .map(|e| e.evaluate(filtered)?.into_array(m))
            .collect::<Result<_>>()?;
        columns.extend(evaluated.keys.iter().cloned());
        let (columns, ids) = match &admitted {
            Admitted::All => (columns, None),
            Admitted::Indices(indices) if indices.is_empty() => {
                metrics.rows_passed_filter.add(m);
                return Ok(true);
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
        let mut rows = Some(match (ids, evaluated.explicit_ids.clone()) {
            (Some(ids), _) | (None, Some(ids)) => StoredBatch::list(ids, retained),
            (None, None) => StoredBatch::range(evaluated.first_id, retained),
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
                return Ok(false);
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

        // The batched push, after the rows are stored: should it fail, the CPU selector
        // takes them over from the store.
        if batched {
            pending.add(evaluated.keys.clone(), row_ids, m);
            if pending.rows() >= mode.selector.preferred_push_rows() {
                self.flush(pending)?;
            }
        }
        Ok(true)
    }

    /// Pushes the pending rows of a partition as one batch (their rows are stored already).
    pub(super) fn flush(&self, pending: &mut PendingKeys) -> Result<()> {
        if pending.rows() == 0 {
            return Ok(());
        }
        let pending = std::mem::take(pending);
        let mode = self.active();
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
            Err(e) if self.falls_back(&mode, &e)? => return Ok(()),
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
}
