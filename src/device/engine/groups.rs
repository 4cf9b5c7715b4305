//! Top-k per group on the device (groups.cu): the generated program's pass appends every
//! passing row's (composite key, row id), the pairs are sorted, and each group's first pair
//! keeps its group's best rows, with their ranks, in the pairs' order. Over few large groups
//! the pairs that cannot be kept are dropped before the sort ([`GroupAlgorithm::Threshold`]),
//! and at K = 1 all but each group's best ([`GroupAlgorithm::Min`]). The kept row ids and
//! ranks come back to the host, or, given [`KeptRows`], the device gathers the kept rows'
//! resident columns and those come back instead, in pieces handed to the caller in order.

use super::*;
use crate::device::u256::U256;

/// Threads of a block of groups.cu's keyed kernels (`GROUP_THREADS`).
const GROUP_THREADS: usize = 256;
/// Threads of its one-block scan (`GROUP_SCAN_THREADS`).
const GROUP_SCAN_THREADS: u32 = 1024;

/// The ranking function of a per-group selection, numbered as groups.cu takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRanking {
    /// The first k rows of a group.
    RowNumber = 0,
    /// The rows of rank at most k (peers share a rank; ranks skip after peers).
    Rank = 1,
    /// The rows of the k smallest distinct keys.
    DenseRank = 2,
}

/// How a per-group selection finds each group's best pairs; the cost model picks one by the
/// estimated number of groups and k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupAlgorithm {
    /// Sorts every passing pair. Wins over many small groups (a user's tweets), where few
    /// pairs could be dropped before the sort.
    SegmentedSort,
    /// Samples [`GROUP_SAMPLE`] pairs, limits each well-sampled group to its k-th sampled key
    /// and sorts only the pairs at or below their group's limit: about k · m / sample a group.
    /// Wins over few large groups (tweets per language), where that is a small share of m.
    Threshold,
    /// K = 1: each group's smallest composite (its best row) found in a hash table of the
    /// groups, word by word with atomic minima, and only the pairs that equal it sorted:
    /// about one a group, whatever their number and size.
    Min,
}

impl GroupAlgorithm {
    /// The name EXPLAIN shows.
    pub fn name(self) -> &'static str {
        match self {
            Self::SegmentedSort => "segmented-sort",
            Self::Threshold => "group-threshold",
            Self::Min => "group-min",
        }
    }
}

/// A per-group selection: the composite's lowest bit of the group keys, the ranking and the
/// algorithm.
#[derive(Debug, Clone, Copy)]
pub struct GroupSpec {
    pub lo: u32,
    pub ranking: GroupRanking,
    pub algorithm: GroupAlgorithm,
}

/// Pairs the threshold algorithm samples.
pub const GROUP_SAMPLE: usize = 1 << 16;

/// Bytes of one piece of a [`KeptRows`] read-back (two pinned buffers of about this size
/// alternate: the host consumes one piece while the next crosses PCIe).
const KEPT_PIECE_BYTES: usize = 64 << 20;

/// A device-resident table column whose values the kept rows take on the device
/// (`group_gather`): `width` bytes a row (1, 2, 4, 8 or 16) at `values`, and the table's
/// validity bitmap at `validity` (0: no NULLs).
#[derive(Debug, Clone, Copy)]
pub struct GatherColumn {
    pub values: u64,
    pub width: usize,
    pub validity: u64,
}

/// A piece of the kept rows, read back: the next `rows` rows in kept order, each gathered
/// column's values and (for a column with a validity bitmap) its validity bits
/// from the piece's first row, and the rows' ranks (little-endian u64; `None` at k = 1, where
/// every rank is 1). The bytes are valid for the call only; [`buffer`](Self::buffer) makes
/// Arrow buffers of them that outlive it.
pub struct KeptPiece<'a> {
    pub rows: usize,
    pub columns: Vec<(&'a [u8], Option<&'a [u8]>)>,
    pub ranks: Option<&'a [u8]>,
    /// The pinned memory holding the bytes, where the sink may keep it.
    lent: Option<&'a Arc<LentPiece>>,
}

