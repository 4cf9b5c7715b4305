//! The CUDA selector: the same selection as the CPU selector ([`super::cpu`]), on the device.
//!
//! Each `push` (from any partition's thread; device work is serialised by a mutex, on one
//! stream) copies the raw Arrow buffers of the key columns (values and validity bitmaps, no
//! host-side encoding) into pinned staging memory, uploads them asynchronously, encodes them on
//! the device into composite keys (encode.cu, bit for bit the keys module's encoding), and
//! appends (key, row id) to a device-resident candidate buffer, dropping rows that are not below
//! the current threshold. When the buffer could overflow, it is reduced on the device to the
//! best k (radix select or bitonic top-k), whose k-th pair becomes the new threshold. `push`
//! admits every row (the device decides later); `push_columns` instead hands the raw input
//! columns to the query's generated program ([`crate::fusion`]), which evaluates predicate and
//! keys and appends in one pass, and reads back which rows it appended; `finish` selects the final k, sorts them by
//! (key, row id) and copies their row ids back, in order.
//!
//! The Arrow buffers' way to the device is in `columns`; [`select_topk_device`] and
//! [`encode_keys_device`] (`entries`) are lower-level entries for tests and benchmarks:
//! selection of host-encoded keys, and the device encoding alone.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::array::{Array, ArrayData, ArrayRef, AsArray};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};

use super::{
    Admitted, ColumnsInput, FinalChoice, FusedAdmitted, RowIds, SelectInput, SelectionSpec,
    TopKSelector, TransferMetrics,
};
use crate::device::engine::{
    ENCODE_FIRST, ENCODE_NULLABLE, ENCODE_NULLS_FIRST, EncodeColumn, NativeCode, fill_staging,
};
use crate::device::plan::{self, reduction};
use crate::device::watch::{DeviceWatch, Entered};
use crate::device::{
    DeviceAlgorithm, DevicePairs, GeneratedKernel, GpuDevice, GpuError, GpuResult, KeyWidth,
    PooledBuffer, TopKEngine, contain_panics,
};
use crate::fusion::{FusedProgram, KernelInput};
use crate::keys::{EncodedKeys, KeyLayout, U256};

mod columns;
mod entries;

pub(super) use columns::{ColumnBuffers, exec_error, program_error};
use columns::{encode_batch, plan_columns};
pub use entries::{HostKeys, encode_keys_device, select_topk_device};

/// Candidates kept on the device before a reduction to k: at least this many pairs.
pub(crate) const MIN_CAPACITY: usize = 1 << 22;

/// The largest k the bitonic top-k takes for `layout` on `device`.
pub fn bitonic_max_k(device: &GpuDevice, layout: &KeyLayout) -> usize {
    plan::bitonic_max_k(device.max_shared_per_block, layout.width())
}

/// Builds the CUDA selector (compiles or loads the kernels on first use, which may fail: the
/// caller then falls back to the CPU selector).
pub(crate) fn new_cuda_selector(
    spec: &SelectionSpec,
    device: Arc<GpuDevice>,
    algorithm: DeviceAlgorithm,
) -> Result<Arc<dyn TopKSelector>> {
    new_cuda_selector_with_capacity(spec, device, algorithm, MIN_CAPACITY)
}

/// As [`new_cuda_selector`], keeping at least `min_capacity` candidates on the device before
/// reducing them to k (tests use small capacities to exercise reductions and growth).
pub fn new_cuda_selector_with_capacity(
    spec: &SelectionSpec,
    device: Arc<GpuDevice>,
    algorithm: DeviceAlgorithm,
    min_capacity: usize,
) -> Result<Arc<dyn TopKSelector>> {
    let kind = spec.layout.width();
    let _entered = spec.watch.as_ref().map(DeviceWatch::enter);
    // A device the choice does not fit (bitonic beyond its k) is the CPU path's, not an error.
    if algorithm == DeviceAlgorithm::Bitonic {
        plan::bitonic_takes(spec.k, device.max_shared_per_block, kind)
            .map_err(|why| gpu_error(GpuError(why)))?;
    }
    let engine = TopKEngine::new(&device, kind).map_err(gpu_error)?;
    let mut compile_time = std::time::Duration::ZERO;
    let program = match &spec.program {
        Some(program) if program.key_kind != kind => {
            return datafusion::common::internal_err!(
                "the generated program writes {:?} keys, the layout needs {kind:?}",
                program.key_kind
            );
        }
        Some(program) => {
            let (kernel, time) = device
                .generated_kernel(&program.source, crate::fusion::ENTRY)
                .map_err(gpu_error)?;
            compile_time = time;
            Some(FusedKernel {
                kernel,
                program: Arc::clone(program),
            })
        }
        None => None,
    };
    Ok(Arc::new(CudaSelector {
        device: Arc::clone(&device),
        program,
        compile_time,
        layout: spec.layout.clone(),
        k: spec.k,
        algorithm,
        final_choice: spec.final_choice.clone(),
        arch: device.arch(),
        min_capacity: min_capacity.max(1),
        watch: spec.watch.clone(),
        transfers: spec.transfers.clone(),
        threshold: AtomicU64::new(u64::MAX),
        state: Mutex::new(State {
            engine,
            candidates: None,
            capacity: 0,
            upper: 0,
            batch_keys: None,
            fused_out: None,
            threshold: None,
            failed: None,
        }),
    }))
}

