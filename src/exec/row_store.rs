//! Rows retained for late materialisation.
//!
//! The selector decides which row ids win; the store keeps, for rows that may still win, the
//! operator's output columns and the evaluated sort keys: the first key is what the dynamic
//! filter publishes, and all of them let a CPU selector take over the rows a failed GPU
//! selection held ([`RowStore::for_each_keys`]).
//! Batches enter already cut down to the admitted rows; [`RowStore::retain`] drops rows the
//! selector has since evicted, so the store stays near `k` rows however large the input is.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{
    filter_record_batch, interleave_record_batch, prep_null_mask_filter, take_record_batch,
};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::PhysicalExpr;

use crate::select::{RowIds, SelectInput};

/// Row ids of a stored batch's rows, ascending.
#[derive(Debug)]
enum StoredIds {
    Range(u64),
    List(Vec<u64>),
}

/// Rows entering the store: a batch (output columns, then the sort keys) and its ids.
#[derive(Debug)]
pub(super) struct StoredBatch {
    ids: StoredIds,
    /// Output columns, then one column per sort key.
    batch: RecordBatch,
}

impl StoredBatch {
    /// Rows with the consecutive ids `first_id..`.
    pub(super) fn range(first_id: u64, batch: RecordBatch) -> Self {
        Self {
            ids: StoredIds::Range(first_id),
            batch,
        }
    }

    /// Rows with the given ascending ids.
    pub(super) fn list(ids: Vec<u64>, batch: RecordBatch) -> Self {
        debug_assert_eq!(ids.len(), batch.num_rows());
        Self {
            ids: StoredIds::List(ids),
            batch,
        }
    }

    /// The rows for which `predicate` is true (`None`: no row). Done before taking the store's
    /// lock, so partitions filter in parallel.
    pub(super) fn filter(self, predicate: &Arc<dyn PhysicalExpr>) -> Result<Option<Self>> {
        filter_entry(self, predicate)
    }

    fn id(&self, row: usize) -> u64 {
        match &self.ids {
            StoredIds::Range(start) => start + row as u64,
            StoredIds::List(ids) => ids[row],
        }
    }

    /// Position of `id` in this entry, if present.
    fn position(&self, id: u64) -> Option<usize> {
        match &self.ids {
            StoredIds::Range(start) => {
                let n = self.batch.num_rows() as u64;
                (id >= *start && id < start + n).then(|| (id - start) as usize)
            }
            StoredIds::List(ids) => ids.binary_search(&id).ok(),
        }
    }
}

