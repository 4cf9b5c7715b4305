//! The host side of every kernel, on one stream: this is where the kernels of `kernels/` are
//! launched.
//!
//! A [`TopKEngine`] owns a stream and a few small device scalars (the radix control block, the
//! candidate count, the threshold) and works on [`DevicePairs`]: (composite key, row id) pairs
//! in two pooled device buffers, keys in the device layout of their [`KeyWidth`]. Everything it
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
//! - [`aggregate_top_k`](TopKEngine::aggregate_top_k): GROUP BY into a device hash table, then
//!   the k best groups by an aggregate through `select_sorted` (aggregate.cu);
//! - [`select_sorted`](TopKEngine::select_sorted): one of the selections, then sorted; or in
//!   two steps, [`enqueue_select`](TopKEngine::enqueue_select) (a small-k sampled selection is
//!   enqueued whole, no host round trip inside) and [`finish`](TopKEngine::finish) (reads its
//!   status back with the result).
//!
//! The engine's methods follow the stages: here its buffers, transfers, encoding and appends
//! and the entry points above; in `staging` the uploads; in `fused` the generated program's
//! passes; in `radix`, `bitonic` and `delegate` the exact selections; in `sample` SampleSelect's
//! device chain; in `top_bits` the top-bits selection; in `sort` the sorts; in `dispatch` the
//! routes; in `aggregate` the top-k over an aggregate. The device layouts' constants stay
//! here, the routes' tuning constants in `super::plan`.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, DriverError, result};

use super::kernels::{GENERATED_THREADS, GeneratedKernel, Kernels};
use super::memory::{PinnedLease, PooledBuffer};
use super::plan::*;
use super::timer::GpuTimer;
use super::watch::{self, DeviceOp};
use super::{GpuDevice, GpuError, GpuResult};

/// How encode.cu reads a column: a key type's native representation.
pub use super::plan::Native as NativeCode;

/// encode.cu flags.
pub(crate) const ENCODE_FIRST: u32 = 1;
pub(crate) const ENCODE_NULLABLE: u32 = 2;
pub(crate) const ENCODE_NULLS_FIRST: u32 = 4;

/// One column for [`TopKEngine::encode_column`]; pointers are device addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EncodeColumn {
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
    kind: KeyWidth,
    /// Row id i is i: passes that only filter may skip reading the ids.
    positional: bool,
    /// Every row id is below this (`u64::MAX`: unknown): the radix sorts skip the row id
    /// digits above it.
    ids_below: u64,
}

impl DevicePairs {
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Declares that row id i is i (e.g. ids uploaded as 0..n).
    pub fn set_positional(&mut self, positional: bool) {
        self.positional = positional;
    }

    /// Declares that every row id is below `bound`.
    pub(crate) fn set_ids_below(&mut self, bound: u64) {
        self.ids_below = bound;
    }

    /// A bound on the row ids of pairs `[0, n)`: n for positional pairs.
    pub(crate) fn id_bound(&self, n: usize) -> u64 {
        if self.positional {
            n as u64
        } else {
            self.ids_below
        }
    }

    pub fn kind(&self) -> KeyWidth {
        self.kind
    }

    /// Device address of key `i`.
    pub fn key_at(&self, i: usize) -> u64 {
        self.keys.ptr() + (i * self.kind.key_bytes()) as u64
    }