pub(super) use crate::device::error::gpu_error;

/// A generated program and its loaded kernel.
struct FusedKernel {
    program: Arc<FusedProgram>,
    kernel: Arc<GeneratedKernel>,
}

/// See the module documentation.
pub(crate) struct CudaSelector {
    device: Arc<GpuDevice>,
    /// The generated program, when the device evaluates predicate and keys itself.
    program: Option<FusedKernel>,
    /// Time spent compiling or loading it when this selector was built.
    compile_time: std::time::Duration,
    layout: KeyLayout,
    k: usize,
    algorithm: DeviceAlgorithm,
    /// Picks the final selection's algorithm (`auto`); else `algorithm` runs it.
    final_choice: Option<Arc<dyn FinalChoice>>,
    arch: String,
    min_capacity: usize,
    /// The query's device accounting, entered around every call's device work.
    watch: Option<Arc<DeviceWatch>>,
    transfers: TransferMetrics,
    /// Row id of the device threshold read back after the last reduction (`u64::MAX`: none).
    threshold: AtomicU64,
    state: Mutex<State>,
}

struct State {
    engine: TopKEngine,
    /// The candidate buffer (allocated on the first push) and its capacity in pairs.
    candidates: Option<DevicePairs>,
    capacity: usize,
    /// An upper bound of the device-side candidate count (exact after a read-back).
    upper: usize,
    /// Encoded keys of the batch being pushed.
    batch_keys: Option<PooledBuffer>,
    /// What the generated kernel reports per push: rows passed, error flag, appended rows.
    fused_out: Option<PooledBuffer>,
    /// Row id of the threshold pair after the last reduction (read back: it waits anyway).
    threshold: Option<u64>,
    /// The first device error; later calls fail at once with it.
    failed: Option<GpuError>,
}

impl fmt::Debug for CudaSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaSelector")
            .field("k", &self.k)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

impl CudaSelector {
    fn enter(&self) -> Option<Entered> {
        self.watch.as_ref().map(DeviceWatch::enter)
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &state.failed {
            Some(e) => Err(gpu_error(e.clone())),
            None => Ok(state),
        }
    }
}

impl State {
    /// Runs device work; the first error poisons the selection.
    /// A panic in the CUDA bindings counts as a device error.
    fn run<T>(&mut self, work: impl FnOnce(&mut Self) -> GpuResult<T>) -> Result<T> {
        let result = contain_panics(|| work(self))
            .unwrap_or_else(|panic| Err(GpuError(format!("the CUDA bindings panicked: {panic}"))));
        result.map_err(|e| {
            self.failed = Some(e.clone());
            gpu_error(e)
        })
    }

    /// Makes room for `n` more candidates: reduce to k, or grow.
    fn ensure_room(
        &mut self,
        n: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
        min_capacity: usize,
    ) -> GpuResult<()> {
        if self.candidates.is_none() {
            let capacity = (2 * k).max(min_capacity).max(k + n);
            self.candidates = Some(self.engine.alloc_pairs(capacity)?);
            self.capacity = capacity;
            self.upper = 0;
            self.engine.reset_candidates()?;
        }
        if self.upper + n > self.capacity && self.upper > k {
            self.reduce(k, algorithm)?;
        }
        if self.upper + n > self.capacity {
            let capacity = (2 * self.capacity).max(self.upper + n + k);
            let count = self.engine.candidate_count()?;
            let grown = self.engine.alloc_pairs(capacity)?;
            let old = self.candidates.take().expect("allocated above");
            self.engine.copy_pairs(&old, 0, &grown, 0, count)?;
            self.candidates = Some(grown);
            self.capacity = capacity;
            self.upper = count;
        }
        Ok(())
    }

