//! The CPU path of [`GpuGroupTopKExec`](super::GpuGroupTopKExec): an output partition reads
//! its input batch by batch into a bounded max-heap per group (`crate::select::groups`),
//! holding only the rows that may still be among their group's K best and the batches they
//! point into, then emits them in the sort's order with their numbers (see the parent
//! module's documentation).

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array};
use datafusion::arrow::compute::interleave;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::metrics::{BaselineMetrics, Count};
use futures::StreamExt;

use super::{RankFunction, batch_of};
use crate::select::groups::{HeldRow, HeldRows};

/// One output partition's CPU path: the K best rows of every group among the input
/// partitions it reads, held by a bounded heap per group ([`HeldRows`]).
pub(super) struct GroupHeaps {
    pub(super) function: RankFunction,
    pub(super) ordering: LexOrdering,
    pub(super) group_keys: usize,
    pub(super) k: usize,
    /// Each output column's place among the input's columns then the number.
    pub(super) columns: Vec<usize>,
    pub(super) schema: SchemaRef,
    pub(super) input_schema: SchemaRef,
    pub(super) batch_size: usize,
    pub(super) reservation: MemoryReservation,
    pub(super) baseline: BaselineMetrics,
    pub(super) groups_metric: Count,
}

/// Converters of the sort keys, and of the group keys alone, to arrow's row format.
struct KeyConverters {
    sort: RowConverter,
    group: RowConverter,
}

impl GroupHeaps {
    /// Reads `streams` in turn and returns the output batches.
    pub(super) async fn run(
        self,
        streams: Vec<SendableRecordBatchStream>,
    ) -> Result<Vec<RecordBatch>> {
        let converters = self.converters()?;
        let mut held = HeldRows::default();
        let mut position = 0u64;
        for mut stream in streams {
            while let Some(batch) = stream.next().await {
                let batch = batch?;
                let _timer = self.baseline.elapsed_compute().timer();
                let n = batch.num_rows();
                if n > 0 && self.k > 0 {
                    self.offer(&mut held, &converters, batch, position)?;
                }
                position += n as u64;
            }
        }
        let _timer = self.baseline.elapsed_compute().timer();
        self.groups_metric.add(held.groups());
        if held.offered_batches() > u32::MAX as usize {
            return datafusion::common::internal_err!("GpuGroupTopKExec: more than 2^32 batches");
        }
        let kept = held.in_sort_order(self.function == RankFunction::DenseRank);
        let numbers = held.numbers(&kept, self.function);
        let output = self.output(&held, &kept, &numbers)?;
        self.baseline.done();
        Ok(output)
    }

    fn converters(&self) -> Result<KeyConverters> {
        let fields = |exprs: &[PhysicalSortExpr]| -> Result<Vec<SortField>> {
            let input = &self.input_schema;
            exprs
                .iter()
                .map(|s| {
                    Ok(SortField::new_with_options(
                        s.expr.data_type(input)?,
                        s.options,
                    ))
                })
                .collect()
        };
        Ok(KeyConverters {
            sort: RowConverter::new(fields(&self.ordering)?)?,
            group: RowConverter::new(fields(&self.ordering[..self.group_keys])?)?,
        })
    }

    /// Offers a batch whose first row is at `position` in the input to the held rows.
    fn offer(
        &self,
        held: &mut HeldRows,
        converters: &KeyConverters,
        batch: RecordBatch,
        position: u64,
    ) -> Result<()> {
        let n = batch.num_rows();
        let columns = (self.ordering.iter())
            .map(|s| s.expr.evaluate(&batch)?.into_array(n))
            .collect::<Result<Vec<ArrayRef>>>()?;
        let keys = converters.sort.convert_columns(&columns)?;
        let groups = converters
            .group
            .convert_columns(&columns[..self.group_keys])?;
        let (function, k) = (self.function, self.k);
        held.offer(
            batch,
            (keys, &groups),
            position,
            function,
            k,
            &self.reservation,
        )
    }

    /// The output batches of the held rows `kept`, in output order, with their `numbers`.
    fn output(
        &self,
        held: &HeldRows,
        kept: &[HeldRow],
        numbers: &[u64],
    ) -> Result<Vec<RecordBatch>> {
        let batches: Vec<(usize, &RecordBatch)> = held.held_batches().collect();
        let slot: HashMap<usize, usize> = (batches.iter().enumerate())
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
                        batches.iter().map(|(_, b)| b.column(c).as_ref()).collect();
                    Ok(interleave(&sources, chunk)?)
                })
                .collect::<Result<Vec<ArrayRef>>>()?;
            let batch = batch_of(Arc::clone(&self.schema), arrays, chunk.len())
                .map_err(|e| DataFusionError::ArrowError(Box::new(e), None))?;
            self.baseline.record_output(batch.num_rows());
            output.push(batch);
        }
        Ok(output)
    }
}