impl KeptPiece<'_> {
    /// `bytes` (a part of this piece) as an Arrow buffer: the pinned memory itself where the
    /// piece is lent (it goes back to the pool when the last such buffer is dropped), else a
    /// copy.
    pub fn buffer(&self, bytes: &[u8]) -> datafusion::arrow::buffer::Buffer {
        use datafusion::arrow::buffer::Buffer;
        match self.lent {
            Some(lent) if lent.holds(bytes) => {
                let ptr = std::ptr::NonNull::from(bytes).cast::<u8>();
                let owner: Arc<dyn datafusion::arrow::alloc::Allocation> = Arc::clone(lent) as _;
                // SAFETY: `bytes` lie in the lease `owner` holds; the read-back into it has
                // completed, and nothing writes to it until the last owner drops it.
                unsafe { Buffer::from_custom_allocation(ptr, bytes.len(), owner) }
            }
            _ => Buffer::from_slice_ref(bytes),
        }
    }
}

/// A pinned read-back buffer that a piece's Arrow buffers keep (returned to the pool on drop),
/// with the address range of its bytes.
struct LentPiece {
    lease: PinnedLease,
    at: usize,
    len: usize,
}

// The lease's memory is written only before it is lent; a panic cannot leave it half-updated.
impl std::panic::RefUnwindSafe for LentPiece {}

impl LentPiece {
    /// The lease, once the read-back into it is done.
    fn new(lease: PinnedLease) -> GpuResult<Self> {
        let bytes = lease.as_slice()?;
        let (at, len) = (bytes.as_ptr() as usize, bytes.len());
        Ok(Self { lease, at, len })
    }

    /// Whether `bytes` lie within the lease.
    fn holds(&self, bytes: &[u8]) -> bool {
        let p = bytes.as_ptr() as usize;
        self.at <= p && p + bytes.len() <= self.at + self.len
    }
}

/// Where a per-group selection sends its kept rows' columns instead of their row ids: the
/// columns to gather on the device, and the host's consumer of each piece read back, in
/// order.
pub struct KeptRows<'s> {
    pub columns: Vec<GatherColumn>,
    /// Whether the ranks come back too (else the pieces have none).
    pub ranks: bool,
    /// Most bytes of read-back pieces the sink may keep as they are ([`KeptPiece::buffer`]);
    /// pieces past it come through two buffers in turn, and their buffers are copies.
    pub lend: usize,
    pub sink: &'s mut dyn FnMut(KeptPiece<'_>) -> GpuResult<()>,
}

/// What a per-group selection kept: row ids in (group, order keys, row id) order, each with
/// its rank in its group (both empty where the kept rows' columns went to a [`KeptRows`]
/// sink instead).
#[derive(Debug, Default)]
pub struct GroupsKept {
    pub ids: Vec<u64>,
    pub ranks: Vec<u64>,
    pub report: FusedReport,
    /// Pairs sorted (all passing pairs, or those at or below their group's limit).
    pub sorted: usize,
}

/// A per-group selection's kept rows on the device: `total` row ids and their ranks, in kept
/// order, and the block sums that placed them, held until the rows are read back (the buffers
/// go back to the pool in this order).
struct GroupWalk {
    ranks: PooledBuffer,
    ids: PooledBuffer,
    _sums: PooledBuffer,
    total: usize,
}

/// Where each part of the kept rows lies in a read-back piece of `piece_rows` rows (`bytes`
/// bytes): each column's values and validity, then the ranks (none where `ones`).
struct KeptLayout {
    total: usize,
    ones: bool,
    piece_rows: usize,
    /// Each column's values and (where it has a bitmap) validity, as offsets in a piece.
    parts: Vec<(usize, Option<usize>)>,
    ranks_at: usize,
    bytes: usize,
}

impl KeptLayout {
    /// The layout of `total` kept rows of `columns` (with their ranks unless `ones`) in pieces
    /// of about [`KEPT_PIECE_BYTES`].
    fn new(columns: &[GatherColumn], total: usize, ones: bool) -> Self {
        // A row's bytes in a piece; pieces start at multiples of 64 rows, so that each
        // column's validity starts at a whole byte.
        let row_bytes: usize = (columns.iter())
            .map(|c| c.width + usize::from(c.validity != 0))
            .sum::<usize>()
            + if ones { 0 } else { 8 };
        let piece_rows = (KEPT_PIECE_BYTES / row_bytes.max(1)) / 64 * 64;
        let piece_rows = piece_rows.clamp(64, total.div_ceil(64) * 64);
        // Each part's place in a piece: values, validity, then the ranks, 64-byte aligned.
        let align = |n: usize| n.div_ceil(64) * 64;
        let mut parts = Vec::with_capacity(columns.len());
        let mut end = 0;
        for column in columns {
            let values = end;
            end = align(values + piece_rows * column.width);
            let validity = (column.validity != 0).then_some(end);
            if validity.is_some() {
                end = align(end + piece_rows / 8);
            }
            parts.push((values, validity));
        }
        let ranks_at = end;
        if !ones {
            end += 8 * piece_rows;
        }
        Self {
            total,
            ones,
            piece_rows,
            parts,
            ranks_at,
            bytes: end,
        }
    }

