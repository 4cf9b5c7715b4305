//! Pure planning of the device's work: key widths and the native value codes the kernels
//! read, the algorithms, their tuning constants and the functions that turn (n, k, key
//! width) into a route. No CUDA here: the
//! dispatcher ([`super::engine`]) and the cost model both call these, so each route is
//! written once.

use datafusion::arrow::datatypes::{DataType, TimeUnit};

/// The width of composite keys: the narrowest of four that holds a layout's bits (keys are
/// right-aligned, so a layout of ≤ 32 bits fits a `u32` on the device; the host holds it in a
/// `u64`, see [`KeyWidth::host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyWidth {
    W32,
    W64,
    W128,
    W256,
}

impl KeyWidth {
    pub const ALL: [KeyWidth; 4] = [KeyWidth::W32, KeyWidth::W64, KeyWidth::W128, KeyWidth::W256];

    /// The narrowest width holding `total_bits` (≤ 256) bits.
    pub fn for_total_bits(total_bits: u32) -> Self {
        match total_bits {
            0..=32 => KeyWidth::W32,
            33..=64 => KeyWidth::W64,
            65..=128 => KeyWidth::W128,
            _ => KeyWidth::W256,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            KeyWidth::W32 => 32,
            KeyWidth::W64 => 64,
            KeyWidth::W128 => 128,
            KeyWidth::W256 => 256,
        }
    }

    /// The host container's width: keys of up to 64 bits are held in a `u64`.
    pub fn host(self) -> Self {
        match self {
            KeyWidth::W32 => KeyWidth::W64,
            other => other,
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
            KeyWidth::W32 => "k32",
            KeyWidth::W64 => "k64",
            KeyWidth::W128 => "k128",
            KeyWidth::W256 => "k256",
        }
    }

    /// Bytes of one pair in shared memory (key, then row id).
    pub(crate) fn pair_bytes(self) -> usize {
        self.key_bytes() + 8
    }
}

/// How a key type's values are stored natively (one per supported type family). The device
/// encoder (encode.cu) reads columns by this code, so the discriminants are part of its ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Native {
    Bool = 0,
    U8 = 1,
    U16 = 2,
    U32 = 3,
    U64 = 4,
    I8 = 5,
    I16 = 6,
    I32 = 7,
    I64 = 8,
    I128 = 9,
    F16 = 10,
    F32 = 11,
    F64 = 12,
}

impl Native {
    /// The native representation of a key type, `None` when keys do not support it.
    pub(crate) fn for_data_type(data_type: &DataType) -> Option<Self> {
        native_kind(data_type)
    }

    /// Value bits.
    pub(crate) fn bits(self) -> u32 {
        match self {
            Self::Bool => 1,
            Self::U8 | Self::I8 => 8,
            Self::U16 | Self::I16 | Self::F16 => 16,
            Self::U32 | Self::I32 | Self::F32 => 32,
            Self::U64 | Self::I64 | Self::F64 => 64,
            Self::I128 => 128,
        }
    }

    /// Bytes per value, `None` for bit-packed booleans.
    pub(crate) fn byte_width(self) -> Option<usize> {
        (self != Self::Bool).then(|| self.bits() as usize / 8)
    }
}

