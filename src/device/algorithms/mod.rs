//! The host side of every kernel, on one stream: this is where the kernels of `kernels/` are
//! launched.
//!
//! A [`TopKEngine`] owns a stream and a few small device scalars (the radix control block, the
//! candidate count, the threshold) and works on [`DevicePairs`]: (composite key, row id) pairs
//! in two pooled device buffers, keys in the device layout of their [`KeyKind`]. Everything it
//! enqueues runs in stream order, so no step waits for the host except the few that read a
//! result back (a count, a consistency check, the final row ids).
//!
//! - [`encode_column`](TopKEngine::encode_column): Arrow buffers → composite keys (encode.cu);
//! - [`append`](TopKEngine::append): keys below the threshold → candidate buffer
//!   (candidates.cu);
//! - [`fused_append`](TopKEngine::fused_append): a generated kernel ([`crate::fusion`]):
//!   predicate, keys and append in one pass over the raw input columns;
//!   [`fused_select`](TopKEngine::fused_select): that pass over device-resident columns behind
//!   a sampled threshold, then the candidates' selection (for a large k, their sort as packed
//!   64-bit words where the key bits that vary and the row id fit one, [`packed_field`]);
//! - [`radix_select`](TopKEngine::radix_select): exactly the k smallest pairs, unordered, any k
//!   (radix.cu);
//! - [`bitonic_select`](TopKEngine::bitonic_select): the k smallest, sorted, for
//!   k ≤ [`bitonic_max_k`](TopKEngine::bitonic_max_k) (bitonic.cu);
//! - [`sample_select`](TopKEngine::sample_select): SampleSelect, the k smallest through sampled
//!   thresholds and filtering passes chained on the device, then a rank sort, a chunk rank
//!   sort or a merge sort of the survivors on their device count (sample.cu, bitonic.cu,
//!   merge_sort.cu);
//! - [`sort`](TopKEngine::sort): bitonic sort of any number of pairs, in register tiles
//!   (bitonic.cu); [`sort_pairs`](TopKEngine::sort_pairs): the sort for m pairs (a register
//!   tile, the chunk rank sort, the LSD radix sort of radix_sort.cu or the merge sort of
//!   merge_sort.cu); [`merge_sort`](TopKEngine::merge_sort): the first k of m pairs, sorted,
//!   m known to the host or only to the device (`merge_sort_packed`: the same over packed
//!   words, keys only);
//! - [`select_sorted`](TopKEngine::select_sorted): one of the selections, then sorted; or in
//!   two steps, [`enqueue_select`](TopKEngine::enqueue_select) (a small-k sampled selection is
//!   enqueued whole, no host round trip inside) and [`finish`](TopKEngine::finish) (reads its
//!   status back with the result).
//!
//! The engine's methods follow the stages: here its buffers, transfers, encoding and appends
//! and the entry points above; in `fused` the generated program's passes; in `select` the exact
//! selections (radix, bitonic, delegates); in `sample` SampleSelect's device chain; in `sort`
//! the sorts. The tuning constants of all of them stay here, in one place.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, DriverError, result};

use super::kernels::{GENERATED_THREADS, GeneratedKernel, Kernels};
use super::memory::{PinnedLease, PooledBuffer};
use super::timer::GpuTimer;
use super::watch::{self, DeviceOp};
use super::{GpuDevice, GpuError, GpuResult};

/// The device layout of composite keys: the narrowest of four that holds the layout's bits
/// (keys are right-aligned, so a layout of ≤ 32 bits fits a `u32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    K32,
    K64,
    K128,
    K256,
}

impl KeyKind {
    pub const ALL: [KeyKind; 4] = [KeyKind::K32, KeyKind::K64, KeyKind::K128, KeyKind::K256];

    /// The narrowest kind holding `total_bits` (≤ 256) bits.
    pub fn for_total_bits(total_bits: u32) -> Self {
        match total_bits {
            0..=32 => KeyKind::K32,
            33..=64 => KeyKind::K64,
            65..=128 => KeyKind::K128,
            _ => KeyKind::K256,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            KeyKind::K32 => 32,
            KeyKind::K64 => 64,
            KeyKind::K128 => 128,
            KeyKind::K256 => 256,
        }
    }

    /// Bytes of one key in device memory (little-endian words, least significant first).
    pub fn key_bytes(self) -> usize {
        self.bits() as usize / 8
    }

    /// Words of a key in device memory (common.cuh `K::N`: 32-bit words for K32, else 64-bit).
    pub fn key_words(self) -> usize {
        self.bits().div_ceil(64) as usize
    }

    /// Suffix of the kernels' entry points for this kind.
    pub fn suffix(self) -> &'static str {
        match self {
            KeyKind::K32 => "k32",
            KeyKind::K64 => "k64",
            KeyKind::K128 => "k128",
            KeyKind::K256 => "k256",
        }
    }

    /// Bytes of one pair in shared memory (key, then row id).
    fn pair_bytes(self) -> usize {
        self.key_bytes() + 8
    }
}

/// The selection algorithms the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceAlgorithm {
    /// Bitonic top-k (small k): the k smallest, sorted, in shared memory.
    Bitonic,
    /// Radix select (any k), then a bitonic sort of the winners.
    Radix,
    /// Sampled threshold (SampleSelect): a sorted sample estimates the k-th pair, one filtering
    /// pass keeps the pairs below the estimate, and the k are selected among those; radix
    /// select when the estimate misses.
    Sample,
    /// Dr. Top-k's delegates: the smallest pair of each subrange of 2^α, the k-th smallest
    /// delegate as a threshold, and the pairs below it gathered from the ≥ k subranges whose
    /// delegates pass; then a sort of those.
    Delegate,
}

impl DeviceAlgorithm {
    /// Every algorithm, in the order the cost model lists them.
    pub const ALL: [DeviceAlgorithm; 4] = [
        DeviceAlgorithm::Bitonic,
        DeviceAlgorithm::Radix,
        DeviceAlgorithm::Sample,
        DeviceAlgorithm::Delegate,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DeviceAlgorithm::Bitonic => "bitonic",
            DeviceAlgorithm::Radix => "radix",
            DeviceAlgorithm::Sample => "sample",
            DeviceAlgorithm::Delegate => "delegate",
        }
    }
}

/// How encode.cu reads a column: the keys module's native representation.
pub use crate::keys::Native as NativeCode;

/// encode.cu flags.
pub const ENCODE_FIRST: u32 = 1;
pub const ENCODE_NULLABLE: u32 = 2;
pub const ENCODE_NULLS_FIRST: u32 = 4;

/// One column for [`TopKEngine::encode_column`]; pointers are device addresses.
#[derive(Debug, Clone, Copy)]
pub struct EncodeColumn {
    /// The first row's value (for booleans: the byte holding bit `value_bit_offset`).
    pub values: u64,
    pub value_bit_offset: u64,
    /// Arrow validity bitmap (1 = valid) at the byte holding bit `validity_bit_offset`, or 0
    /// when every row is valid.
    pub validity: u64,
    pub validity_bit_offset: u64,
    pub rows: usize,
    pub native: NativeCode,
    pub value_bits: u32,
    /// Offset of the field's lowest bit in the composite.
    pub shift: u32,
    /// XORed into the value bits (all value bits for DESC).
    pub xor: u128,
    /// `ENCODE_*` flags.
    pub flags: u32,
}

/// (key, row id) pairs in device memory.
#[derive(Debug)]
pub struct DevicePairs {
    keys: PooledBuffer,
    ids: PooledBuffer,
    capacity: usize,
    kind: KeyKind,
    /// Row id i is i: passes that only filter may skip reading the ids.
    positional: bool,
    /// Every row id is below this (`u64::MAX`: unknown): the radix sorts skip the row id
    /// digits above it.
    ids_below: u64,
}

impl DevicePairs {
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Declares that row id i is i (e.g. ids uploaded as 0..n).
    pub fn set_positional(&mut self, positional: bool) {
        self.positional = positional;
    }

    /// Declares that every row id is below `bound`.
    pub fn set_ids_below(&mut self, bound: u64) {
        self.ids_below = bound;
    }