    /// Cuts the candidates to the best k on the device and sets the threshold to the k-th.
    fn reduce(&mut self, k: usize, algorithm: DeviceAlgorithm) -> GpuResult<()> {
        let count = self.engine.candidate_count()?;
        self.upper = count;
        if count <= k || k == 0 {
            return Ok(());
        }
        let candidates = self.candidates.take().expect("reduce needs candidates");
        let reduced = match reduction(algorithm) {
            DeviceAlgorithm::Radix | DeviceAlgorithm::Sample | DeviceAlgorithm::Delegate => {
                let winners = self
                    .engine
                    .radix_select(&candidates, count, k, self.capacity)?;
                self.engine.threshold_from_max(&winners, k)?;
                winners
            }
            DeviceAlgorithm::Bitonic => {
                let sorted = self.engine.bitonic_select(&candidates, count, k)?;
                self.engine.copy_pairs(&sorted, 0, &candidates, 0, k)?;
                self.engine.threshold_from_index(&sorted, k - 1)?;
                candidates
            }
        };
        self.candidates = Some(reduced);
        self.engine.set_candidate_count(k)?;
        self.upper = k;
        self.threshold = self.engine.threshold_row_id()?;
        Ok(())
    }
}

impl TopKSelector for CudaSelector {
    fn describe(&self) -> String {
        format!("cuda {} ({})", self.algorithm.name(), self.arch)
    }

    fn compile_time(&self) -> std::time::Duration {
        self.compile_time
    }

    fn push(&self, input: SelectInput<'_>) -> Result<Admitted> {
        let n = input.num_rows();
        if n == 0 || self.k == 0 {
            return Ok(Admitted::Indices(vec![]));
        }
        let columns = plan_columns(&self.layout, input.keys)?;
        let (k, algorithm, min_capacity) = (self.k, self.algorithm, self.min_capacity);
        let _entered = self.enter();
        let mut state = self.state()?;
        state.run(|state| {
            state.ensure_room(n, k, algorithm, min_capacity)?;
            let keys = encode_batch(
                &mut state.engine,
                &mut state.batch_keys,
                &columns,
                n,
                &input.row_ids,
            )?;
            let (ids, id_start) = match keys.ids {
                Some(ids) => (Some(ids), 0),
                None => match input.row_ids {
                    RowIds::Range(start) => (None, start),
                    RowIds::Explicit(_) => unreachable!("explicit ids are staged"),
                },
            };
            let candidates = state.candidates.as_ref().expect("ensure_room allocates");
            state
                .engine
                .append(keys.keys, ids, id_start, n, candidates)?;
            state.upper += n;
            Ok(())
        })?;
        if let Some(id) = state.threshold {
            self.threshold.store(id, Ordering::Relaxed);
        }
        Ok(Admitted::All)
    }