/// The supported types; everything else (strings, binary, nested, dictionaries, `Decimal256`,
/// intervals, …) is `None`. Must agree with the dispatch in the keys module's `encode_values`.
fn native_kind(data_type: &DataType) -> Option<Native> {
    use DataType::*;
    Some(match data_type {
        Boolean => Native::Bool,
        UInt8 => Native::U8,
        UInt16 => Native::U16,
        UInt32 => Native::U32,
        UInt64 => Native::U64,
        Int8 => Native::I8,
        Int16 => Native::I16,
        Int32 | Date32 | Decimal32(..) => Native::I32,
        Time32(TimeUnit::Second | TimeUnit::Millisecond) => Native::I32,
        Int64 | Date64 | Timestamp(..) | Duration(_) | Decimal64(..) => Native::I64,
        Time64(TimeUnit::Microsecond | TimeUnit::Nanosecond) => Native::I64,
        Decimal128(..) => Native::I128,
        Float16 => Native::F16,
        Float32 => Native::F32,
        Float64 => Native::F64,
        _ => return None,
    })
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

/// Survivors of a sampled selection are sorted whole (rather than radix-selected first) up to
/// this many times k (or times `DIRECT_SORT_MIN`): the radix sort costs about as much as the
/// radix select's ~26 launches at a few times k.
pub(crate) const DIRECT_SORT_FACTOR: usize = 4;
pub(crate) const DIRECT_SORT_MIN: usize = 1 << 16;

/// The rank sort that ends a sampled selection (bitonic.cu `rank_sort`): up to this many
/// pairs, each ranked by a binary search in every sorted chunk of `RANK_THREADS`, in one
/// launch of (m / `RANK_THREADS`)² blocks (the unused ones return at once).
pub const RANK_SORT_MAX: usize = 16384;
/// Threads of the chunk rank sort's tile blocks (bitonic.cu `CHUNK_THREADS`).
pub(crate) const CHUNK_THREADS: u32 = 512;
/// The most tiles [`TopKEngine::chunk_rank_sort`] takes: its rank kernel's blocks, L2 traffic
/// and count matrix grow with their square.
pub(crate) const CHUNK_RANK_TILES: usize = 96;

/// Pairs per tile of the chunk rank sort (bitonic.cu `CHUNK_TILE`): half the sort tile.
pub(crate) fn chunk_tile(kind: KeyWidth) -> usize {
    sort_tile(kind) / 2
}

/// The most pairs the chunk rank sort takes (196608; 98304 for 256-bit keys).
pub(crate) fn chunk_rank_max(kind: KeyWidth) -> usize {
    CHUNK_RANK_TILES * chunk_tile(kind)
}
pub(crate) const RANK_THREADS: u32 = 256;

/// The radix sort's block size (radix_sort.cu `RSORT_THREADS`); it sorts fewer pairs than
/// this (its look-back words hold counts below 2^30).
pub(crate) const RSORT_THREADS: u32 = 256;
pub(crate) const RADIX_SORT_MAX: usize = 1 << 30;
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
pub(crate) const LOOKBACK_GROUP: usize = 16;

/// Pairs per tile of a radix sort pass (radix_sort.cu: `RSORT_THREADS` × `SortItems`).
pub fn radix_sort_tile(kind: KeyWidth) -> usize {
    let items = match kind {
        KeyWidth::W32 | KeyWidth::W64 => 8,
        KeyWidth::W128 => 4,
        KeyWidth::W256 => 2,
    };
    RSORT_THREADS as usize * items
}

/// Pairs per tile of a wide radix sort pass (radix_sort.cu `WideItems`): twice
/// [`radix_sort_tile`].
pub fn radix_sort_wide_tile(kind: KeyWidth) -> usize {
    2 * radix_sort_tile(kind)
}

/// The merge sort's block size (merge_sort.cu `MSORT_THREADS`). Its rounds are bound by a
/// thread's serial search and merge, so twice the threads with half the pairs each was slower.
pub(crate) const MSORT_THREADS: u32 = 256;
/// The merge sort (merge_sort.cu) takes up to this many pairs: the survivors of a sampled
/// selection beyond the chunk rank sort's capacity, a fused pass's candidates at large k, and
/// host-counted sorts that need more than a 32-bit key's digits.
pub(crate) const MERGE_SORT_MAX: usize = 1 << 22;

/// Pairs per tile of the merge sort (merge_sort.cu: `MSORT_THREADS` × `MergeItems`).
pub(crate) fn merge_sort_tile(kind: KeyWidth) -> usize {
    radix_sort_tile(kind)
}

/// Whether [`TopKEngine::sort_pairs`] takes the merge sort for m pairs whose ids are below
/// `id_bound` (1: they ascend in input order): beyond the chunk rank sort and up to
/// [`MERGE_SORT_MAX`], unless the key's radix passes alone sort them (`key_passes_sort`).
/// The cost model asks the same.
pub(crate) fn merge_sorts(kind: KeyWidth, m: usize, id_bound: u64) -> bool {
    m > chunk_rank_max(kind) && m <= MERGE_SORT_MAX && !(id_bound <= 1 && key_passes_sort(kind, m))
}

/// Whether the key's radix passes alone (row ids ascending in input order) sort m pairs
/// faster than the merge sort: always for 32-bit keys (4 passes); for 64-bit keys over wide
/// tiles, where the grouped look-back keeps each pass short and digit positions that every
/// pair shares are skipped (the passes lose only on keys that vary in all 8 bytes).
pub(crate) fn key_passes_sort(kind: KeyWidth, m: usize) -> bool {
    match kind {
        KeyWidth::W32 => true,
        KeyWidth::W64 => radix_sort_is_wide(kind, m),
        _ => false,
    }
}

/// Whether the radix sort of m pairs runs its passes over wide tiles (`rsort_pass_wide`, with
/// the grouped look-back): more than `ONESWEEP_MAX_TILES` tiles, at most
/// `ONESWEEP_WIDE_MAX_TILES` wide ones.
pub(crate) fn radix_sort_is_wide(kind: KeyWidth, m: usize) -> bool {
    m.div_ceil(radix_sort_tile(kind)) > ONESWEEP_MAX_TILES
        && m.div_ceil(radix_sort_wide_tile(kind)) <= ONESWEEP_WIDE_MAX_TILES
}

/// Whether a sampled selection of k among n positional pairs sorts all n instead: where the
/// key's radix passes sort them (32- or 64-bit keys, row ids ascending in input order) over
/// wide tiles with the grouped look-back, and k is at least n / [`whole_sort_fraction`].
/// The cost model asks the same.
pub(crate) fn sample_sorts_whole(kind: KeyWidth, n: usize, k: usize, positional: bool) -> bool {
    positional
        && whole_sort_fraction(kind).is_some_and(|f| k.saturating_mul(f) >= n)
        && radix_sort_is_wide(kind, n)
}

/// k / n from which [`sample_sorts_whole`] holds. The whole sort costs the same whatever k,
/// while the sampled levels pay for sorting their survivors (chunk rank or merge sort), which
/// grow with k: 32-bit keys (four passes) break even near n / 16, where the whole sort already
/// wins on ties and narrow ranges; 64-bit keys (up to eight passes) near n / 8.
pub(crate) fn whole_sort_fraction(kind: KeyWidth) -> Option<usize> {
    match kind {
        KeyWidth::W32 => Some(16),
        KeyWidth::W64 => Some(8),
        _ => None,
    }
}

/// Threads of the sort kernels' blocks (bitonic.cu `SORT_THREADS`).
pub(crate) const SORT_THREADS: u32 = 1024;

/// The tile of the sort kernels (bitonic.cu `SORT_TILE`): 1024 threads holding 4 pairs each in
/// registers (2 for 256-bit keys), rather than larger chunks sorted by one block in shared
/// memory, which is far slower.
pub(crate) fn sort_tile(kind: KeyWidth) -> usize {
    if kind == KeyWidth::W256 { 2048 } else { 4096 }
}

/// Pairs in one level's sample: as many as one block holds in registers (sample.cu
/// `SamplePer` × 1024 threads).
pub(crate) fn sample_size(kind: KeyWidth) -> usize {
    match kind {
        KeyWidth::W32 => 10 << 10,
        KeyWidth::W64 => 8 << 10,
        KeyWidth::W128 => 4 << 10,
        KeyWidth::W256 => 2 << 10,
    }
}

/// The sample rank of a level's threshold (sample.cu computes the same on the device, from
/// the actual count): five standard deviations above the k-th pair's expected rank.
pub(crate) fn sample_rank(k: usize, s: usize, m: usize) -> usize {
    if s >= m {
        return k;
    }
    let e = k as f64 * s as f64 / m as f64;
    (e + 5.0 * e.sqrt() + 3.0).ceil() as usize
}

/// One level of a sampled selection: the capacity of its survivor buffer and the pairs its
/// threshold samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SampleLevel {
    pub cap: usize,
    pub s: usize,
}

