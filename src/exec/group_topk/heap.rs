//! The CPU path of [`GpuGroupTopKExec`](super::GpuGroupTopKExec): an output partition reads
//! its input batch by batch into a bounded max-heap per group, holding only the rows that may
//! still be among their group's K best and the batches they point into, then emits them in
//! the sort's order with their numbers (see the parent module's documentation).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array};
use datafusion::arrow::compute::interleave;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::row::{Row, RowConverter, Rows, SortField};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::metrics::{BaselineMetrics, Count};
use futures::StreamExt;

use super::{RankFunction, batch_of};

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
        self.groups_metric.add(held.heaps.len());
        if held.batches.len() > u32::MAX as usize {
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

    /// Offers a batch whose first row is at `position` in the input: each row is held where
    /// it may be among its group's best, and the batch (with its memory reserved) where any
    /// of its rows is.
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
        let group_rows = converters
            .group
            .convert_columns(&columns[..self.group_keys])?;
        let dense = self.function == RankFunction::DenseRank;
        let index = held.batches.len();
        held.batches.push(Some((batch, keys)));
        held.live.push(0);
        for row in 0..n {
            let group = held.group_of(group_rows.row(row).as_ref(), dense);
            let new = HeldRow {
                batch: index as u32,
                row: row as u32,
                position: position + row as u64,
                group: group as u32,
            };
            let Some(released) = held.hold(new, self.function, self.k) else {
                continue;
            };
            held.live[index] += 1;
            held.release(released, index, &self.reservation);
        }
        if held.live[index] == 0 {
            held.batches[index] = None;
        } else if let Some((batch, rows)) = &held.batches[index] {
            self.reservation
                .try_grow(batch.get_array_memory_size() + rows.size())?;
        }
        Ok(())
    }

    /// The output batches of the held rows `kept`, in output order, with their `numbers`.
    fn output(
        &self,
        held: &HeldRows,
        kept: &[HeldRow],
        numbers: &[u64],
    ) -> Result<Vec<RecordBatch>> {
        let batches: Vec<(usize, &RecordBatch)> = (held.batches.iter().enumerate())
            .filter_map(|(i, b)| b.as_ref().map(|(b, _)| (i, b)))
            .collect();
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

/// A held row: where it lies among the held batches (its sort key is row `row` of its
/// batch's key rows), its position in the input (ties) and its group.
#[derive(Debug, Clone, Copy)]
struct HeldRow {
    batch: u32,
    row: u32,
    position: u64,
    group: u32,
}

/// The held batches, each with its sort keys in arrow's row format (`None` once no held row
/// points into it).
type HeldBatches = Vec<Option<(RecordBatch, Rows)>>;

/// `row`'s sort key among `batches`.
fn key_of<'a>(batches: &'a HeldBatches, row: &HeldRow) -> Row<'a> {
    let (_, rows) = batches[row.batch as usize].as_ref().expect("held");
    rows.row(row.row as usize)
}

/// What the heaps hold while the input streams: every group's rows, and the batches they
/// point into.
#[derive(Default)]
struct HeldRows {
    groups: GroupIds,
    /// Per group, its rows (RANK()'s ties aside): a max-heap by (key, position) once it holds
    /// K of them.
    heaps: Vec<Vec<HeldRow>>,
    /// Under RANK(), per group the rows beyond its K held ones whose key ties the K-th's.
    ties: Vec<Vec<HeldRow>>,
    /// Under DENSE_RANK(), per group its K smallest keys (encoded), each with its rows.
    distinct: Vec<BTreeMap<Box<[u8]>, Vec<HeldRow>>>,
    batches: HeldBatches,
    /// How many held rows each batch still holds.
    live: Vec<usize>,
}

impl HeldRows {
    /// The group of `key` (its encoded group keys), numbered where it is new.
    fn group_of(&mut self, key: &[u8], dense: bool) -> usize {
        let group = self.groups.id(key);
        if group == self.heaps.len() {
            // Vec::new and BTreeMap::new allocate nothing until a row arrives.
            self.heaps.push(Vec::new());
            self.ties.push(Vec::new());
            if dense {
                self.distinct.push(BTreeMap::new());
            }
        }
        group
    }