    /// A bound on the row ids of pairs `[0, n)`: n for positional pairs.
    pub fn id_bound(&self, n: usize) -> u64 {
        if self.positional {
            n as u64
        } else {
            self.ids_below
        }
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// Device address of key `i`.
    pub fn key_at(&self, i: usize) -> u64 {
        self.keys.ptr() + (i * self.kind.key_bytes()) as u64
    }

    /// Device address of row id `i`.
    pub fn id_at(&self, i: usize) -> u64 {
        self.ids.ptr() + (i * 8) as u64
    }
}

/// Pairs sorted on the device, e.g. the merge sort's output ([`TopKEngine::merge_sort`]): its
/// sorted run lies at the start of one of two buffers, which the pair count decides. The
/// rounds were planned for a capacity, those past the one that leaves a single run copy
/// nothing, and a device-counted sort's caller learns the count only after enqueueing it.
#[derive(Debug)]
pub struct SortedPairs {
    /// The tile sort's output, which rounds 0, 2, … read and rounds 1, 3, … write.
    tiles: DevicePairs,
    /// The other buffer (none when one tile was the whole sort).
    other: Option<DevicePairs>,
    tile: usize,
}

impl SortedPairs {
    /// Pairs sorted at the start of `pairs`, whatever the count.
    fn ready(pairs: DevicePairs) -> Self {
        Self {
            tiles: pairs,
            other: None,
            tile: 1,
        }
    }

    /// The buffer that holds the sorted run of `m` pairs: each round that ran (one per
    /// doubling of the runs until they reach m) wrote the other buffer than the last.
    pub fn into_pairs(self, m: usize) -> DevicePairs {
        let rounds = m.div_ceil(self.tile).next_power_of_two().trailing_zeros();
        match self.other {
            Some(other) if rounds % 2 == 1 => other,
            _ => self.tiles,
        }
    }
}

/// A kernel argument (kernels take device pointers as `u64`).
#[derive(Debug, Clone, Copy)]
enum Arg {
    U64(u64),
    U32(u32),
}

impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::U64(v)
    }
}

impl From<u32> for Arg {
    fn from(v: u32) -> Self {
        Arg::U32(v)
    }
}

impl From<usize> for Arg {
    fn from(v: usize) -> Self {
        Arg::U64(v as u64)
    }
}

/// The radix sorts' three pair buffers as kernel arguments: input, scratch and output, keys
/// then row ids of each.
fn sort_buffers(input: &DevicePairs, tmp: &DevicePairs, out: &DevicePairs) -> [Arg; 6] {
    [
        Arg::from(input.key_at(0)),
        Arg::from(input.id_at(0)),
        Arg::from(tmp.key_at(0)),
        Arg::from(tmp.id_at(0)),
        Arg::from(out.key_at(0)),
        Arg::from(out.id_at(0)),
    ]
}

macro_rules! args {
    ($($a:expr),* $(,)?) => { &[$(Arg::from($a)),*] };
}

// The engine's methods by stage (after `args!`, which they use).
mod fused;
mod sample;
mod select;
mod sort;
mod top_bits;

pub use fused::packed_field;
use top_bits::TopBitsRun;
pub use top_bits::{top_bits_capacity, top_bits_sorts};

// The small device scalars of an engine, one buffer (zeroed at start).
/// The radix control block (`RadixCtl` in radix.cu, 1160 bytes).
const CTL_OFFSET: u64 = 0;
const CTL_BYTES: usize = 1160;
// Fields of RadixCtl read back by the host.
const CTL_N_OUT: usize = 16;
const CTL_DONE: usize = 1140;
const CTL_ERROR: usize = 1156;
/// `Threshold<K>` of candidates.cu (≤ 48 bytes).
const THRESHOLD_OFFSET: u64 = 2048;
const THRESHOLD_BYTES: usize = 64;
/// The candidate count (u64).
const COUNT_OFFSET: u64 = 2112;
/// pair_max's block counter (u32, zero between launches).
const COUNTER_OFFSET: u64 = 2120;
const SCALAR_BYTES: usize = 4096;

/// Host byte slices copied into one pinned (write-combined) buffer at aligned offsets, ready for
/// [`TopKEngine::upload_staged`]. Filling needs no engine, so callers fill theirs in parallel
/// and hold the engine only for the copy and the kernels.
#[derive(Debug)]
pub struct StagedHost {
    lease: PinnedLease,
    offsets: Vec<usize>,
    total: usize,
}

/// Copies `groups` into a pinned buffer from the device's pool: each group at an aligned
/// offset, its slices back to back (one device array from several host chunks).
pub fn fill_staging(device: &Arc<GpuDevice>, groups: &[Vec<&[u8]>]) -> GpuResult<StagedHost> {
    let mut offsets = Vec::with_capacity(groups.len());
    let mut total = 0usize;
    for group in groups {
        offsets.push(total);
        let bytes: usize = group.iter().map(|p| p.len()).sum();
        total += bytes.div_ceil(STAGE_ALIGN) * STAGE_ALIGN;
    }
    let total = total.max(STAGE_ALIGN);
    let mut lease = device.pinned.take(total, true)?;
    let host = lease.as_mut_slice()?;
    for (&offset, group) in offsets.iter().zip(groups) {
        let mut at = offset;
        for part in group {
            host[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }
    Ok(StagedHost {
        lease,
        offsets,
        total,
    })
}

/// `GPU_TOPK_TRACE` set: engines print per-phase device times (synchronising after each).
fn trace_enabled() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("GPU_TOPK_TRACE").is_some())
}

/// The sampled threshold's hash seed; its block size (sample.cu `SAMPLE_THREADS`).
const SAMPLE_SEED: u64 = 0x5eed_5a3b_1e00_0001;
const SAMPLE_THREADS: u32 = 1024;
/// The sampled selection's device scalars: a survivor count per level (`SAMPLE_MAX_LEVELS`
/// u64), the rank sort's per-row block counters, then the status word (sample.cu `STATUS_*`);
/// read back at the end. The rank sort's rank words follow (zeroed with them, not read back).
const SAMPLE_CTL_BYTES: usize = 512;
const SAMPLE_ROW_DONE_OFFSET: u64 = 64;
const SAMPLE_STATUS_OFFSET: u64 = 504;
const SAMPLE_RANKS_OFFSET: u64 = 512;
/// 24 bytes the caller may copy into the control block before it is read back, to bring its
/// own words back with it ([`TopKEngine::fused_select`]).
const SAMPLE_CALLER_OFFSET: u64 = 320;
const _: () = assert!(
    8 * SAMPLE_MAX_LEVELS as u64 <= SAMPLE_ROW_DONE_OFFSET
        && SAMPLE_ROW_DONE_OFFSET + 4 * (RANK_SORT_MAX / RANK_THREADS as usize) as u64
            <= SAMPLE_CALLER_OFFSET
        && SAMPLE_CALLER_OFFSET + 24 <= SAMPLE_STATUS_OFFSET
);
/// [`TopKEngine::fused_select`]'s device words: the full pass's (passed, errors, appended),
/// the sample pass's, the sample threshold's status, the denser sample's pass's, and the
/// candidates' key span.
const FUSED_WORDS: usize = FUSED_SPAN_OFFSET as usize + 16 * 4;
/// Where [`FUSED_WORDS`] keep the candidates' key span (candidates.cu `key_span`: two words
/// per key word), read back with the full pass's words.
const FUSED_SPAN_OFFSET: u64 = 80;

/// The fused selection's denser sample ([`TopKEngine::fused_select`], for k beyond the rank
/// sort where the first threshold's candidates might not fit the packed sort's one wave): this
/// many times the first sample's rows, of which only those below its threshold are kept (~16 r
/// of them, far below what the one-block threshold holds). H100, Q2 at 250M rows:
/// at k = 10^6 1.27M candidates where the first threshold's 4σ margin expects 1.74M (past the
/// wave's 1.62M: its draw left 1.45M), the sample phase 39 against 16 µs; at k = 10^5 (165K
/// candidates against 281K, both in one wave) the selection took as long either way, and the
/// denser sample's ~20 µs went for nothing (1.18–1.21× the floor with it, 1.17 without).
const FUSED_REFINE: usize = 16;
const SAMPLE_SCRATCH_BYTES: usize = SAMPLE_CTL_BYTES + 4 * RANK_SORT_MAX;
const SAMPLE_STATUS_FINAL_LARGE: u32 = 4;
/// Survivors of a sampled selection are sorted whole (rather than radix-selected first) up to
/// this many times k (or times `DIRECT_SORT_MIN`): the radix sort costs about as much as the
/// radix select's ~26 launches at a few times k.
pub const DIRECT_SORT_FACTOR: usize = 4;
pub const DIRECT_SORT_MIN: usize = 1 << 16;