/// A level's expected survivors and its buffer capacity (the expected count plus six of its
/// standard deviations), for a sample of s among m; `None` when the sample rank reaches s.
pub(crate) fn sample_level_bounds(m: usize, k: usize, s: usize) -> Option<(usize, usize)> {
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
/// margin: the one-block threshold costs in proportion to its sample, while a few more
/// survivors cost the rank sort little. An exact level (the sample is the whole level) records
/// `s_max`, so that the device takes all of an actual count that came out above the plan.
/// Empty: sampling cannot shrink this input.
pub(crate) fn plan_sample_levels(
    n: usize,
    k: usize,
    s_max: usize,
    small: usize,
) -> Vec<SampleLevel> {
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
pub(crate) fn delegate_subrange(n: usize, k: usize) -> Option<usize> {
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
pub(crate) fn id_bits(bound: u64) -> u32 {
    64 - bound.saturating_sub(1).leading_zeros()
}

pub(crate) fn prev_power_of_two(x: usize) -> usize {
    1usize << (usize::BITS - 1 - x.max(1).leading_zeros())
}

/// The most levels a sampled selection plans (sample counts live in `SAMPLE_CTL_BYTES`).
pub(crate) const SAMPLE_MAX_LEVELS: usize = 8;

/// Rows the fused selection's sample pass evaluates
/// ([`fused_select`](super::TopKEngine::fused_select)), at most: as many as sample.cu's
/// one-block threshold holds for 64-bit keys ([`sample_size`]; wider keys sample fewer), so that
/// the threshold is exact and costs one launch. 8192 balances the sample's own selection, which
/// grows with its rows, against the final one, which grows with what a coarser sample admits.
pub const FUSED_SAMPLE_ROWS: usize = RANK_SORT_MAX / 2;

/// Consecutive rows the fused selection's samples take at a time (fused.cuh `sample_row`: a
/// sample of one row in `step` takes this many consecutive rows every `this · step` rows), so
/// that a warp's loads take whole sectors rather than a sector per row (runs of 8 rows do as
/// well as 32).
pub const FUSED_SAMPLE_CLUSTER: usize = 32;

/// Whether a sampled selection of k among (at most) n pairs of `kind` is enqueued whole, its
/// survivors sorted on the device's count (no read-back before its end): its levels end in
/// the rank sort, or in a merge sort of at most [`MERGE_SORT_MAX`] pairs.
pub(crate) fn sample_sorts_on_device(kind: KeyWidth, n: usize, k: usize) -> bool {
    plan_sample_levels(n, k, sample_size(kind), RANK_SORT_MAX)
        .last()
        .is_some_and(|last| k <= RANK_SORT_MAX || last.cap <= MERGE_SORT_MAX)
}

/// Whether a fused selection (`TopKEngine::fused_select`) with `algorithm` sorts its
/// candidates whole, keys packed for a merge sort whose tiles overlap the count's read-back:
/// the sampled selection of a k beyond the rank sort, with at most one merge sort's worth of
/// candidates.
pub(crate) fn fused_sorts_whole(algorithm: DeviceAlgorithm, k: usize, candidates: usize) -> bool {
    algorithm == DeviceAlgorithm::Sample && k > RANK_SORT_MAX && candidates <= MERGE_SORT_MAX
}

/// Whether a fused selection refines its sampled threshold with a denser sample (one row in
/// `dense_step`): the sampled selection of a k beyond the rank sort, where the rows expected
/// below the first threshold might not fit what one wave of the packed sort takes
/// (`refine_above`).
pub(crate) fn fused_refines(
    algorithm: DeviceAlgorithm,
    k: usize,
    dense_step: usize,
    expected_rows: f64,
    refine_above: usize,
) -> bool {
    algorithm == DeviceAlgorithm::Sample
        && k > RANK_SORT_MAX
        && dense_step >= 8
        && expected_rows > refine_above as f64
}

/// The largest k the bitonic top-k takes for keys of `kind`: a quarter of its chunk, so that
/// each round cuts the data at least fourfold; `max_shared` is the block's opt-in shared memory.
pub fn bitonic_max_k(max_shared: usize, kind: KeyWidth) -> usize {
    bitonic_chunk(max_shared, kind) / 4
}

/// Whether the bitonic top-k takes `k` for keys of `kind` ([`bitonic_max_k`]), and if not,
/// why: the one message the planner and the device give.
pub fn bitonic_takes(k: usize, max_shared: usize, kind: KeyWidth) -> Result<(), String> {
    let limit = bitonic_max_k(max_shared, kind);
    if k <= limit {
        Ok(())
    } else {
        Err(format!(
            "the CUDA bitonic top-k supports k up to {limit} for these keys, not {k}"
        ))
    }
}

/// See [`bitonic_chunk`](super::TopKEngine::bitonic_chunk); `max_shared` is the block's opt-in shared memory.
pub fn bitonic_chunk(max_shared: usize, kind: KeyWidth) -> usize {
    let budget = max_shared.max(48 * 1024);
    let mut chunk = 256;
    while chunk * 2 * kind.pair_bytes() <= budget && chunk * 2 <= 16384 {
        chunk *= 2;
    }
    chunk
}

/// The buffer of kept pairs for a top-bits selection of k among n: uniform keys keep k plus
/// one bin (a few hundred pairs at n = 2^20); this leaves half of k and n / 256 more for
/// keys that crowd their bins.
pub(crate) fn top_bits_capacity(n: usize, k: usize) -> usize {
    (k + k / 2 + n / 256).min(n)
}

/// Whether a sampled selection of k among n pairs takes the top-bits selection: positional
/// 32- and 64-bit keys (the scatter writes positions as row ids) of the sizes whose whole sort
/// runs one kernel a pass (up to ~1.5M rows), for k from n / 256 up to n / 4 (32-bit keys) or
/// below 3n / 4 (64-bit keys): under n / 256 the sampled levels' few survivors cost less; past
/// the upper bound the whole sort, whose cost does not grow with k, wins (sooner for 32-bit keys'
/// four passes than for 64-bit keys' eight; `benches/PERFORMANCE.md`). `forced` (an A/B switch,
/// [`super::DeviceOptions`]) takes it wherever it applies, or never.
pub fn top_bits_sorts(
    kind: KeyWidth,
    n: usize,
    k: usize,
    positional: bool,
    forced: Option<bool>,
) -> bool {
    // Its buffers (at most n pairs) then fit the merge sort of its crowded route.
    // Positions below 2^21: 32-bit keys' coordinates then always hold them (common.cuh
    // `TopBins`: (word − w0) · n + position below 2^63).
    let applies = positional
        && k > 0
        && n < 1 << 21
        && matches!(kind, KeyWidth::W32 | KeyWidth::W64)
        && radix_sort_is_wide(kind, n);
    match forced {
        Some(forced) => forced && applies,
        None => {
            let below = match kind {
                KeyWidth::W32 => k.saturating_mul(4) <= n,
                _ => k.saturating_mul(4) < n.saturating_mul(3),
            };
            applies && k.saturating_mul(256) >= n && below
        }
    }
}

/// The field of key bits that vary among a selection's candidates, `(lo, width)`, from
/// candidates.cu `key_span`'s words (per key word, the OR of the complemented keys, then per
/// key word the OR of the keys): bits lo up to the highest that varies. `None` when it and
/// `id_bits` bits of row id do not fit one 64-bit word.
pub(crate) fn packed_field(kind: KeyWidth, span: &[u64], id_bits: u32) -> Option<(u32, u32)> {
    let words = kind.key_words();
    let word_bits = (8 * kind.key_bytes() / words) as u32;
    let mask = if word_bits == 64 {
        u64::MAX
    } else {
        (1 << word_bits) - 1
    };
    let (mut lo, mut hi) = (None, 0);
    for j in 0..words {
        // Bits set in some key (OR) but not in all (AND = the complement of the first OR).
        let varies = (span[words + j] ^ !span[j]) & mask;
        if varies != 0 {
            let at = j as u32 * word_bits;
            lo.get_or_insert(at + varies.trailing_zeros());
            hi = at + 64 - varies.leading_zeros();
        }
    }
    let lo = lo.unwrap_or(0);
    let width = hi.saturating_sub(lo);
    (width + id_bits <= 64).then_some((lo, width))
}

/// The route a device algorithm takes to select k among n pairs: the one place both the
/// dispatcher ([`super::engine`]) and the cost model read it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Nothing to select (k = 0 or no pairs).
    Empty,
    /// Bitonic top-k in shared memory (k up to [`bitonic_chunk`] / 4).
    Bitonic,
    /// Radix select of exactly k pairs, then their sort.
    RadixSelect,
    /// Every pair sorted (k ≥ n): the radix or merge sort of [`merge_sorts`].
    SortAll,
    /// Few pairs (≤ [`RANK_SORT_MAX`]): the rank sort alone, one launch.
    RankSort,
    /// Positional pairs at moderate k: the top-bits selection ([`top_bits_sorts`]).
    TopBits,
    /// A large fraction of positional pairs: all of them by the key's radix passes
    /// ([`sample_sorts_whole`]).
    WholeSort,
    /// SampleSelect's levels ([`plan_sample_levels`]), then the survivors' sort.
    SampleLevels,
    /// Dr. Top-k's delegates over subranges of this many pairs ([`delegate_subrange`]).
    Delegate(usize),
}

/// The route of `algorithm` for k among n pairs of `width` (`positional`: row id i is i).
/// An algorithm that cannot shrink this input takes the next one's route: the delegates
/// without k subranges the sampled selection's, a sampled selection without levels radix
/// select's. `top_bits` forces the top-bits selection on or off (an A/B switch).
pub(crate) fn route(
    algorithm: DeviceAlgorithm,
    width: KeyWidth,
    n: usize,
    k: usize,
    positional: bool,
    top_bits: Option<bool>,
) -> Route {
    if n.min(k) == 0 {
        return Route::Empty;
    }
    match algorithm {
        DeviceAlgorithm::Bitonic => Route::Bitonic,
        DeviceAlgorithm::Sample if n <= RANK_SORT_MAX => Route::RankSort,
        DeviceAlgorithm::Sample if top_bits_sorts(width, n, k, positional, top_bits) => {
            Route::TopBits
        }
        DeviceAlgorithm::Sample if sample_sorts_whole(width, n, k, positional) => Route::WholeSort,
        DeviceAlgorithm::Sample => {
            if plan_sample_levels(n, k, sample_size(width), RANK_SORT_MAX).is_empty() {
                route(DeviceAlgorithm::Radix, width, n, k, positional, top_bits)
            } else {
                Route::SampleLevels
            }
        }
        DeviceAlgorithm::Delegate => match delegate_subrange(n, k) {
            Some(s) => Route::Delegate(s),
            None => route(DeviceAlgorithm::Sample, width, n, k, positional, top_bits),
        },
        DeviceAlgorithm::Radix if n > k => Route::RadixSelect,
        DeviceAlgorithm::Radix => Route::SortAll,
    }
}

/// The algorithm that cuts a streaming selection's candidate buffer back to k when it fills:
/// the bitonic top-k where that is the selection's algorithm (its k fits), else radix select
/// (the buffer holds only pairs the threshold let through, so sampling it gains little).
pub(crate) fn reduction(algorithm: DeviceAlgorithm) -> DeviceAlgorithm {
    match algorithm {
        DeviceAlgorithm::Bitonic => DeviceAlgorithm::Bitonic,
        _ => DeviceAlgorithm::Radix,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// candidates.cu `key_span`'s words for keys given as little-endian words.
    fn span_of(kind: KeyWidth, keys: &[Vec<u64>]) -> Vec<u64> {
        let n = kind.key_words();
        let mask = if kind == KeyWidth::W32 {
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
        let span = span_of(KeyWidth::W64, &[vec![0x10], vec![0x30], vec![0x30]]);
        assert_eq!(packed_field(KeyWidth::W64, &span, 28), Some((5, 1)));
        // Bits 4 and 40 vary: the field runs from 4 up to 40, whatever lies between.
        let span = span_of(KeyWidth::W64, &[vec![0x10], vec![1 << 40]]);
        assert_eq!(packed_field(KeyWidth::W64, &span, 27), Some((4, 37)));
        assert_eq!(
            packed_field(KeyWidth::W64, &span, 28),
            None,
            "37 + 28 bits > 64"
        );
        // All keys equal: an empty field, the row ids alone.
        let span = span_of(KeyWidth::W32, &[vec![7], vec![7]]);
        assert_eq!(packed_field(KeyWidth::W32, &span, 40), Some((0, 0)));
        // 32-bit keys: the complement's high word is not a varying bit.
        let span = span_of(KeyWidth::W32, &[vec![0xffff_fff0], vec![0xffff_ffff]]);
        assert_eq!(packed_field(KeyWidth::W32, &span, 30), Some((0, 4)));
        // 128-bit keys: a field across the two words (bits 60 to 67).
        let span = span_of(KeyWidth::W128, &[vec![1 << 60, 5], vec![0, 5 | 8]]);
        assert_eq!(packed_field(KeyWidth::W128, &span, 20), Some((60, 8)));
        // 256-bit keys: the top word's bits alone.
        let span = span_of(
            KeyWidth::W256,
            &[vec![1, 2, 3, 1 << 63], vec![1, 2, 3, 1 << 62]],
        );
        assert_eq!(packed_field(KeyWidth::W256, &span, 30), Some((254, 2)));
    }

    #[test]
    fn sample_plans_shrink_to_one_block_sort_or_stop_where_sampling_stops_paying() {
        let small = RANK_SORT_MAX;
        for kind in KeyWidth::ALL {
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
        let plan = plan_sample_levels(1 << 29, 1, sample_size(KeyWidth::W32), 4096);
        let expected = 5 * (1usize << 29) / (10 << 10);
        assert!(
            plan[0].cap > expected && plan[0].cap < 8 * expected,
            "{plan:?}"
        );
        assert_eq!(plan[0].s, 10 << 10);
        // One level over 2^20 keys: k = 1 needs 3072 samples to leave ≤ 8192 survivors with
        // four standard deviations to spare, k = 1024 6144.
        let s = sample_size(KeyWidth::W32);
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
        assert!(sample_sorts_whole(KeyWidth::W32, n, n / 16, true));
        assert!(sample_sorts_whole(KeyWidth::W32, n, n, true));
        assert!(!sample_sorts_whole(KeyWidth::W32, n, n / 16 - 1, true));
        assert!(sample_sorts_whole(KeyWidth::W64, n, n / 8, true));
        assert!(!sample_sorts_whole(KeyWidth::W64, n, n / 8 - 1, true));
        // Row ids that need digits, or keys wider than 64 bits: the sampled levels.
        assert!(!sample_sorts_whole(KeyWidth::W32, n, n / 2, false));
        assert!(!sample_sorts_whole(KeyWidth::W128, n, n / 2, true));
        // Only sizes of the wide passes: beyond them the passes take three launches each.
        let wide_max = ONESWEEP_WIDE_MAX_TILES * radix_sort_wide_tile(KeyWidth::W32);
        let narrow_max = ONESWEEP_MAX_TILES * radix_sort_tile(KeyWidth::W32);
        assert!(sample_sorts_whole(KeyWidth::W32, wide_max, wide_max, true));
        assert!(!sample_sorts_whole(
            KeyWidth::W32,
            wide_max + 1,
            wide_max,
            true
        ));
        assert!(!sample_sorts_whole(
            KeyWidth::W32,
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
