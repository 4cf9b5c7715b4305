//! The per-group CPU selection: a bounded max-heap per group of the rows that may still be
//! among its group's K best, keyed by their sort keys in arrow's row format and their input
//! positions, with the batches they point into. `GpuGroupTopKExec`'s CPU path streams its
//! input through it, and the CPU calibration times it.

use std::collections::BTreeMap;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::row::{Row, Rows};
use datafusion::error::Result;
use datafusion::execution::memory_pool::MemoryReservation;

/// The window function whose value the operator gives each row it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankFunction {
    /// `ROW_NUMBER()`: 1, 2, … in sort order, ties in input order.
    RowNumber,
    /// `RANK()`: one past the rows whose key is smaller; tied keys share it, and a group may
    /// keep more than K rows.
    Rank,
    /// `DENSE_RANK()`: one past the distinct keys smaller than the row's; a group keeps every
    /// row of its K smallest keys.
    DenseRank,
}

impl RankFunction {
    pub(crate) fn name(self) -> &'static str {
        match self {
            RankFunction::RowNumber => "row_number",
            RankFunction::Rank => "rank",
            RankFunction::DenseRank => "dense_rank",
        }
    }
}

/// A held row: where it lies among the held batches (its sort key is row `row` of its
/// batch's key rows), its position in the input (ties) and its group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeldRow {
    pub(crate) batch: u32,
    pub(crate) row: u32,
    position: u64,
    pub(crate) group: u32,
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
pub(crate) struct HeldRows {
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
    /// Offers a batch whose first row is at `position` in the input, with its sort keys
    /// (`keys`) and its group keys (`groups`) in arrow's row format: each row is held where it
    /// may be among its group's K = `k` best under `function`, and the batch (with its memory
    /// reserved) where any of its rows is.
    pub(crate) fn offer(
        &mut self,
        batch: RecordBatch,
        (keys, groups): (Rows, &Rows),
        position: u64,
        function: RankFunction,
        k: usize,
        reservation: &MemoryReservation,
    ) -> Result<()> {
        let n = batch.num_rows();
        let dense = function == RankFunction::DenseRank;
        let index = self.batches.len();
        self.batches.push(Some((batch, keys)));
        self.live.push(0);
        for row in 0..n {
            let group = self.group_of(groups.row(row).as_ref(), dense);
            let new = HeldRow {
                batch: index as u32,
                row: row as u32,
                position: position + row as u64,
                group: group as u32,
            };
            let Some(released) = self.hold(new, function, k) else {
                continue;
            };
            self.live[index] += 1;
            self.release(released, index, reservation);
        }
        if self.live[index] == 0 {
            self.batches[index] = None;
        } else if let Some((batch, rows)) = &self.batches[index] {
            reservation.try_grow(batch.get_array_memory_size() + rows.size())?;
        }
        Ok(())
    }

    /// How many groups it holds rows of.
    pub(crate) fn groups(&self) -> usize {
        self.heaps.len()
    }

    /// How many batches it has been offered.
    pub(crate) fn offered_batches(&self) -> usize {
        self.batches.len()
    }

    /// The batches any held row points into, with their places among the offered ones.
    pub(crate) fn held_batches(&self) -> impl Iterator<Item = (usize, &RecordBatch)> {
        (self.batches.iter().enumerate()).filter_map(|(i, b)| b.as_ref().map(|(b, _)| (i, b)))
    }

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
    pub(crate) fn in_sort_order(&mut self, dense: bool) -> Vec<HeldRow> {
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
    pub(crate) fn numbers(&self, kept: &[HeldRow], function: RankFunction) -> Vec<u64> {
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
pub(crate) struct GroupIds {
    bytes: Vec<u8>,
    /// Where each group's key ends in `bytes`.
    ends: Vec<usize>,
    latest: datafusion::common::HashMap<u64, u32>,
    /// Per group, the previous group of the same hash (`u32::MAX`: none).
    previous: Vec<u32>,
}

impl GroupIds {
    /// The group of `key`, numbered next where it is new.
    pub(crate) fn id(&mut self, key: &[u8]) -> usize {
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
    pub(crate) fn key(&self, id: usize) -> &[u8] {
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