/// The rank sort that ends a sampled selection (bitonic.cu `rank_sort`): up to this many
/// pairs, each ranked by a binary search in every sorted chunk of `RANK_THREADS`, in one
/// launch of (m / `RANK_THREADS`)² blocks (the unused ones return at once).
pub const RANK_SORT_MAX: usize = 16384;
/// Threads of the chunk rank sort's tile blocks (bitonic.cu `CHUNK_THREADS`).
const CHUNK_THREADS: u32 = 512;
/// The most tiles [`TopKEngine::chunk_rank_sort`] takes: its rank kernel's blocks, L2 traffic
/// and count matrix grow with their square.
const CHUNK_RANK_TILES: usize = 96;

/// Pairs per tile of the chunk rank sort (bitonic.cu `CHUNK_TILE`): half the sort tile.
pub fn chunk_tile(kind: KeyKind) -> usize {
    sort_tile(kind) / 2
}

/// The most pairs the chunk rank sort takes (196608; 98304 for 256-bit keys).
pub fn chunk_rank_max(kind: KeyKind) -> usize {
    CHUNK_RANK_TILES * chunk_tile(kind)
}
const RANK_THREADS: u32 = 256;

/// The radix sort's block size (radix_sort.cu `RSORT_THREADS`); it sorts fewer pairs than
/// this (its look-back words hold counts below 2^30).
const RSORT_THREADS: u32 = 256;
pub const RADIX_SORT_MAX: usize = 1 << 30;
/// Radix sort passes over at most this many tiles use Onesweep's single kernel with a
/// look-back; larger ones take wide tiles (`ONESWEEP_WIDE_MAX_TILES`), and beyond those
/// reduce-then-scan (three kernels, no spinning: the look-back of a 555-tile pass saturated the
/// L2, radix_sort.cu).
pub const ONESWEEP_MAX_TILES: usize = 64;
/// Passes over more tiles than `ONESWEEP_MAX_TILES`, but at most this many wide tiles
/// ([`radix_sort_wide_tile`]), run Onesweep's single kernel on wide tiles
/// (radix_sort.cu `rsort_pass_wide`): up to 1.5M pairs of 64-bit keys.
pub const ONESWEEP_WIDE_MAX_TILES: usize = 384;
/// Tiles per group of the wide pass's grouped look-back (radix_sort.cu `LOOKBACK_GROUP`).
pub const LOOKBACK_GROUP: usize = 16;

/// Pairs per tile of a radix sort pass (radix_sort.cu: `RSORT_THREADS` × `SortItems`).
pub fn radix_sort_tile(kind: KeyKind) -> usize {
    let items = match kind {
        KeyKind::K32 | KeyKind::K64 => 8,
        KeyKind::K128 => 4,
        KeyKind::K256 => 2,
    };
    RSORT_THREADS as usize * items
}

/// Pairs per tile of a wide radix sort pass (radix_sort.cu `WideItems`): twice
/// [`radix_sort_tile`].
pub fn radix_sort_wide_tile(kind: KeyKind) -> usize {
    2 * radix_sort_tile(kind)
}

/// The merge sort's block size (merge_sort.cu `MSORT_THREADS`). Twice the threads with half
/// the pairs each (the same tile) measured 0–12% slower (H100).
const MSORT_THREADS: u32 = 256;
/// The merge sort (merge_sort.cu) takes up to this many pairs: the survivors of a sampled
/// selection beyond the chunk rank sort's capacity, a fused pass's candidates at large k, and
/// host-counted sorts that need more than a 32-bit key's digits.
pub const MERGE_SORT_MAX: usize = 1 << 22;

/// Pairs per tile of the merge sort (merge_sort.cu: `MSORT_THREADS` × `MergeItems`).
pub fn merge_sort_tile(kind: KeyKind) -> usize {
    radix_sort_tile(kind)
}

/// Whether [`TopKEngine::sort_pairs`] takes the merge sort for m pairs whose ids are below
/// `id_bound` (1: they ascend in input order): beyond the chunk rank sort and up to
/// [`MERGE_SORT_MAX`], unless the key's radix passes alone sort them (`key_passes_sort`).
/// The cost model asks the same.
pub fn merge_sorts(kind: KeyKind, m: usize, id_bound: u64) -> bool {
    m > chunk_rank_max(kind) && m <= MERGE_SORT_MAX && !(id_bound <= 1 && key_passes_sort(kind, m))
}

/// Whether the key's radix passes alone (row ids ascending in input order) sort m pairs
/// faster than the merge sort: always for 32-bit keys (4 passes); for 64-bit keys over wide
/// tiles, where the grouped look-back keeps a pass near 20 µs and digit positions that every
/// pair shares are skipped (H100, n = 2^20, 48–189 µs against 138–190 µs for the
/// merge sort, losing only on keys that vary in all 8 bytes).
fn key_passes_sort(kind: KeyKind, m: usize) -> bool {
    match kind {
        KeyKind::K32 => true,
        KeyKind::K64 => radix_sort_is_wide(kind, m),
        _ => false,
    }
}

/// Whether the radix sort of m pairs runs its passes over wide tiles (`rsort_pass_wide`, with
/// the grouped look-back): more than `ONESWEEP_MAX_TILES` tiles, at most
/// `ONESWEEP_WIDE_MAX_TILES` wide ones.
pub fn radix_sort_is_wide(kind: KeyKind, m: usize) -> bool {
    m.div_ceil(radix_sort_tile(kind)) > ONESWEEP_MAX_TILES
        && m.div_ceil(radix_sort_wide_tile(kind)) <= ONESWEEP_WIDE_MAX_TILES
}

/// Whether a sampled selection of k among n positional pairs sorts all n instead: where the
/// key's radix passes sort them (32- or 64-bit keys, row ids ascending in input order) over
/// wide tiles with the grouped look-back, and k is at least n / [`whole_sort_fraction`].
/// The cost model asks the same.
pub fn sample_sorts_whole(kind: KeyKind, n: usize, k: usize, positional: bool) -> bool {
    positional
        && whole_sort_fraction(kind).is_some_and(|f| k.saturating_mul(f) >= n)
        && radix_sort_is_wide(kind, n)
}

/// k / n from which [`sample_sorts_whole`] holds. Measured on the H100 at n = 2^20 (session
/// 16, seven distributions):
/// - 32-bit keys: the whole sort took 35–91 µs whatever k; the sampled levels 118–206 µs at
///   k = 2^17 … 2^19 (their survivors' chunk rank or merge sort) and 75–116 µs at k = 2^16,
///   where the whole sort was up to 9% slower on sorted keys and 1.5–2.2× faster on ties and
///   narrow ranges: from n / 16.
/// - 64-bit keys (eight passes where every byte varies): the whole sort 48–189 µs; the levels
///   151–243 µs at k = 2^17 and 83–136 µs at k = 2^16: from n / 8.
pub fn whole_sort_fraction(kind: KeyKind) -> Option<usize> {
    match kind {
        KeyKind::K32 => Some(16),
        KeyKind::K64 => Some(8),
        _ => None,
    }
}

/// Threads of the sort kernels' blocks (bitonic.cu `SORT_THREADS`).
const SORT_THREADS: u32 = 1024;

/// The tile of the sort kernels (bitonic.cu `SORT_TILE`): 1024 threads holding 4 pairs each in
/// registers (2 for 256-bit keys). A 16384-pair shared-memory chunk sorted by one block of 512
/// threads took 0.3 ms (measured).
pub fn sort_tile(kind: KeyKind) -> usize {
    if kind == KeyKind::K256 { 2048 } else { 4096 }
}

/// Pairs in one level's sample: as many as one block holds in registers (sample.cu
/// `SamplePer` × 1024 threads).
pub fn sample_size(kind: KeyKind) -> usize {
    match kind {
        KeyKind::K32 => 10 << 10,
        KeyKind::K64 => 8 << 10,
        KeyKind::K128 => 4 << 10,
        KeyKind::K256 => 2 << 10,
    }
}

/// The sample rank of a level's threshold (sample.cu computes the same on the device, from
/// the actual count): five standard deviations above the k-th pair's expected rank.
fn sample_rank(k: usize, s: usize, m: usize) -> usize {
    if s >= m {
        return k;
    }
    let e = k as f64 * s as f64 / m as f64;
    (e + 5.0 * e.sqrt() + 3.0).ceil() as usize
}

/// One level of a sampled selection: the capacity of its survivor buffer and the pairs its
/// threshold samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleLevel {
    pub cap: usize,
    pub s: usize,
}