    /// Holds `new` where it may be among its group's best under `function`, K = `k`: `None`
    /// where it cannot (nothing changed), else the rows it displaced, held no longer.
    #[inline]
    fn hold(&mut self, new: HeldRow, function: RankFunction, k: usize) -> Option<Vec<HeldRow>> {
        let Self {
            heaps,
            ties,
            distinct,
            batches,
            ..
        } = self;
        let gid = new.group as usize;
        let key = |r: &HeldRow| key_of(batches, r);
        let less = |a: &HeldRow, b: &HeldRow| (key(a), a.position) < (key(b), b.position);
        let mut released = Vec::new();
        if function == RankFunction::DenseRank {
            let keys = &mut distinct[gid];
            let row_key = key(&new);
            if keys.len() == k
                && keys
                    .last_key_value()
                    .is_some_and(|(last, _)| row_key.as_ref() > last.as_ref())
            {
                return None;
            }
            keys.entry(row_key.as_ref().into()).or_default().push(new);
            if keys.len() > k
                && let Some((_, gone)) = keys.pop_last()
            {
                released = gone;
            }
            return Some(released);
        }
        let heap = &mut heaps[gid];
        if heap.len() < k {
            // Heap order only matters once the group holds K rows (most groups of a query
            // with many small groups never do).
            heap.push(new);
            if heap.len() == k {
                for i in (0..heap.len() / 2).rev() {
                    sift_down(heap, i, less);
                }
            }
            return Some(released);
        }
        let ranked = function == RankFunction::Rank;
        match key(&new).cmp(&key(&heap[0])) {
            std::cmp::Ordering::Equal if ranked => ties[gid].push(new),
            std::cmp::Ordering::Greater => return None,
            _ if !less(&new, &heap[0]) => return None,
            _ => {
                // The group's worst held row goes (under RANK() it stays a tie while the new
                // K-th row has its key).
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
        Some(released)
    }

    /// Lets go of the rows `gone`: a batch no held row points into any more is dropped, its
    /// memory given back to `reservation`, unless it is the batch being offered (`offered`),
    /// which is reserved only once all its rows are seen.
    fn release(&mut self, gone: Vec<HeldRow>, offered: usize, reservation: &MemoryReservation) {
        for row in gone {
            let at = row.batch as usize;
            self.live[at] -= 1;
            if self.live[at] == 0
                && at != offered
                && let Some((batch, rows)) = self.batches[at].take()
            {
                reservation.shrink(batch.get_array_memory_size() + rows.size());
            }
        }
    }

    /// The held rows in the sort's order (group keys first, so each group's rows are
    /// consecutive): the groups in the order of their keys (the sort's leading keys, encoded
    /// alike), each group's rows sorted on their own, small sorts over few rows each. The
    /// groups' keys are dropped.
    fn in_sort_order(&mut self, dense: bool) -> Vec<HeldRow> {
        let groups = std::mem::take(&mut self.groups);
        let mut order: Vec<u32> = (0..self.heaps.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| groups.key(a as usize).cmp(groups.key(b as usize)));
        drop(groups);
        let Self {
            heaps,
            ties,
            distinct,
            batches,
            ..
        } = self;
        let key = |r: &HeldRow| key_of(batches, r);
        let mut kept: Vec<HeldRow> = Vec::with_capacity(heaps.iter().map(Vec::len).sum());
        for gid in order {
            let gid = gid as usize;
            let start = kept.len();
            kept.append(&mut heaps[gid]);
            kept.append(&mut ties[gid]);
            if dense {
                kept.extend(std::mem::take(&mut distinct[gid]).into_values().flatten());
            }
            kept[start..].sort_unstable_by(|a, b| (key(a), a.position).cmp(&(key(b), b.position)));
        }
        kept
    }

    /// The numbers under `function` of the rows `kept`, in the sort's order: 1, 2, … within
    /// their group; under RANK() and DENSE_RANK() a row whose key ties the previous row's
    /// takes its number.
    fn numbers(&self, kept: &[HeldRow], function: RankFunction) -> Vec<u64> {
        let key = |r: &HeldRow| key_of(&self.batches, r);
        let mut numbers: Vec<u64> = Vec::with_capacity(kept.len());
        let mut group_start = 0;
        for (i, k) in kept.iter().enumerate() {
            let next = match numbers.last() {
                Some(&n) if kept[i - 1].group == k.group => match function {
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
        numbers
    }
}

/// Numbers the groups by their encoded keys (arrow's row format) in order of arrival: the keys
/// in one buffer, and a map from each key's hash to its latest group, groups of equal hashes
/// chained. Millions of groups cost a few buffers, not an allocation each. (DataFusion's hash
/// map hashes the keys and again their hashes: a hash is cheap next to a key's comparison.)
#[derive(Default)]
pub(super) struct GroupIds {
    bytes: Vec<u8>,
    /// Where each group's key ends in `bytes`.
    ends: Vec<usize>,
    latest: datafusion::common::HashMap<u64, u32>,
    /// Per group, the previous group of the same hash (`u32::MAX`: none).
    previous: Vec<u32>,
}

impl GroupIds {
    /// The group of `key`, numbered next where it is new.
    pub(super) fn id(&mut self, key: &[u8]) -> usize {
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
    pub(super) fn key(&self, id: usize) -> &[u8] {
        let start = match id {
            0 => 0,
            _ => self.ends[id - 1],
        };
        &self.bytes[start..self.ends[id]]
    }
}

/// Restores the max-heap order (by `less`) of `heap` from its element `i` down.
fn sift_down(heap: &mut [HeldRow], mut i: usize, less: impl Fn(&HeldRow, &HeldRow) -> bool) {
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