    /// Device address of row id `i`.
    pub(crate) fn id_at(&self, i: usize) -> u64 {
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
mod aggregate;
mod bitonic;
mod delegate;
mod dispatch;
mod fused;
mod groups;
mod parquet;
mod radix;
mod sample;
mod sort;
mod staging;
mod top_bits;

pub use aggregate::{
    AGG_FILTERED_ENTRY, AGG_HAVING_ENTRY, AGG_MAX_ACCUMULATORS, AGG_MAX_KEYS, AGG_MAX_VALUES,
    AggValue, AggregateCall, AggregateColumn, AggregateDecline, AggregateFilter, AggregateGroup,
    AggregateHaving, AggregateOp, AggregateOrder, AggregateReport, AggregateTopK, DeviceColumns,
    HavingColumn, HostColumn, RankBy, agg_slot_width, aggregate_top_k_host,
};
pub use fused::FusedReport;
pub use groups::{
    GROUP_SAMPLE, GatherColumn, GroupAlgorithm, GroupRanking, GroupSpec, KeptPiece, KeptRows,
};
pub use parquet::{EncodedChunk, EncodedColumn, EncodedPage};
use sample::SampleRun;
pub(crate) use staging::fill_staging;
use top_bits::TopBitsRun;

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
/// of them, far below what the one-block threshold holds). Its margin is 4× smaller relative
/// to k, which keeps a large k's candidates within the wave, past which the sort's time doubles;
/// where they fit without it, it is skipped, as it would only add its own sampling.
const FUSED_REFINE: usize = 16;
const SAMPLE_SCRATCH_BYTES: usize = SAMPLE_CTL_BYTES + 4 * RANK_SORT_MAX;
const SAMPLE_STATUS_FINAL_LARGE: u32 = 4;
/// Threads per block of the grid-stride kernels; of the bitonic top-k's blocks.
const THREADS: u32 = 256;
/// Bytes of each of [`TopKEngine::read_words`]'s two pinned buffers.
const READ_PIECE: usize = 16 << 20;
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
    kind: KeyWidth,
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
    pub fn new(device: &Arc<GpuDevice>, kind: KeyWidth) -> GpuResult<Self> {
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

    /// Gives back the staging and read-back buffers (pinned and device) a selection left,
    /// before the engine idles: they were the finished query's.
    pub(crate) fn release_staging(&mut self) {
        self.upload = [None, None];
        self.staging = None;
        self.readback = None;
    }

    pub fn kind(&self) -> KeyWidth {
        self.kind
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn device(&self) -> &Arc<GpuDevice> {
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

    /// Launches this kind's kernel `base` on [`THREADS`]-thread blocks, one resident wave.
    fn launch_resident(&self, base: &str, args: &[Arg]) -> GpuResult<()> {
        let name = self.kernel(base);
        self.launch(&name, self.resident_grid(&name, THREADS)?, THREADS, 0, args)
    }

    /// Launches `function` (`name` for errors). Where the device takes programmatic dependent
    /// launch ([`GpuDevice::programmatic_launch`]), with programmatic stream serialisation: the
    /// driver stages the launch while the previous kernel drains, and the kernel's first
    /// statement (common.cuh `grid_dependency_wait`) waits for that kernel's writes. A chain of
    /// dependent kernels then pays less of the gap each launch leaves between kernels
    /// (benches/micro/launch.cu, benches/PERFORMANCE.md).
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

    /// Sets `bytes` bytes at `dst` to 0xFF (stream-ordered).
    fn memset_ones(&self, dst: u64, bytes: usize) -> GpuResult<()> {
        self.device.context.bind_to_thread()?;
        // SAFETY: dst..dst+bytes lies in a live buffer of this engine, used on this stream.
        unsafe { result::memset_d8_async(dst, 0xFF, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Sets the 8-byte word at `dst + i · pitch` to all ones for each i below `count` (one
    /// column of a table of rows `pitch` bytes apart).
    fn memset_words_ones(&self, dst: u64, pitch: usize, count: usize) -> GpuResult<()> {
        if count == 0 {
            return Ok(());
        }
        self.device.context.bind_to_thread()?;
        // SAFETY: the `count` rows of `pitch` bytes from dst lie in a live buffer of this
        // engine, used on this stream; each row's first 8 bytes are set (two 32-bit words).
        unsafe {
            cudarc::driver::sys::cuMemsetD2D32Async(
                dst,
                pitch,
                u32::MAX,
                2,
                count,
                self.stream.cu_stream(),
            )
        }
        .result()?;
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
    pub(crate) fn copy_pairs(
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

    /// Reads `len` bytes at device address `src` (waits for all work enqueued so far).
    pub(crate) fn read_bytes(&mut self, src: u64, len: usize) -> GpuResult<Vec<u8>> {
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
    pub(crate) fn read_bytes_after(
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

    /// `count` u64 words at device address `src` (waits for all work enqueued so far), read
    /// back in pieces through two pinned buffers of [`READ_PIECE`] bytes: the host copies one
    /// piece into the result while the next one crosses PCIe. Large read-backs neither pin a
    /// buffer of their size (pinning costs more than the copy) nor copy twice.
    pub(crate) fn read_words(&mut self, src: u64, count: usize) -> GpuResult<Vec<u64>> {
        let len = 8 * count;
        if len <= READ_PIECE {
            let bytes = self.read_bytes(src, len)?;
            return Ok(bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect());
        }
        let stream = Arc::clone(&self.stream);
        let mut leases = [
            self.device.pinned.take(READ_PIECE, false)?,
            self.device.pinned.take(READ_PIECE, false)?,
        ];
        let piece = |p: usize| (p * READ_PIECE, READ_PIECE.min(len - p * READ_PIECE));
        let pieces = len.div_ceil(READ_PIECE);
        leases[0].download(src, piece(0).1, &stream)?;
        let mut words = Vec::with_capacity(count);
        for p in 0..pieces {
            if p + 1 < pieces {
                let (at, n) = piece(p + 1);
                leases[(p + 1) % 2].download(src + at as u64, n, &stream)?;
            }
            let bytes = &leases[p % 2].as_slice()?[..piece(p).1];
            words.extend(
                (bytes.chunks_exact(8)).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
            );
        }
        Ok(words)
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
        let id_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        self.upload_pair_bytes(keys, &id_bytes)
    }

    /// [`upload_pairs`](Self::upload_pairs) with the ids given as their little-endian bytes.
    pub fn upload_pair_bytes(&mut self, keys: &[u8], id_bytes: &[u8]) -> GpuResult<DevicePairs> {
        let n = id_bytes.len() / 8;
        if keys.len() != n * self.kind.key_bytes() || !id_bytes.len().is_multiple_of(8) {
            return Err(GpuError(format!(
                "{} key bytes and {} id bytes for {:?} keys",
                keys.len(),
                id_bytes.len(),
                self.kind
            )));
        }
        let pairs = self.alloc_pairs(n)?;
        self.upload_bytes(keys, pairs.key_at(0))?;
        self.upload_bytes(id_bytes, pairs.id_at(0))?;
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
    pub(crate) fn encode_column(&self, column: &EncodeColumn, out: u64) -> GpuResult<()> {
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
        self.launch_resident(
            "filter_fraction",
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
    pub(crate) fn append(
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
    pub(crate) fn zero(&self, dst: u64, bytes: usize) -> GpuResult<()> {
        self.memset_zero(dst, bytes)
    }

    /// Empties the candidate set: count 0, no threshold.
    pub(crate) fn reset_candidates(&self) -> GpuResult<()> {
        let base = self.scalars.ptr();
        self.memset_zero(base + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        self.memset_zero(base + COUNT_OFFSET, 8)
    }

    /// The device-side candidate count (waits for the work enqueued so far).
    pub(crate) fn candidate_count(&mut self) -> GpuResult<usize> {
        let base = self.scalars.ptr();
        Ok(self.read_u64(base + COUNT_OFFSET)? as usize)
    }

    /// The row id of the threshold pair, once a reduction set one (waits for enqueued work).
    pub(crate) fn threshold_row_id(&mut self) -> GpuResult<Option<u64>> {
        let bytes = self.read_bytes(self.scalars.ptr() + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        // `Threshold<K>`: the key, then the u64 id (8-aligned), then the u32 `valid` flag.
        let at = self.kind.key_bytes().max(8);
        let id = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let valid = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        Ok((valid != 0).then_some(id))
    }

    pub(crate) fn set_candidate_count(&self, count: usize) -> GpuResult<()> {
        self.write_u64(self.scalars.ptr() + COUNT_OFFSET, count as u64)
    }
}

impl Drop for TopKEngine {
    fn drop(&mut self) {
        // Buffers go back to the pool ordered by events; waiting here also keeps the pinned
        // buffers' copies from outliving a failed engine.
        let _ = self.stream.synchronize();
    }
}