/// A level's expected survivors and its buffer capacity (the expected count plus six of its
/// standard deviations), for a sample of s among m; `None` when the sample rank reaches s.
pub fn sample_level_bounds(m: usize, k: usize, s: usize) -> Option<(usize, usize)> {
    let r = sample_rank(k, s, m);
    if r >= s {
        return None;
    }
    Some(if s == m {
        // Exact when the count is as planned; room for a sampled level if it came out
        // above the sample size (r ≈ k + 5√k + 3 then).
        (k, (2 * k + 1024).min(m))
    } else {
        let per = m as f64 / s as f64;
        let below = r as f64 + 1.0;
        let spread = 6.0 * below.sqrt() + 8.0;
        (
            (below * per) as usize,
            (((below + spread) * per) as usize + 1024).min(m),
        )
    })
}

/// The levels of a sampled selection of k among n (`s_max` pairs sampled at most, `small`
/// pairs rank-sorted at the end): levels are added while a level's survivors could exceed
/// (by four standard deviations) what the final rank sort takes, and a level shrinks them at
/// least by a quarter. The last level, whose survivors the rank sort takes, samples only as many
/// pairs (in steps of 1024, one per thread) as keep its survivors below `small` with that
/// margin: the one-block threshold costs in proportion to its sample (16.5 µs for 10240
/// pairs, ncu), the rank sort takes the extra survivors in a few µs. An exact level (the
/// sample is the whole level) records `s_max`, so that the device takes all of an actual
/// count that came out above the plan. Empty: sampling cannot shrink this input.
pub fn plan_sample_levels(n: usize, k: usize, s_max: usize, small: usize) -> Vec<SampleLevel> {
    const STEP: usize = 1024;
    // Survivors of a sampled level of s among m, four standard deviations above expected.
    let high = |m: usize, s: usize| {
        if s >= m {
            return k;
        }
        let below = sample_rank(k, s, m) as f64 + 1.0;
        ((below + 4.0 * below.sqrt() + 4.0) * (m as f64 / s as f64)) as usize
    };
    let mut plan: Vec<SampleLevel> = Vec::new();
    let (mut m, mut m_high) = (n, n);
    // The cap on levels only guards against a runaway plan (each level shrinks m by a quarter
    // or more).
    while m_high > small && k < m && plan.len() < SAMPLE_MAX_LEVELS {
        let s = s_max.min(m);
        let Some((expected, cap)) = sample_level_bounds(m, k, s) else {
            break;
        };
        if expected * 4 > m * 3 {
            break;
        }
        let mut level = SampleLevel { cap, s };
        if s == m {
            level.s = s_max;
        } else if high(m, s) <= small
            && let Some(smaller) = (1..s / STEP)
                .map(|i| i * STEP)
                .find(|&s| high(m, s) <= small)
        {
            let (_, cap) = sample_level_bounds(m, k, smaller).expect("a smaller sample");
            level = SampleLevel { cap, s: smaller };
        }
        m_high = high(m, level.s.min(m));
        plan.push(level);
        m = expected;
    }
    plan
}

/// Dr. Top-k's α rule: subranges of S = 2^α pairs with S ≈ √(n/k), which balances the
/// delegates written and re-read (n/S) against the pairs gathered (≤ k·S); S is at least a
/// warp's 32 (one coalesced load per lane) and at most 4096, and leaves at least k subranges.
/// `None` when n/k < 32: too few subranges for the delegates to filter anything.
pub fn delegate_subrange(n: usize, k: usize) -> Option<usize> {
    const MIN: usize = 32;
    const MAX: usize = 4096;
    let k = k.max(1);
    if n / k < MIN {
        return None;
    }
    let ideal = ((n as f64 / k as f64).sqrt() as usize).max(1);
    // The power of two nearest √(n/k) (geometrically), within the bounds and n/k.
    let lower = 1usize << (usize::BITS - 1 - ideal.leading_zeros());
    let s = if ideal * ideal > 2 * lower * lower {
        lower * 2
    } else {
        lower
    };
    Some(s.clamp(MIN, MAX).min(prev_power_of_two(n / k)))
}

/// Bits of the row ids below `bound`.
fn id_bits(bound: u64) -> u32 {
    64 - bound.saturating_sub(1).leading_zeros()
}

fn prev_power_of_two(x: usize) -> usize {
    1usize << (usize::BITS - 1 - x.max(1).leading_zeros())
}

/// The most levels a sampled selection plans (sample counts live in `SAMPLE_CTL_BYTES`).
const SAMPLE_MAX_LEVELS: usize = 8;

/// Rows the fused selection's sample pass evaluates ([`TopKEngine::fused_select`]), at most:
/// as many as sample.cu's one-block threshold holds for 64-bit keys ([`sample_size`]; wider
/// keys sample fewer), so that the threshold is exact and costs one launch. 8192 measured best
/// on the H100, against 16384 and 4096 (the sample's selection grows with its
/// pairs, the final selection with the candidates a coarser sample admits).
pub const FUSED_SAMPLE_ROWS: usize = RANK_SORT_MAX / 2;

/// Consecutive rows the fused selection's samples take at a time (fused.cuh `sample_row`: a
/// sample of one row in `step` takes this many consecutive rows every `this · step` rows), so
/// that a warp's loads take whole sectors. H100, Q2 at k = 10^6 of 250M rows: the
/// sample phase 37 → 30 µs against rows `step` apart, 8 rows measuring as 32.
pub const FUSED_SAMPLE_CLUSTER: usize = 32;

/// How a [`TopKEngine::fused_select`] went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FusedReport {
    /// Rows that passed the predicate.
    pub passed: u64,
    /// The program's error flags ([`crate::fusion::ERROR_NULL_KEY`] and co.); when not 0 the
    /// selection stopped and its result is empty.
    pub error: u32,
    /// Rows of the sample pass (0: no sample).
    pub sampled: usize,
    /// Rows of the denser sample that refined its threshold (0: none).
    pub refined: usize,
    /// Rows the (last) full pass appended.
    pub candidates: usize,
    /// Full passes repeated because the sampled threshold missed.
    pub reruns: usize,
    /// Bits of the 64-bit words a large k's candidates were packed into for their keys-only
    /// merge sort (the key bits that vary, then the row id's); 0 when they were not packed.
    pub packed_bits: u32,
}

/// Threads per block of the grid-stride kernels; of the bitonic top-k's blocks.
const THREADS: u32 = 256;
const BITONIC_THREADS: u32 = 512;
/// Largest chunk one upload through pinned memory moves.
const UPLOAD_CHUNK: usize = 64 << 20;
/// Staged parts start at multiples of this (aligned loads of every type).
const STAGE_ALIGN: usize = 256;

/// Runs the kernels on one stream (see the module documentation). Not thread-safe: callers
/// serialise access (the selector holds it behind a mutex).
pub struct TopKEngine {
    device: Arc<GpuDevice>,
    kernels: Arc<Kernels>,
    stream: Arc<CudaStream>,
    kind: KeyKind,
    scalars: PooledBuffer,
    /// Two write-combined upload buffers used in turn, so that the host fills one while the
    /// other is being copied.
    upload: [Option<PinnedLease>; 2],
    next_upload: usize,
    /// Device buffer that staged batch data lands in (overwritten by each `stage`).
    staging: Option<PooledBuffer>,
    readback: Option<PinnedLease>,
    /// A second stream for read-backs that the engine's stream should not wait for
    /// ([`TopKEngine::read_bytes_after`]); made on first use.
    side_stream: Option<Arc<CudaStream>>,
    /// The last fused selection's phase events (phase, event at its end; the first marks its
    /// start), read by [`TopKEngine::fused_phases_ms`].
    fused_marks: Vec<(usize, cudarc::driver::CudaEvent)>,
    /// Expected candidates above which a fused selection refines its threshold by the denser
    /// sample; `None`: the packed sort's one wave ([`TopKEngine::set_refine_above`]).
    refine_above: Option<usize>,
    /// [`TopKEngine::packed_sort_wave`], found by its occupancy queries once.
    packed_sort_wave: std::sync::OnceLock<usize>,
}

impl std::fmt::Debug for TopKEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopKEngine")
            .field("kind", &self.kind)
            .finish()
    }
}