    /// Enqueues on `stream` the copies of piece `p` into `lease`: its rows of each gathered
    /// column's values and validity, and of the ranks at device address `ranks`.
    fn download(
        &self,
        lease: &mut PinnedLease,
        p: usize,
        columns: &[GatherColumn],
        gathered: &[(PooledBuffer, Option<PooledBuffer>)],
        ranks: u64,
        stream: &Arc<CudaStream>,
    ) -> GpuResult<()> {
        let start = p * self.piece_rows;
        let n = self.piece_rows.min(self.total - start);
        for ((column, (values, validity)), (at, valid_at)) in
            columns.iter().zip(gathered).zip(&self.parts)
        {
            let w = column.width;
            lease.download_at(*at, values.ptr() + (start * w) as u64, n * w, stream)?;
            if let (Some(validity), Some(valid_at)) = (validity, valid_at) {
                let bytes = n.div_ceil(8);
                lease.download_at(
                    *valid_at,
                    validity.ptr() + (start / 8) as u64,
                    bytes,
                    stream,
                )?;
            }
        }
        if !self.ones {
            lease.download_at(self.ranks_at, ranks + 8 * start as u64, 8 * n, stream)?;
        }
        Ok(())
    }

    /// Piece `p` as read back into `current` (waiting for its copies), for the sink; `lent`
    /// where the sink may keep its buffer.
    fn piece<'a>(
        &self,
        p: usize,
        columns: &[GatherColumn],
        current: &'a Arc<LentPiece>,
        lent: bool,
    ) -> GpuResult<KeptPiece<'a>> {
        let bytes = current.lease.as_slice()?;
        let start = p * self.piece_rows;
        let n = self.piece_rows.min(self.total - start);
        let columns = (columns.iter().zip(&self.parts))
            .map(|(column, (at, valid_at))| {
                let values = &bytes[*at..*at + n * column.width];
                let validity = valid_at.map(|v| &bytes[v..v + n.div_ceil(8)]);
                (values, validity)
            })
            .collect();
        let ranks = (!self.ones).then(|| &bytes[self.ranks_at..self.ranks_at + 8 * n]);
        Ok(KeptPiece {
            rows: n,
            columns,
            ranks,
            lent: lent.then_some(current),
        })
    }
}

impl TopKEngine {
    /// Top `k` of every group over `rows` device-resident rows of a generated program (row ids
    /// 0..rows; `inputs` as for [`fused_append`](Self::fused_append)) whose composite keys hold
    /// the group keys from bit `lo` up. With the program's error flags set the result is empty
    /// (the caller raises the error).
    pub(crate) fn fused_groups(
        &mut self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
        groups: GroupSpec,
        k: usize,
        rows_out: Option<KeptRows<'_>>,
    ) -> GpuResult<GroupsKept> {
        let GroupSpec { lo, ranking, .. } = groups;
        let mut kept = GroupsKept::default();
        let timer = GpuTimer::start(&self.stream)?;
        let (out, candidates) = self.group_pass(kernel, inputs, rows)?;
        let words = self.read_bytes(out.ptr(), 24)?;
        let word = |at: usize| u64::from_le_bytes(words[at..at + 8].try_into().expect("8 bytes"));
        kept.report.passed = word(0);
        kept.report.error = word(8) as u32;
        let m = word(16) as usize;
        kept.report.candidates = m;
        let pass = timer.elapsed()?;
        kept.report.group_phases_ms[0] = pass;
        if kept.report.error != 0 || m == 0 || k == 0 {
            return Ok(kept);
        }
        if m > candidates.capacity() {
            return Err(GpuError(format!(
                "the program appended {m} rows of a table of {rows}"
            )));
        }
        let (sorted, m) = self.group_sort(candidates, m, rows, groups, k)?;
        kept.sorted = m;
        let sort = timer.elapsed()?;
        kept.report.group_phases_ms[1] = sort - pass;
        let Some(walk) = self.group_walk(&sorted, m, lo, ranking, k)? else {
            return Ok(kept);
        };
        let total = walk.total;
        kept.report.kept = total;
        match rows_out {
            Some(rows_out) => {
                let ones = k == 1 || !rows_out.ranks;
                self.read_kept_rows(walk.ids.ptr(), walk.ranks.ptr(), total, ones, rows_out)?
            }
            None => {
                kept.ids = self.read_words(walk.ids.ptr(), total)?;
                // Every kept row of a selection of one a group has rank 1.
                kept.ranks = match k {
                    1 => vec![1; total],
                    _ => self.read_words(walk.ranks.ptr(), total)?,
                };
            }
        }
        kept.report.group_phases_ms[2] = timer.elapsed()? - sort;
        Ok(kept)
    }