/// The rows of `entry` for which `predicate` is true (`None`: no row).
fn filter_entry(
    entry: StoredBatch,
    predicate: &Arc<dyn PhysicalExpr>,
) -> Result<Option<StoredBatch>> {
    let n = entry.batch.num_rows();
    let mask = predicate.evaluate(&entry.batch)?.into_array(n)?;
    let mask = mask
        .as_boolean_opt()
        .ok_or_else(|| DataFusionError::Internal("prune predicate is not boolean".into()))?;
    let mask = match mask.null_count() {
        0 => mask.clone(),
        _ => prep_null_mask_filter(mask),
    };
    Ok(match mask.true_count() {
        0 => None,
        kept if kept == n => Some(entry),
        _ => {
            let ids = mask.values().set_indices().map(|i| entry.id(i)).collect();
            let batch = filter_record_batch(&entry.batch, &mask)?;
            Some(StoredBatch {
                ids: StoredIds::List(ids),
                batch,
            })
        }
    })
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct RowStore {
    entries: Vec<StoredBatch>,
    rows: usize,
    bytes: usize,
    /// Rows at the last [`retain`](Self::retain), to pace the next one.
    rows_after_retain: usize,
}

impl RowStore {
    /// Memory held by the retained arrays.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds rows.
    pub(super) fn insert(&mut self, rows: StoredBatch) {
        if rows.batch.num_rows() == 0 {
            return;
        }
        self.rows += rows.batch.num_rows();
        self.bytes += rows.batch.get_array_memory_size();
        self.entries.push(rows);
    }

    /// Whether enough rows arrived since the last [`retain`](Self::retain) to make another one
    /// worthwhile (amortised O(1) per row).
    pub(super) fn wants_retain(&self, k: usize) -> bool {
        self.rows > (2 * self.rows_after_retain).max(2 * k).max(8192)
    }

    /// Keeps only the rows whose ids are in `live` (ascending), compacting what remains.
    pub(super) fn retain(&mut self, live: &[u64]) -> Result<()> {
        let mut kept = Vec::with_capacity(self.entries.len());
        let (mut rows, mut bytes) = (0, 0);
        for entry in self.entries.drain(..) {
            let n = entry.batch.num_rows();
            let (first, last) = (entry.id(0), entry.id(n - 1));
            let lo = live.partition_point(|&id| id < first);
            let hi = live.partition_point(|&id| id <= last);
            if lo == hi {
                continue;
            }
            let (indices, ids): (Vec<u32>, Vec<u64>) = live[lo..hi]
                .iter()
                .filter_map(|&id| entry.position(id).map(|p| (p as u32, id)))
                .unzip();
            let entry = if indices.len() == n {
                entry
            } else if indices.is_empty() {
                continue;
            } else {
                let batch = take_record_batch(&entry.batch, &UInt32Array::from(indices))?;
                StoredBatch {
                    ids: StoredIds::List(ids),
                    batch,
                }
            };
            rows += entry.batch.num_rows();
            bytes += entry.batch.get_array_memory_size();
            kept.push(entry);
        }
        self.entries = kept;
        self.rows = rows;
        self.bytes = bytes;
        self.rows_after_retain = rows;
        Ok(())
    }

    /// Keeps only the rows for which `predicate` (over the stored batches' schema) is true:
    /// used with the threshold predicate when the selector cannot name its live rows.
    pub(super) fn retain_where(&mut self, predicate: &Arc<dyn PhysicalExpr>) -> Result<()> {
        let entries = std::mem::take(&mut self.entries);
        (self.rows, self.bytes) = (0, 0);
        for entry in entries {
            if let Some(entry) = filter_entry(entry, predicate)? {
                self.rows += entry.batch.num_rows();
                self.bytes += entry.batch.get_array_memory_size();
                self.entries.push(entry);
            }
        }
        self.rows_after_retain = self.rows;
        Ok(())
    }

    /// The value of column `column` (the first sort key) of row `id`.
    pub(super) fn key_value(&self, id: u64, column: usize) -> Result<Option<ScalarValue>> {
        for entry in &self.entries {
            if let Some(row) = entry.position(id) {
                let key = entry.batch.columns().get(column).ok_or_else(|| {
                    DataFusionError::Internal("row store batch has no key column".into())
                })?;
                return ScalarValue::try_from_array(key, row).map(Some);
            }
        }
        Ok(None)
    }

    /// Calls `f` with every entry's sort keys (the columns from `first_key` on) and row ids.
    pub(super) fn for_each_keys(
        &self,
        first_key: usize,
        mut f: impl FnMut(SelectInput<'_>) -> Result<()>,
    ) -> Result<()> {
        for entry in &self.entries {
            let keys = &entry.batch.columns()[first_key..];
            let row_ids = match &entry.ids {
                StoredIds::Range(start) => RowIds::Range(*start),
                StoredIds::List(ids) => RowIds::Explicit(ids),
            };
            f(SelectInput { keys, row_ids })?;
        }
        Ok(())
    }

    /// The rows `ids` in that order, as one batch of `schema` (the output columns).
    pub(super) fn gather(&self, ids: &[u64], schema: &SchemaRef) -> Result<RecordBatch> {
        if ids.is_empty() {
            return Ok(RecordBatch::new_empty(schema.clone()));
        }
        // Entries hold disjoint id ranges: find each id's entry by binary search on first ids.
        let mut by_first: Vec<(u64, usize)> = self
            .entries
            .iter()
            .enumerate()
            .map(|(e, entry)| (entry.id(0), e))
            .collect();
        by_first.sort_unstable();
        let at: Vec<(usize, usize)> = ids
            .iter()
            .map(|&id| {
                let i = by_first.partition_point(|&(first, _)| first <= id);
                i.checked_sub(1)
                    .and_then(|i| {
                        let e = by_first[i].1;
                        self.entries[e].position(id).map(|row| (e, row))
                    })
                    .ok_or_else(|| {
                        DataFusionError::Internal(format!("winning row {id} was not retained"))
                    })
            })
            .collect::<Result<_>>()?;
        let width: Vec<usize> = (0..schema.fields().len()).collect();
        let batches: Vec<RecordBatch> = self
            .entries
            .iter()
            .map(|e| e.batch.project(&width))
            .collect::<std::result::Result<_, _>>()?;
        let refs: Vec<&RecordBatch> = batches.iter().collect();
        let gathered = interleave_record_batch(&refs, &at)?;
        Ok(RecordBatch::try_new(
            schema.clone(),
            gathered.columns().to_vec(),
        )?)
    }
}