impl TopKEngine {
    /// An engine for keys of `kind` on a new stream of `device`; compiles or loads the kernels
    /// on first use.
    pub fn new(device: &Arc<GpuDevice>, kind: KeyKind) -> GpuResult<Self> {
        let kernels = device.kernels()?;
        let stream = device.new_stream()?;
        device.context.bind_to_thread()?;
        let scalars = device.pool.alloc(SCALAR_BYTES, &stream)?;
        let engine = Self {
            device: Arc::clone(device),
            kernels,
            stream,
            kind,
            scalars,
            upload: [None, None],
            next_upload: 0,
            staging: None,
            readback: None,
            side_stream: None,
            fused_marks: Vec::new(),
            refine_above: None,
            packed_sort_wave: std::sync::OnceLock::new(),
        };
        engine.memset_zero(engine.scalars.ptr(), SCALAR_BYTES)?;
        Ok(engine)
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// Waits for all work enqueued so far.
    pub fn synchronize(&self) -> GpuResult<()> {
        Ok(self.stream.synchronize()?)
    }

    // ---- plumbing ------------------------------------------------------------------------

    fn launch(
        &self,
        name: &str,
        grid: u32,
        block: u32,
        shared: usize,
        args: &[Arg],
    ) -> GpuResult<()> {
        let function = self.kernels.get(name)?;
        self.launch_function(function, name, grid, block, shared, args)
    }

    /// Launches `function` (`name` for errors). Where the device takes programmatic dependent
    /// launch ([`GpuDevice::programmatic_launch`]), with programmatic stream serialisation: the
    /// driver stages the launch while the previous kernel drains, and the kernel's first
    /// statement (common.cuh `grid_dependency_wait`) waits for that kernel's writes. A chain of
    /// dependent kernels then pays less of the ~4–5 µs each launch costs between kernels (H100
    /// of the device tool, 32 chained kernels of n = 2^21 took 5.13 µs each, 3.89
    /// with the attribute).
    fn launch_function(
        &self,
        function: &CudaFunction,
        name: &str,
        grid: u32,
        block: u32,
        shared: usize,
        args: &[Arg],
    ) -> GpuResult<()> {
        let failed = |e: DriverError| GpuError(format!("launching {name} failed: {e}"));
        use cudarc::driver::sys;
        watch::check(DeviceOp::Launch).map_err(|e| GpuError(format!("launching {name}: {e}")))?;
        self.device.context.bind_to_thread().map_err(failed)?;
        // The driver copies the values behind these pointers at the launch.
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter()
            .map(|arg| match arg {
                Arg::U64(v) => v as *const u64 as *mut std::ffi::c_void,
                Arg::U32(v) => v as *const u32 as *mut std::ffi::c_void,
            })
            .collect();
        // SAFETY: a plain-old-data union, all zeros is a valid value.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.max(1),
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared as u32,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            // Without it, a plain launch (cuLaunchKernelEx with no attribute).
            numAttrs: u32::from(self.device.programmatic_launch()),
        };
        // SAFETY: every kernel's parameters are device pointers (u64) and scalars whose order
        // and types the callers below match to the .cu signatures; the buffers behind the
        // pointers are alive until the work is ordered before their release (pool events).
        // `params` points at `args` and `config` at `attribute`, both alive for the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(failed)?;
        Ok(())
    }

    fn kernel(&self, base: &str) -> String {
        format!("{base}_{}", self.kind.suffix())
    }

    /// Blocks for a grid-stride kernel over `n` items.
    fn grid_for(&self, n: usize, items_per_thread: usize) -> u32 {
        let blocks = n.div_ceil(THREADS as usize * items_per_thread).max(1);
        blocks.min(self.device.sm_count * 8) as u32
    }

    /// Blocks of `block` threads of kernel `name` that are resident on the whole device at
    /// once: the grid of a grid-stride pass that should run in one wave (a second, partial
    /// wave of a bandwidth-bound pass leaves SMs idle at its end).
    fn resident_grid(&self, name: &str, block: u32) -> GpuResult<u32> {
        let per_sm = self
            .kernels
            .get(name)?
            .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
            .map_err(|e| GpuError(format!("occupancy of {name}: {e}")))?;
        Ok((per_sm.max(1) as usize * self.device.sm_count) as u32)
    }