    fn push_columns(&self, input: ColumnsInput<'_>) -> Result<FusedAdmitted> {
        let Some(fused) = &self.program else {
            return datafusion::common::internal_err!("this CUDA selector has no program");
        };
        let len = |chunks: &Vec<ArrayRef>| chunks.iter().map(|c| c.len()).sum::<usize>();
        let inputs = &fused.program.inputs;
        // Rows: the length of the per-row inputs (a dictionary lookup has one per entry).
        let per_row = |(chunks, input): (&Vec<ArrayRef>, &KernelInput)| {
            (!input.per_dictionary_entry()).then(|| len(chunks))
        };
        let n = input
            .columns
            .iter()
            .zip(inputs)
            .find_map(per_row)
            .unwrap_or(0);
        if n == 0 || self.k == 0 {
            return Ok(FusedAdmitted {
                passed: 0,
                rows: vec![],
            });
        }
        if input.columns.len() != inputs.len()
            || input
                .columns
                .iter()
                .zip(inputs)
                .any(|c| per_row(c).is_some_and(|rows| rows != n))
        {
            return datafusion::common::internal_err!(
                "the generated program takes {} columns of equal length",
                inputs.len()
            );
        }
        let buffers = input
            .columns
            .iter()
            .map(|chunks| {
                let t = chunks.first().map_or(&DataType::Null, |c| c.data_type());
                let width = match t {
                    DataType::Boolean => None,
                    t => Some(t.primitive_width().ok_or_else(|| {
                        exec_error(format!("the generated program cannot read {t} columns"))
                    })?),
                };
                ColumnBuffers::of_chunks(chunks, width)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut parts = Vec::with_capacity(2 * buffers.len());
        for b in &buffers {
            b.parts(&mut parts);
        }
        let _entered = self.enter();
        // The host copy into pinned memory happens before taking the device lock, so the
        // partitions' copies run in parallel; the lock covers the upload and the kernels.
        let mut staged = fill_staging(&self.device, &parts).map_err(gpu_error)?;
        let (k, algorithm, min_capacity) = (self.k, self.algorithm, self.min_capacity);
        let mut state = self.state()?;
        let report = state.run(|state| {
            state.ensure_room(n, k, algorithm, min_capacity)?;
            let addresses = state.engine.upload_staged(&mut staged)?;
            let mut next = addresses.into_iter();
            let args: Vec<u64> = buffers
                .iter()
                .flat_map(|b| b.addresses(&mut next))
                .collect();
            let out_bytes = 16 + 4 * n.div_ceil(32);
            if state
                .fused_out
                .as_ref()
                .is_none_or(|b| b.bytes() < out_bytes)
            {
                let device = Arc::clone(state.engine.device());
                state.fused_out = Some(device.pool.alloc(out_bytes, state.engine.stream())?);
            }
            let out = state.fused_out.as_ref().expect("allocated above").ptr();
            state.engine.zero(out, 16)?;
            let candidates = state.candidates.as_ref().expect("ensure_room allocates");
            state
                .engine
                .fused_append(&fused.kernel, &args, n, input.first_id, candidates, out)?;
            let report = state.engine.read_bytes(out, out_bytes)?;
            let kept: usize = report[16..]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")).count_ones() as usize)
                .sum();
            state.upper += kept;
            Ok(report)
        })?;
        if let Some(id) = state.threshold {
            self.threshold.store(id, Ordering::Relaxed);
        }
        drop(state);
        let bytes: usize = parts.iter().flatten().map(|s| s.len()).sum();
        self.transfers.uploaded_bytes.add(bytes);
        let passed = u64::from_le_bytes(report[0..8].try_into().expect("8 bytes")) as usize;
        let error = u32::from_le_bytes(report[8..12].try_into().expect("4 bytes"));
        program_error(error)?;
        let mut rows = Vec::new();
        for (w, word) in report[16..].chunks_exact(4).enumerate() {
            let mut bits = u32::from_le_bytes(word.try_into().expect("4 bytes"));
            while bits != 0 {
                rows.push((w * 32) as u32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        Ok(FusedAdmitted { passed, rows })
    }

    fn preferred_push_rows(&self) -> usize {
        // Per-push staging, launches and the host wait dominate small batches.
        1 << 20
    }

    fn threshold_row_id(&self) -> Option<u64> {
        let id = self.threshold.load(Ordering::Relaxed);
        (id != u64::MAX).then_some(id)
    }

    fn live_row_ids(&self) -> Result<Option<Vec<u64>>> {
        Ok(None)
    }

    fn finish(&self) -> Result<Vec<u64>> {
        let (k, algorithm) = (self.k, self.algorithm);
        let _entered = self.enter();
        let mut state = self.state()?;
        state.run(|state| {
            let Some(candidates) = state.candidates.take() else {
                return Ok(vec![]);
            };
            let count = state.engine.candidate_count()?;
            let algorithm = match &self.final_choice {
                Some(choice) => choice.final_algorithm(count, k, state.engine.kind()),
                None => algorithm,
            };
            log::debug!("final selection of k = {k} among {count} candidates: {algorithm:?}");
            let (sorted, m) = state
                .engine
                .select_sorted(&candidates, count, k, algorithm)?;
            let ids = state.engine.download_ids(&sorted, m)?;
            state.engine.reset_candidates()?;
            state.upper = 0;
            state.capacity = 0;
            Ok(ids)
        })
    }
}