    /// The generated program's pass with no threshold, appending every passing row's
    /// (composite key, row id) to a buffer of `rows` pairs. Returns the pass's words (rows
    /// passed (u64), error flags (u32 at 8), rows appended (u64 at 16)) and the pairs.
    fn group_pass(
        &mut self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
    ) -> GpuResult<(PooledBuffer, DevicePairs)> {
        let out = self.device.pool.alloc(24, &self.stream)?;
        self.memset_zero(self.scalars.ptr() + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        self.memset_zero(out.ptr(), 24)?;
        let mut candidates = self.alloc_pairs(rows.max(1))?;
        candidates.set_ids_below(rows as u64);
        self.fused_pass(
            kernel,
            inputs,
            rows,
            1,
            0,
            &candidates,
            out.ptr() + 16,
            out.ptr(),
            false,
            0,
        )?;
        Ok((out, candidates))
    }

    /// The `m` appended pairs (row ids below `rows`) sorted, after the algorithm's filter
    /// dropped those no group keeps; returns the sorted pairs and their number.
    fn group_sort(
        &mut self,
        candidates: DevicePairs,
        m: usize,
        rows: usize,
        groups: GroupSpec,
        k: usize,
    ) -> GpuResult<(DevicePairs, usize)> {
        let GroupSpec {
            lo,
            ranking,
            algorithm,
        } = groups;
        let (candidates, m) = match algorithm {
            GroupAlgorithm::SegmentedSort => (candidates, m),
            GroupAlgorithm::Threshold => {
                self.below_group_limits(candidates, m, rows, lo, ranking, k)?
            }
            GroupAlgorithm::Min if k == 1 => self.group_minima(candidates, m, rows, lo)?,
            GroupAlgorithm::Min => {
                return Err(GpuError(format!("group-min keeps 1 row a group, not {k}")));
            }
        };
        let sorted = self.sort_pairs(&candidates, m, rows as u64)?;
        drop(candidates);
        Ok((sorted, m))
    }

    /// Each group's first `k` rows by `ranking` among the `m` sorted pairs: groups.cu
    /// `group_count` counts them a block, `group_scan` sums the counts, and `group_write`
    /// writes their row ids and ranks in the pairs' order. `None` when no row is kept.
    fn group_walk(
        &mut self,
        sorted: &DevicePairs,
        m: usize,
        lo: u32,
        ranking: GroupRanking,
        k: usize,
    ) -> GpuResult<Option<GroupWalk>> {
        let blocks = m.div_ceil(GROUP_THREADS);
        // The block sums, then the total.
        let sums = self.device.pool.alloc(8 * (blocks + 1), &self.stream)?;
        let total_at = sums.ptr() + 8 * blocks as u64;
        let (keys, ids) = (sorted.key_at(0), sorted.id_at(0));
        let (function, k) = (ranking as u32, k as u64);
        self.launch(
            &self.kernel("group_count"),
            blocks as u32,
            GROUP_THREADS as u32,
            0,
            args![keys, ids, m, lo, function, k, sums.ptr()],
        )?;
        self.launch(
            "group_scan",
            1,
            GROUP_SCAN_THREADS,
            0,
            args![sums.ptr(), blocks, total_at],
        )?;
        let total = self.read_bytes(total_at, 8)?;
        let total = u64::from_le_bytes(total[..8].try_into().expect("8 bytes")) as usize;
        if total == 0 {
            return Ok(None);
        }
        let out_ids = self.device.pool.alloc(8 * total, &self.stream)?;
        let out_ranks = self.device.pool.alloc(8 * total, &self.stream)?;
        self.launch(
            &self.kernel("group_write"),
            blocks as u32,
            GROUP_THREADS as u32,
            0,
            args![
                keys,
                ids,
                m,
                lo,
                function,
                k,
                sums.ptr(),
                out_ids.ptr(),
                out_ranks.ptr()
            ],
        )?;
        Ok(Some(GroupWalk {
            ranks: out_ranks,
            ids: out_ids,
            _sums: sums,
            total,
        }))
    }

    /// The `total` kept rows' columns, gathered on the device (`group_gather`) at the row ids
    /// at `ids`, and their ranks at `ranks` (none where `ones`: every rank is 1, or none is
    /// wanted), read back in pieces of about [`KEPT_PIECE_BYTES`] through two pinned
    /// buffers, each handed to the sink in order while the next crosses PCIe.
    fn read_kept_rows(
        &mut self,
        ids: u64,
        ranks: u64,
        total: usize,
        ones: bool,
        rows_out: KeptRows<'_>,
    ) -> GpuResult<()> {
        let KeptRows {
            columns,
            sink,
            lend,
            ..
        } = rows_out;
        let gathered = self.gather_kept_columns(&columns, ids, total)?;
        let layout = KeptLayout::new(&columns, total, ones);
        let stream = Arc::clone(&self.stream);
        let pieces = total.div_ceil(layout.piece_rows);
        // Pieces wholly within `lend` bytes keep their own buffer, which the sink's batches
        // may hold; after them, two buffers alternate and the sink copies.
        let lent_pieces = lend / layout.bytes.max(64);
        let download = |lease: &mut PinnedLease, p: usize| {
            layout.download(lease, p, &columns, &gathered, ranks, &stream)
        };
        let mut next = Some(self.device.pinned.take(layout.bytes.max(64), false)?);
        if let Some(lease) = &mut next {
            download(lease, 0)?;
        }
        // A buffer the sink gave back, for the piece after next.
        let mut spare: Option<PinnedLease> = None;
        for p in 0..pieces {
            let Some(current) = next.take() else {
                return Err(GpuError("a kept piece was not read back".into()));
            };
            if p + 1 < pieces {
                let mut lease = match spare.take() {
                    Some(lease) => lease,
                    None => self.device.pinned.take(layout.bytes.max(64), false)?,
                };
                download(&mut lease, p + 1)?;
                next = Some(lease);
            }
            let current = Arc::new(LentPiece::new(current)?);
            sink(layout.piece(p, &columns, &current, p < lent_pieces)?)?;
            spare = Arc::try_unwrap(current).ok().map(|lent| lent.lease);
        }
        drop(gathered);
        Ok(())
    }

    /// Each column's values (and validity bits, where it has a bitmap) at the `total` row ids
    /// at `ids`, gathered on the device (`group_gather`) into new buffers.
    fn gather_kept_columns(
        &mut self,
        columns: &[GatherColumn],
        ids: u64,
        total: usize,
    ) -> GpuResult<Vec<(PooledBuffer, Option<PooledBuffer>)>> {
        let mut gathered = Vec::with_capacity(columns.len());
        for column in columns {
            if !matches!(column.width, 1 | 2 | 4 | 8 | 16) {
                return Err(GpuError(format!(
                    "no device gather of {}-byte values",
                    column.width
                )));
            }
            let values = self.device.pool.alloc(total * column.width, &self.stream)?;
            let validity = match column.validity {
                0 => None,
                _ => Some(
                    self.device
                        .pool
                        .alloc(4 * total.div_ceil(32), &self.stream)?,
                ),
            };
            let (width, dst_valid) = (
                column.width as u32,
                validity.as_ref().map_or(0, |v| v.ptr()),
            );
            self.launch(
                "group_gather",
                self.grid_for(total, 4),
                GROUP_THREADS as u32,
                0,
                args![
                    column.values,
                    width,
                    column.validity,
                    ids,
                    total,
                    values.ptr(),
                    dst_valid
                ],
            )?;
            gathered.push((values, validity));
        }
        Ok(gathered)
    }

    /// [`GroupAlgorithm::Threshold`]'s filter of pairs `[0, m)` of `candidates` (row ids below
    /// `rows`): the pairs at or below their group's limit ([`group_limits`] over a sample of
    /// [`GROUP_SAMPLE`] keys), and every pair of a group without one, in a new buffer.
    fn below_group_limits(
        &mut self,
        candidates: DevicePairs,
        m: usize,
        rows: usize,
        lo: u32,
        ranking: GroupRanking,
        k: usize,
    ) -> GpuResult<(DevicePairs, usize)> {
        let s = m.min(GROUP_SAMPLE);
        let sample = self.alloc_pairs(s)?;
        self.launch(
            &self.kernel("group_sample"),
            s.div_ceil(GROUP_THREADS) as u32,
            GROUP_THREADS as u32,
            0,
            args![candidates.key_at(0), m / s, s, sample.key_at(0)],
        )?;
        let size = self.kind.key_bytes();
        let bytes = self.download_keys(&sample, s)?;
        drop(sample);
        let mut keys: Vec<U256> = bytes.chunks_exact(size).map(u256_of_le).collect();
        keys.sort_unstable();
        let limits = group_limits(&keys, lo, ranking, k);
        if limits.is_empty() {
            return Ok((candidates, m));
        }
        let table: Vec<u8> = (limits.iter()).flat_map(|l| le_of_u256(*l, size)).collect();
        let table = self.upload_pairs(&table, &vec![0; limits.len()])?;
        let mut out = self.alloc_pairs(m)?;
        out.set_ids_below(rows as u64);
        let count = self.device.pool.alloc(8, &self.stream)?;
        self.memset_zero(count.ptr(), 8)?;
        self.launch(
            &self.kernel("group_filter"),
            self.grid_for(m, 8),
            GROUP_THREADS as u32,
            0,
            args![
                candidates.key_at(0),
                candidates.id_at(0),
                m,
                lo,
                table.key_at(0),
                limits.len(),
                out.key_at(0),
                out.id_at(0),
                count.ptr()
            ],
        )?;
        let kept = self.read_u64(count.ptr())? as usize;
        if kept > m {
            return Err(GpuError(format!(
                "{kept} of {m} pairs passed their groups' limits"
            )));
        }
        Ok((out, kept))
    }
}

impl TopKEngine {
    /// [`GroupAlgorithm::Min`]'s filter of pairs `[0, m)` of `candidates` (row ids below
    /// `rows`): each pair unless its group's hash slot holds a smaller composite of the same
    /// group, in a new buffer (see groups.cu).
    fn group_minima(
        &mut self,
        candidates: DevicePairs,
        m: usize,
        rows: usize,
        lo: u32,
    ) -> GpuResult<(DevicePairs, usize)> {
        let slots = group_slots(m);
        let size = self.kind.key_bytes();
        let table = self.device.pool.alloc(slots * size, &self.stream)?;
        self.memset_ones(table.ptr(), slots * size)?;
        let (mask, words) = ((slots - 1) as u64, self.kind.key_words());
        for j in (0..words as u32).rev() {
            self.launch(
                &self.kernel("group_min_word"),
                self.grid_for(m, 8),
                GROUP_THREADS as u32,
                0,
                args![candidates.key_at(0), m, lo, table.ptr(), mask, j],
            )?;
        }
        let mut out = self.alloc_pairs(m)?;
        out.set_ids_below(rows as u64);
        let count = self.device.pool.alloc(8, &self.stream)?;
        self.memset_zero(count.ptr(), 8)?;
        self.launch(
            &self.kernel("group_min_filter"),
            self.grid_for(m, 8),
            GROUP_THREADS as u32,
            0,
            args![
                candidates.key_at(0),
                candidates.id_at(0),
                m,
                lo,
                table.ptr(),
                mask,
                out.key_at(0),
                out.id_at(0),
                count.ptr()
            ],
        )?;
        let kept = self.read_u64(count.ptr())? as usize;
        if kept == 0 || kept > m {
            return Err(GpuError(format!(
                "{kept} of {m} pairs were their groups' smallest"
            )));
        }
        Ok((out, kept))
    }
}

/// Hash slots of [`GroupAlgorithm::Min`] for `m` pairs: at least one a pair, so that most
/// groups have a slot of their own (a user's latest tweet: tens of millions of groups), up to
/// 2^28.
fn group_slots(m: usize) -> usize {
    m.next_power_of_two().clamp(1024, 1 << 28)
}

/// A key of `bytes.len()` bytes (little-endian words, least significant first) as a `U256`.
fn u256_of_le(bytes: &[u8]) -> U256 {
    let mut word = [0u8; 32];
    word[..bytes.len()].copy_from_slice(bytes);
    U256 {
        lo: u128::from_le_bytes(word[..16].try_into().expect("16 bytes")),
        hi: u128::from_le_bytes(word[16..].try_into().expect("16 bytes")),
    }
}

/// The first `size` bytes of `key`'s little-endian image: the device's key of that width.
fn le_of_u256(key: U256, size: usize) -> Vec<u8> {
    let mut bytes = key.lo.to_le_bytes().to_vec();
    bytes.extend_from_slice(&key.hi.to_le_bytes());
    bytes.truncate(size);
    bytes
}

/// A key's bits from `lo` up: its group.
fn group_bits(key: U256, lo: u32) -> U256 {
    match lo {
        0 => key,
        256.. => U256::default(),
        128.. => U256::from_u128(key.hi >> (lo - 128)),
        _ => U256 {
            hi: key.hi >> lo,
            lo: (key.lo >> lo) | (key.hi << (128 - lo)),
        },
    }
}

/// Each sampled group's limit, from sampled keys in ascending order: the smallest sampled key
/// with k sampled keys of its group at or below it (k distinct keys under `DENSE_RANK`).
/// Every pair the group keeps is at or below it, whatever the sample: a limit is a real
/// pair's key, so at least k pairs (k distinct keys) of the group are at or below it, and the
/// kept pairs are at or below the k-th. Groups with fewer sampled keys get none. Ascending,
/// like their groups.
pub(crate) fn group_limits(sorted: &[U256], lo: u32, ranking: GroupRanking, k: usize) -> Vec<U256> {
    let mut limits = Vec::new();
    if k == 0 {
        return limits;
    }
    let mut i = 0;
    while i < sorted.len() {
        let group = group_bits(sorted[i], lo);
        let (mut counted, mut limited) = (0, false);
        let mut j = i;
        while j < sorted.len() && group_bits(sorted[j], lo) == group {
            let new = match ranking {
                GroupRanking::DenseRank => j == i || sorted[j] != sorted[j - 1],
                GroupRanking::RowNumber | GroupRanking::Rank => true,
            };
            counted += usize::from(new);
            if counted == k && !limited {
                limits.push(sorted[j]);
                limited = true;
            }
            j += 1;
        }
        i = j;
    }
    limits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits come one per group with enough sampled keys, at its k-th (distinct) key, and
    /// keys round-trip through the device's byte image.
    #[test]
    fn limits_are_each_groups_kth_sampled_key() {
        let key = |group: u128, order: u128| U256::shl_u128(group, 200) | U256::from_u128(order);
        let mut sample = vec![
            key(1, 5),
            key(1, 5),
            key(1, 7),
            key(1, 9),
            key(2, 1),
            key(3, 4),
            key(3, 4),
            key(3, 4),
        ];
        sample.sort_unstable();
        let limits = |ranking, k| group_limits(&sample, 200, ranking, k);
        assert_eq!(
            limits(GroupRanking::RowNumber, 2),
            vec![key(1, 5), key(3, 4)]
        );
        assert_eq!(limits(GroupRanking::Rank, 3), vec![key(1, 7), key(3, 4)]);
        assert_eq!(limits(GroupRanking::DenseRank, 2), vec![key(1, 7)]);
        assert_eq!(
            limits(GroupRanking::RowNumber, 1),
            vec![key(1, 5), key(2, 1), key(3, 4)]
        );
        assert!(limits(GroupRanking::RowNumber, 0).is_empty());
        assert!(limits(GroupRanking::RowNumber, 5).is_empty());
        // (2^56 - 1) << 200 | 17, shifted right.
        let a = key(u128::MAX, 17);
        let ones = (1u128 << 56) - 1;
        assert_eq!(group_bits(a, 0), a);
        assert_eq!(group_bits(a, 200), U256::from_u128(ones));
        assert_eq!(group_bits(a, 128), U256::from_u128(ones << 72));
        assert_eq!(group_bits(a, 64), U256::shl_u128(ones << 8, 128));
        assert_eq!(
            group_bits(a, 4),
            U256::shl_u128(ones << 68, 128) | U256::from_u128(1)
        );
        assert_eq!(group_bits(a, 256), U256::default());
        for size in [4, 8, 16, 32] {
            let k = U256::from_u128(u128::MAX >> (128 - 8 * size.min(16)));
            assert_eq!(u256_of_le(&le_of_u256(k, size)), k);
        }
        let wide = key(3, 9);
        assert_eq!(u256_of_le(&le_of_u256(wide, 32)), wide);
    }
}