    fn memset_zero(&self, dst: u64, bytes: usize) -> GpuResult<()> {
        self.device.context.bind_to_thread()?;
        // SAFETY: dst..dst+bytes lies in a live buffer of this engine, used on this stream.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> GpuResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.device.context.bind_to_thread()?;
        // SAFETY: both ranges lie in live buffers used on this stream.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Sets the u32 at `dst` (stream-ordered; a memset, so no host buffer is involved).
    fn set_u32(&self, dst: u64, value: u32) -> GpuResult<()> {
        self.device.context.bind_to_thread()?;
        // SAFETY: 4 live bytes of a buffer of this engine, used on this stream.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(dst, value, 1, self.stream.cu_stream()) }
            .result()?;
        Ok(())
    }

    /// Enqueues a write of one u64 (from pageable memory: the driver copies it before
    /// returning, so the source may go away).
    fn write_u64(&self, dst: u64, value: u64) -> GpuResult<()> {
        watch::check(DeviceOp::Upload)?;
        self.device.context.bind_to_thread()?;
        // SAFETY: dst is 8 live bytes of this engine's scalars; pageable source, see above.
        unsafe { result::memcpy_htod_async(dst, &[value], self.stream.cu_stream()) }?;
        Ok(())
    }

    /// A buffer for `capacity` pairs of this engine's kind.
    pub fn alloc_pairs(&self, capacity: usize) -> GpuResult<DevicePairs> {
        let capacity = capacity.max(1);
        Ok(DevicePairs {
            keys: self
                .device
                .pool
                .alloc(capacity * self.kind.key_bytes(), &self.stream)?,
            ids: self.device.pool.alloc(capacity * 8, &self.stream)?,
            capacity,
            kind: self.kind,
            positional: false,
            ids_below: u64::MAX,
        })
    }

    /// Copies `count` pairs from `src[from..]` to `dst[to..]`.
    pub fn copy_pairs(
        &self,
        src: &DevicePairs,
        from: usize,
        dst: &DevicePairs,
        to: usize,
        count: usize,
    ) -> GpuResult<()> {
        if from + count > src.capacity || to + count > dst.capacity {
            return Err(GpuError(format!(
                "pair copy out of bounds: {count} pairs from {from} of {} to {to} of {}",
                src.capacity, dst.capacity
            )));
        }
        self.copy_dtod(
            dst.key_at(to),
            src.key_at(from),
            count * self.kind.key_bytes(),
        )?;
        self.copy_dtod(dst.id_at(to), src.id_at(from), count * 8)
    }

    /// Uploads an image of `total` bytes, made of `parts` (offset, bytes) with undefined gaps,
    /// to device address `dst`, in chunks through the two pinned buffers in turn.
    fn upload_image(&mut self, parts: &[(usize, &[u8])], total: usize, dst: u64) -> GpuResult<()> {
        let mut start = 0;
        while start < total {
            let end = (start + UPLOAD_CHUNK).min(total);
            let slot = self.next_upload;
            self.next_upload ^= 1;
            let need = end - start;
            if self.upload[slot].as_ref().is_none_or(|l| l.len() < need) {
                // Dropping the old lease returns it; its event guards any copy in flight.
                self.upload[slot] = Some(self.device.pinned.take(need.max(1 << 20), true)?);
            }
            let lease = self.upload[slot].as_mut().expect("set above");
            let host = lease.as_mut_slice()?; // waits for this buffer's previous copy
            for &(offset, data) in parts {
                let a = start.max(offset);
                let b = end.min(offset + data.len());
                if a < b {
                    host[a - start..b - start].copy_from_slice(&data[a - offset..b - offset]);
                }
            }
            lease.upload(need, dst + start as u64, &self.stream)?;
            start = end;
        }
        Ok(())
    }

    /// Uploads host bytes to device address `dst` (asynchronously; the host data is copied
    /// into pinned memory before this returns).
    pub fn upload_bytes(&mut self, src: &[u8], dst: u64) -> GpuResult<()> {
        self.upload_image(&[(0, src)], src.len(), dst)
    }

    /// Stages host byte slices on the device, each at an aligned offset of one staging
    /// buffer, with as few copies as possible; returns their device addresses, valid until the
    /// next `stage` (stream order makes reuse safe: the next upload runs after the kernels
    /// that read this one).
    pub fn stage(&mut self, parts: &[&[u8]]) -> GpuResult<Vec<u64>> {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for part in parts {
            offsets.push(total);
            total += part.len().div_ceil(STAGE_ALIGN) * STAGE_ALIGN;
        }
        if self.staging.as_ref().is_none_or(|s| s.bytes() < total) {
            self.staging = Some(self.device.pool.alloc(total.max(1 << 20), &self.stream)?);
        }
        let base = self.staging.as_ref().expect("set above").ptr();
        let image: Vec<(usize, &[u8])> =
            offsets.iter().copied().zip(parts.iter().copied()).collect();
        self.upload_image(&image, total, base)?;
        Ok(offsets.iter().map(|&o| base + o as u64).collect())
    }

    /// Copies a staging image filled by [`fill_staging`] to the device (asynchronously) and
    /// returns its parts' device addresses, valid until the next stage. The image's pinned
    /// buffer must outlive the copy: keep it until the stream is synchronised (its event also
    /// makes host writes wait).
    pub fn upload_staged(&mut self, staged: &mut StagedHost) -> GpuResult<Vec<u64>> {
        if self
            .staging
            .as_ref()
            .is_none_or(|s| s.bytes() < staged.total)
        {
            self.staging = Some(
                self.device
                    .pool
                    .alloc(staged.total.max(1 << 20), &self.stream)?,
            );
        }
        let base = self.staging.as_ref().expect("set above").ptr();
        staged.lease.upload(staged.total, base, &self.stream)?;
        Ok(staged.offsets.iter().map(|&o| base + o as u64).collect())
    }

    /// Reads `len` bytes at device address `src` (waits for all work enqueued so far).
    pub fn read_bytes(&mut self, src: u64, len: usize) -> GpuResult<Vec<u8>> {
        if len == 0 {
            self.synchronize()?;
            return Ok(vec![]);
        }
        let stream = Arc::clone(&self.stream);
        self.read_bytes_on(&stream, src, len)
    }

    /// [`read_bytes`](Self::read_bytes) on the engine's side stream once `after` (an event of
    /// the engine's stream) has completed: what the engine's stream was given since then runs
    /// while the bytes come back and the host acts on them.
    pub fn read_bytes_after(
        &mut self,
        after: &cudarc::driver::CudaEvent,
        src: u64,
        len: usize,
    ) -> GpuResult<Vec<u8>> {
        let side = match &self.side_stream {
            Some(side) => Arc::clone(side),
            None => {
                let side = self.device.new_stream()?;
                self.side_stream = Some(Arc::clone(&side));
                side
            }
        };
        side.wait(after)?;
        self.read_bytes_on(&side, src, len)
    }

    /// `len` (> 0) bytes at `src` through the engine's pinned read-back buffer, copied on
    /// `stream`; waits for the copy.
    fn read_bytes_on(&mut self, stream: &CudaStream, src: u64, len: usize) -> GpuResult<Vec<u8>> {
        if self.readback.as_ref().is_none_or(|l| l.len() < len) {
            self.readback = Some(self.device.pinned.take(len.max(4096), false)?);
        }
        let lease = self.readback.as_mut().expect("set above");
        lease.download(src, len, stream)?;
        Ok(lease.as_slice()?[..len].to_vec())
    }

    fn read_u64(&mut self, src: u64) -> GpuResult<u64> {
        let bytes = self.read_bytes(src, 8)?;
        Ok(u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")))
    }

    /// Uploads host pairs: `keys` holds `ids.len()` keys in the device layout of this kind.
    pub fn upload_pairs(&mut self, keys: &[u8], ids: &[u64]) -> GpuResult<DevicePairs> {
        let n = ids.len();
        if keys.len() != n * self.kind.key_bytes() {
            return Err(GpuError(format!(
                "{} key bytes for {n} {:?} keys",
                keys.len(),
                self.kind
            )));
        }
        let pairs = self.alloc_pairs(n)?;
        self.upload_bytes(keys, pairs.key_at(0))?;
        let id_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        self.upload_bytes(&id_bytes, pairs.id_at(0))?;
        Ok(pairs)
    }

    /// The row ids of pairs `[0, count)`.
    pub fn download_ids(&mut self, pairs: &DevicePairs, count: usize) -> GpuResult<Vec<u64>> {
        let bytes = self.read_bytes(pairs.id_at(0), count * 8)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    /// The keys of pairs `[0, count)`, in the device layout.
    pub fn download_keys(&mut self, pairs: &DevicePairs, count: usize) -> GpuResult<Vec<u8>> {
        self.read_bytes(pairs.key_at(0), count * self.kind.key_bytes())
    }

    // ---- encode and append (encode.cu, candidates.cu) -------------------------------------

    /// ORs (or, with `ENCODE_FIRST`, writes) one column's field into `rows` keys at `out`.
    pub fn encode_column(&self, column: &EncodeColumn, out: u64) -> GpuResult<()> {
        if column.rows == 0 {
            return Ok(());
        }
        self.launch(
            &self.kernel("encode_column"),
            self.grid_for(column.rows, 4),
            THREADS,
            0,
            args![
                column.values,
                column.value_bit_offset,
                column.validity,
                column.validity_bit_offset,
                column.rows,
                column.native as u32,
                column.value_bits,
                column.shift,
                column.xor as u64,
                (column.xor >> 64) as u64,
                column.flags,
                out,
            ],
        )
    }

    /// Keeps a pseudo-random `fraction` of the n positional keys of `input` (by a hash of the
    /// row id, uncorrelated with the keys: a `WHERE` of that selectivity) as (key, row id)
    /// pairs in `out`, and returns how many (one read-back). The benchmarks' selectivity sweep
    /// and the cost model's calibration of a filter pass.
    pub fn filter_fraction(
        &mut self,
        input: &DevicePairs,
        n: usize,
        fraction: f64,
        out: &DevicePairs,
    ) -> GpuResult<usize> {
        let cut = super::measure::fraction_cut(fraction);
        let base = self.scalars.ptr();
        self.write_u64(base + COUNT_OFFSET, 0)?;
        let name = self.kernel("filter_fraction");
        self.launch(
            &name,
            self.resident_grid(&name, THREADS)?,
            THREADS,
            0,
            args![
                input.key_at(0),
                n,
                cut,
                out.key_at(0),
                out.id_at(0),
                base + COUNT_OFFSET,
                out.capacity()
            ],
        )?;
        let count = self.read_u64(base + COUNT_OFFSET)? as usize;
        if count > out.capacity() {
            return Err(GpuError(format!(
                "the fraction filter kept {count} pairs for a buffer of {}",
                out.capacity()
            )));
        }
        Ok(count)
    }

    /// Appends the `n` pairs (keys at `keys`, row ids at `ids` or `id_start + i` when `ids` is
    /// `None`) that beat the threshold to `candidates` at the device-side candidate count. The
    /// caller guarantees room for all n.
    pub fn append(
        &self,
        keys: u64,
        ids: Option<u64>,
        id_start: u64,
        n: usize,
        candidates: &DevicePairs,
    ) -> GpuResult<()> {
        if n == 0 {
            return Ok(());
        }
        let base = self.scalars.ptr();
        self.launch(
            &self.kernel("append"),
            self.grid_for(n, 4),
            THREADS,
            0,
            args![
                keys,
                ids.unwrap_or(0),
                id_start,
                n,
                base + THRESHOLD_OFFSET,
                candidates.key_at(0),
                candidates.id_at(0),
                base + COUNT_OFFSET,
                candidates.capacity(),
            ],
        )
    }

    /// Zeroes `bytes` bytes at device address `dst` (stream-ordered).
    pub fn zero(&self, dst: u64, bytes: usize) -> GpuResult<()> {
        self.memset_zero(dst, bytes)
    }

    /// Empties the candidate set: count 0, no threshold.
    pub fn reset_candidates(&self) -> GpuResult<()> {
        let base = self.scalars.ptr();
        self.memset_zero(base + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        self.memset_zero(base + COUNT_OFFSET, 8)
    }

    /// The device-side candidate count (waits for the work enqueued so far).
    pub fn candidate_count(&mut self) -> GpuResult<usize> {
        let base = self.scalars.ptr();
        Ok(self.read_u64(base + COUNT_OFFSET)? as usize)
    }

    /// The row id of the threshold pair, once a reduction set one (waits for enqueued work).
    pub fn threshold_row_id(&mut self) -> GpuResult<Option<u64>> {
        let bytes = self.read_bytes(self.scalars.ptr() + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        // `Threshold<K>`: the key, then the u64 id (8-aligned), then the u32 `valid` flag.
        let at = self.kind.key_bytes().max(8);
        let id = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let valid = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        Ok((valid != 0).then_some(id))
    }

    pub fn set_candidate_count(&self, count: usize) -> GpuResult<()> {
        self.write_u64(self.scalars.ptr() + COUNT_OFFSET, count as u64)
    }

    /// The min(n, k) smallest of pairs `[0, n)`, sorted, at the start of the returned buffer.
    pub fn select_sorted(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
    ) -> GpuResult<(DevicePairs, usize)> {
        let selection = self.enqueue_select(input, n, k, algorithm)?;
        self.finish(selection)
    }

    /// [`select_sorted`](Self::select_sorted) without waiting where the algorithm allows: a
    /// sampled selection of k ≤ the rank sort's capacity is enqueued whole (no host round trip
    /// inside it) and checked by [`finish`](Self::finish); every other selection is complete
    /// when this returns.
    pub fn enqueue_select<'a>(
        &mut self,
        input: &'a DevicePairs,
        n: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
    ) -> GpuResult<Selection<'a>> {
        let m = n.min(k);
        let ready = |pairs| Selection {
            input,
            n,
            k,
            state: SelectionState::Ready(pairs, m),
        };
        if m == 0 {
            return Ok(ready(self.alloc_pairs(1)?));
        }
        let id_bound = input.id_bound(n);
        let sorted = match algorithm {
            DeviceAlgorithm::Bitonic => self.bitonic_select(input, n, k)?,
            // Few pairs: the sampled selection's last step alone, one launch for all of them
            // (its levels and a radix fallback would take ~26 launches).
            DeviceAlgorithm::Sample if n <= RANK_SORT_MAX => self.rank_sort(input, n)?,
            // Positional pairs: only those in the bins up to the k-th smallest's, sorted by bin.
            DeviceAlgorithm::Sample if top_bits_sorts(self.kind, n, k, input.positional) => {
                let run = self.top_bits_enqueue(input, n, k)?;
                return Ok(Selection {
                    input,
                    n,
                    k,
                    state: SelectionState::TopBits(Box::new(run)),
                });
            }
            // A large fraction of positional pairs: all of them, by the key's radix passes.
            DeviceAlgorithm::Sample if sample_sorts_whole(self.kind, n, k, input.positional) => {
                self.sort_pairs(input, n, 1)?
            }
            DeviceAlgorithm::Sample => match self.sample_enqueue(input, n, k, None)? {
                Some(run) if run.sorted_small.is_some() => {
                    return Ok(Selection {
                        input,
                        n,
                        k,
                        state: SelectionState::Pending(Box::new(run)),
                    });
                }
                Some(run) => match self.sample_complete(run)? {
                    Some((sorted, _)) => sorted,
                    None => return self.enqueue_select(input, n, k, DeviceAlgorithm::Radix),
                },
                None => return self.enqueue_select(input, n, k, DeviceAlgorithm::Radix),
            },
            DeviceAlgorithm::Delegate => match self.delegate_select(input, n, k)? {
                Some(sorted) => sorted,
                None => return self.enqueue_select(input, n, k, DeviceAlgorithm::Sample),
            },
            DeviceAlgorithm::Radix if n > k => {
                let winners = self.radix_select(input, n, k, k)?;
                self.sort_pairs(&winners, k, id_bound)?
            }
            // All of them, sorted. Positional ids ascend in input order, and each LSD pass is
            // stable, so the key's digits alone leave ties in row id order (bound 1: no row
            // id digit; 4 passes instead of 7 for 32-bit keys and 2^20 rows).
            DeviceAlgorithm::Radix => {
                self.sort_pairs(input, n, if input.positional { 1 } else { id_bound })?
            }
        };
        Ok(ready(sorted))
    }

    /// Completes an [`enqueue_select`](Self::enqueue_select): a pending sampled selection reads
    /// its status back (one round trip) and, in the rare case where its estimate missed, the
    /// selection runs again by radix select.
    pub fn finish(&mut self, selection: Selection<'_>) -> GpuResult<(DevicePairs, usize)> {
        self.finish_reporting(selection)
            .map(|(sorted, m, _)| (sorted, m))
    }

    /// [`finish`](Self::finish), also saying whether device work ran after the read-back (a
    /// missed estimate, or survivors the rank sort did not take): benchmarks then count the
    /// round trip and that work in the selection's time.
    pub fn finish_reporting(
        &mut self,
        selection: Selection<'_>,
    ) -> GpuResult<(DevicePairs, usize, bool)> {
        let Selection { input, n, k, state } = selection;
        match state {
            SelectionState::Ready(pairs, m) => Ok((pairs, m, false)),
            SelectionState::Pending(run) => match self.sample_complete(*run)? {
                Some((sorted, more)) => Ok((sorted, n.min(k), more)),
                None => {
                    let (sorted, m) = self.select_sorted(input, n, k, DeviceAlgorithm::Radix)?;
                    Ok((sorted, m, true))
                }
            },
            SelectionState::TopBits(run) => match self.top_bits_complete(*run)? {
                Some((sorted, more)) => Ok((sorted, n.min(k), more)),
                // A cluster the sample foresaw crowding a bin, or more kept pairs than the
                // buffers: all pairs by the key's radix passes where those take one kernel a
                // pass (H100, n = 2^20, after a foreseen crowding, 81–119 µs for
                // 32-bit ties against 113–163 µs by the sampled levels), else radix select.
                None if radix_sort_is_wide(self.kind, n) => {
                    Ok((self.sort_pairs(input, n, 1)?, n.min(k), true))
                }
                None => {
                    let (sorted, m) = self.select_sorted(input, n, k, DeviceAlgorithm::Radix)?;
                    Ok((sorted, m, true))
                }
            },
        }
    }
}

/// A selection enqueued by [`TopKEngine::enqueue_select`]; [`TopKEngine::finish`] completes
/// it.
#[derive(Debug)]
pub struct Selection<'a> {
    input: &'a DevicePairs,
    n: usize,
    k: usize,
    state: SelectionState,
}

impl Selection<'_> {
    /// Whether [`TopKEngine::finish`] still has to read a status back (and may run more work).
    pub fn is_pending(&self) -> bool {
        matches!(
            self.state,
            SelectionState::Pending(_) | SelectionState::TopBits(_)
        )
    }
}

#[derive(Debug)]
enum SelectionState {
    Ready(DevicePairs, usize),
    Pending(Box<SampleRun>),
    TopBits(Box<TopBitsRun>),
}

/// A sampled selection enqueued on the device (`sample_enqueue`): its plan, its control block
/// (counts, status, rank-sort scratch) and its buffers, kept until it is read back.
#[derive(Debug)]
struct SampleRun {
    n: usize,
    k: usize,
    /// The input's bound on its row ids ([`DevicePairs::id_bound`]).
    id_bound: u64,
    plan: Vec<SampleLevel>,
    ctl: PooledBuffer,
    levels: Vec<DevicePairs>,
    /// The sorted survivors, when a sort that reads their count on the device took them (the
    /// rank sort for small k, the chunk rank sort for few survivors, else the merge sort).
    sorted_small: Option<SortedPairs>,
    /// `GPU_TOPK_TRACE`: each phase's device time (synchronising after each).
    phases: Vec<(String, f32)>,
    timer: Option<GpuTimer>,
}

impl SampleRun {
    fn lap(&mut self, name: String, stream: &Arc<CudaStream>) -> GpuResult<()> {
        if let Some(t) = self.timer.take() {
            self.phases.push((name, t.stop()?));
            self.timer = Some(GpuTimer::start(stream)?);
        }
        Ok(())
    }
}

impl Drop for TopKEngine {
    fn drop(&mut self) {
        // Buffers go back to the pool ordered by events; waiting here also keeps the pinned
        // buffers' copies from outliving a failed engine.
        let _ = self.stream.synchronize();
    }
}

/// See [`TopKEngine::bitonic_chunk`]; `max_shared` is the block's opt-in shared memory.
pub fn bitonic_chunk(max_shared: usize, kind: KeyKind) -> usize {
    let budget = max_shared.max(48 * 1024);
    let mut chunk = 256;
    while chunk * 2 * kind.pair_bytes() <= budget && chunk * 2 <= 16384 {
        chunk *= 2;
    }
    chunk
}

#[cfg(test)]
mod tests {
    use super::*;

    /// candidates.cu `key_span`'s words for keys given as little-endian words.
    fn span_of(kind: KeyKind, keys: &[Vec<u64>]) -> Vec<u64> {
        let n = kind.key_words();
        let mask = if kind == KeyKind::K32 {
            u32::MAX as u64
        } else {
            u64::MAX
        };
        let mut span = vec![0u64; 2 * n];
        for key in keys {
            for j in 0..n {
                span[j] |= !key[j] & mask;
                span[n + j] |= key[j];
            }
        }
        span
    }

    #[test]
    fn the_packed_field_spans_the_key_bits_that_vary_and_keeps_room_for_the_row_ids() {
        // One bit varies: bit 5.
        let span = span_of(KeyKind::K64, &[vec![0x10], vec![0x30], vec![0x30]]);
        assert_eq!(packed_field(KeyKind::K64, &span, 28), Some((5, 1)));
        // Bits 4 and 40 vary: the field runs from 4 up to 40, whatever lies between.
        let span = span_of(KeyKind::K64, &[vec![0x10], vec![1 << 40]]);
        assert_eq!(packed_field(KeyKind::K64, &span, 27), Some((4, 37)));
        assert_eq!(
            packed_field(KeyKind::K64, &span, 28),
            None,
            "37 + 28 bits > 64"
        );
        // All keys equal: an empty field, the row ids alone.
        let span = span_of(KeyKind::K32, &[vec![7], vec![7]]);
        assert_eq!(packed_field(KeyKind::K32, &span, 40), Some((0, 0)));
        // 32-bit keys: the complement's high word is not a varying bit.
        let span = span_of(KeyKind::K32, &[vec![0xffff_fff0], vec![0xffff_ffff]]);
        assert_eq!(packed_field(KeyKind::K32, &span, 30), Some((0, 4)));
        // 128-bit keys: a field across the two words (bits 60 to 67).
        let span = span_of(KeyKind::K128, &[vec![1 << 60, 5], vec![0, 5 | 8]]);
        assert_eq!(packed_field(KeyKind::K128, &span, 20), Some((60, 8)));
        // 256-bit keys: the top word's bits alone.
        let span = span_of(
            KeyKind::K256,
            &[vec![1, 2, 3, 1 << 63], vec![1, 2, 3, 1 << 62]],
        );
        assert_eq!(packed_field(KeyKind::K256, &span, 30), Some((254, 2)));
    }

    #[test]
    fn sample_plans_shrink_to_one_block_sort_or_stop_where_sampling_stops_paying() {
        let small = RANK_SORT_MAX;
        for kind in KeyKind::ALL {
            let s = sample_size(kind);
            for log_n in [14u32, 20, 24, 27, 29] {
                let n = 1usize << log_n;
                for k in [1usize, 8, 32, 256, 1024, 4096, 1 << 16, 1 << 20] {
                    let plan = plan_sample_levels(n, k, s, small);
                    let mut m = n;
                    for (i, level) in plan.iter().enumerate() {
                        assert!(
                            level.cap >= k && level.cap <= m,
                            "{kind:?} n={n} k={k} level {i}: {plan:?}"
                        );
                        assert!(
                            level.s <= s && level.s % 1024 == 0 || level.s == m,
                            "{kind:?} n={n} k={k} level {i}: {plan:?}"
                        );
                        // Only the last level samples fewer pairs than the most.
                        if i + 1 < plan.len() {
                            assert_eq!(level.s, s.min(m), "{kind:?} n={n} k={k}: {plan:?}");
                        }
                        m = level.cap;
                    }
                    if k <= 1024 && n >= 1 << 20 {
                        // Small k always reaches the rank sort (or an exact level).
                        assert!(!plan.is_empty(), "{kind:?} n={n} k={k}");
                        assert!(plan.len() <= 4, "{kind:?} n={n} k={k}: {plan:?}");
                    }
                    if n <= small || k >= n {
                        assert!(plan.is_empty());
                    }
                }
            }
        }
        // The first level of k = 1 over 2^29 32-bit keys keeps about 5 · 2^29 / 10240 pairs.
        let plan = plan_sample_levels(1 << 29, 1, sample_size(KeyKind::K32), 4096);
        let expected = 5 * (1usize << 29) / (10 << 10);
        assert!(
            plan[0].cap > expected && plan[0].cap < 8 * expected,
            "{plan:?}"
        );
        assert_eq!(plan[0].s, 10 << 10);
        // One level over 2^20 keys: k = 1 needs 3072 samples to leave ≤ 8192 survivors with
        // four standard deviations to spare, k = 1024 6144.
        let s = sample_size(KeyKind::K32);
        let one = plan_sample_levels(1 << 20, 1, s, 8192);
        assert_eq!(
            one.iter().map(|l| l.s).collect::<Vec<_>>(),
            [3072],
            "{one:?}"
        );
        let many = plan_sample_levels(1 << 20, 1024, s, 8192);
        assert_eq!(
            many.iter().map(|l| l.s).collect::<Vec<_>>(),
            [6144],
            "{many:?}"
        );
        // k = 4096: ~7800 survivors expected from 10240 samples, too close to 8192: an exact
        // second level keeps 4096.
        let close = plan_sample_levels(1 << 20, 4096, s, 8192);
        assert_eq!(close.len(), 2, "{close:?}");
        assert_eq!(close[1].s, s, "{close:?}");
        // The rank sort of 16384 pairs: one level each, smaller samples.
        for (k, want) in [(1, 2048), (1024, 3072), (4096, 5120)] {
            let plan = plan_sample_levels(1 << 20, k, s, 16384);
            assert_eq!(
                plan.iter().map(|l| l.s).collect::<Vec<_>>(),
                [want],
                "k={k}: {plan:?}"
            );
        }
        assert_eq!(sample_rank(10, 100, 100), 10);
        assert_eq!(sample_rank(0, 100, 1000), 3);
    }

    #[test]
    fn sampled_selections_sort_whole_only_positional_32_and_64_bit_inputs_of_wide_tiles_at_large_k()
    {
        let n = 1 << 20;
        assert!(sample_sorts_whole(KeyKind::K32, n, n / 16, true));
        assert!(sample_sorts_whole(KeyKind::K32, n, n, true));
        assert!(!sample_sorts_whole(KeyKind::K32, n, n / 16 - 1, true));
        assert!(sample_sorts_whole(KeyKind::K64, n, n / 8, true));
        assert!(!sample_sorts_whole(KeyKind::K64, n, n / 8 - 1, true));
        // Row ids that need digits, or keys wider than 64 bits: the sampled levels.
        assert!(!sample_sorts_whole(KeyKind::K32, n, n / 2, false));
        assert!(!sample_sorts_whole(KeyKind::K128, n, n / 2, true));
        // Only sizes of the wide passes: beyond them the passes take three launches each.
        let wide_max = ONESWEEP_WIDE_MAX_TILES * radix_sort_wide_tile(KeyKind::K32);
        let narrow_max = ONESWEEP_MAX_TILES * radix_sort_tile(KeyKind::K32);
        assert!(sample_sorts_whole(KeyKind::K32, wide_max, wide_max, true));
        assert!(!sample_sorts_whole(
            KeyKind::K32,
            wide_max + 1,
            wide_max,
            true
        ));
        assert!(!sample_sorts_whole(
            KeyKind::K32,
            narrow_max,
            narrow_max,
            true
        ));
    }

    #[test]
    fn delegate_subranges_follow_the_alpha_rule_within_bounds() {
        // √(n/k) rounded to a power of two, at least a warp, at most 4096, ≥ k subranges.
        assert_eq!(delegate_subrange(1 << 29, 1), Some(4096));
        assert_eq!(delegate_subrange(1 << 29, 1 << 10), Some(512));
        assert_eq!(delegate_subrange(1 << 29, 1 << 16), Some(64));
        assert_eq!(delegate_subrange(1 << 29, 1 << 20), Some(32));
        assert_eq!(delegate_subrange(1 << 20, 1 << 14), Some(32));
        assert_eq!(delegate_subrange(1000, 10), Some(32));
        assert_eq!(delegate_subrange(1000, 40), None);
        for (n, k) in [
            (1usize << 29, 3usize),
            (1 << 24, 100),
            (100_003, 777),
            (64, 2),
        ] {
            let s = delegate_subrange(n, k).unwrap();
            assert!(
                s.is_power_of_two() && (32..=4096).contains(&s),
                "{n} {k} {s}"
            );
            assert!(n.div_ceil(s) >= k, "{n} {k} {s}");
        }
    }
}
