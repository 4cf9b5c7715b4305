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
//! [`select_topk_device`] and [`encode_keys_device`] are lower-level entries for tests and
//! benchmarks: selection of host-encoded keys, and the device encoding alone.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::array::{Array, ArrayData, ArrayRef, AsArray};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};

use super::{
    Admitted, ColumnsInput, DEVICE_ERROR_TAG, FinalChoice, FusedAdmitted, RowIds, SelectInput,
    SelectionSpec, TopKSelector, TransferMetrics,
};
use crate::device::engine::{
    ENCODE_FIRST, ENCODE_NULLABLE, ENCODE_NULLS_FIRST, EncodeColumn, NativeCode, fill_staging,
};
use crate::device::plan::{bitonic_chunk, reduction};
use crate::device::watch::{DeviceWatch, Entered};
use crate::device::{
    DeviceAlgorithm, DevicePairs, GeneratedKernel, GpuDevice, GpuError, GpuResult, KeyWidth,
    PooledBuffer, TopKEngine, contain_panics,
};
use crate::fusion::{FusedProgram, KernelInput};
use crate::keys::{EncodedKeys, KeyLayout, U256};

/// Candidates kept on the device before a reduction to k: at least this many pairs.
pub(crate) const MIN_CAPACITY: usize = 1 << 22;

/// The largest k the bitonic top-k takes for `layout` on `device`.
pub fn bitonic_max_k(device: &GpuDevice, layout: &KeyLayout) -> usize {
    bitonic_chunk(device.max_shared_per_block, layout.width()) / 4
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
    let limit = bitonic_max_k(&device, &spec.layout);
    if algorithm == DeviceAlgorithm::Bitonic && spec.k > limit {
        return Err(gpu_error(GpuError(format!(
            "the CUDA bitonic top-k supports k up to {limit} for these keys, not {}",
            spec.k
        ))));
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

/// A device fault, tagged so the operator falls back to the CPU path.
pub(super) fn gpu_error(e: GpuError) -> DataFusionError {
    DataFusionError::External(Box::new(GpuError(format!(
        "{DEVICE_ERROR_TAG} CUDA top-k selection failed: {e}"
    ))))
}

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

// ---- Arrow columns → device -----------------------------------------------------------------

/// The raw Arrow buffers of one column, as the kernels read them.
pub(super) struct ColumnBuffers {
    /// The values: one slice, or the slices of several chunks staged back to back.
    values: Vec<(Buffer, std::ops::Range<usize>)>,
    /// Bit offset of the first value (bit-packed booleans).
    value_bit_offset: u64,
    /// Validity bytes, their range and bit offset, when the column holds NULLs.
    validity: Option<(Buffer, std::ops::Range<usize>, u64)>,
}

impl ColumnBuffers {
    /// `byte_width` is the value width, `None` for bit-packed booleans.
    pub(super) fn of(column: &dyn Array, byte_width: Option<usize>) -> Result<Self> {
        let n = column.len();
        let (values, values_range, value_bit_offset) = match byte_width {
            None => {
                let bits = column
                    .as_boolean_opt()
                    .ok_or_else(|| {
                        exec_error(format!(
                            "expected a boolean column, got {}",
                            column.data_type()
                        ))
                    })?
                    .values();
                let offset = bits.offset();
                (
                    bits.inner().clone(),
                    offset / 8..(offset + n).div_ceil(8),
                    (offset % 8) as u64,
                )
            }
            Some(width) => {
                let data: ArrayData = column.to_data();
                let offset = data.offset();
                let buffer = data.buffers().first().cloned().ok_or_else(|| {
                    exec_error(format!("a {} column without values", column.data_type()))
                })?;
                let range = offset * width..(offset + n) * width;
                if buffer.len() < range.end {
                    return Err(exec_error(format!(
                        "a {} column's buffer is shorter than its rows",
                        column.data_type()
                    )));
                }
                (buffer, range, 0)
            }
        };
        let validity = column
            .logical_nulls()
            .filter(|nulls| nulls.null_count() > 0)
            .map(|nulls| {
                let bits = nulls.inner();
                let offset = bits.offset();
                (
                    bits.inner().clone(),
                    offset / 8..(offset + n).div_ceil(8),
                    (offset % 8) as u64,
                )
            });
        Ok(Self {
            values: vec![(values, values_range)],
            value_bit_offset,
            validity,
        })
    }

    /// One column given as consecutive chunks. Fixed-width chunks without NULLs are staged
    /// back to back straight from their buffers; others are concatenated first.
    fn of_chunks(chunks: &[ArrayRef], byte_width: Option<usize>) -> Result<Self> {
        let plain = byte_width.is_some()
            && chunks
                .iter()
                .all(|c| c.logical_nulls().is_none_or(|n| n.null_count() == 0));
        match chunks {
            [one] => Self::of(one.as_ref(), byte_width),
            _ if plain => {
                let mut values = Vec::with_capacity(chunks.len());
                for chunk in chunks {
                    values.extend(Self::of(chunk.as_ref(), byte_width)?.values);
                }
                Ok(Self {
                    values,
                    value_bit_offset: 0,
                    validity: None,
                })
            }
            _ => {
                let parts: Vec<&dyn Array> = chunks.iter().map(|c| c.as_ref()).collect();
                let whole = datafusion::arrow::compute::concat(&parts)?;
                Self::of(whole.as_ref(), byte_width)
            }
        }
    }

    /// Adds the byte slices to stage, one group per device array (values, then validity when
    /// present); a group's slices are staged back to back.
    pub(super) fn parts<'a>(&'a self, parts: &mut Vec<Vec<&'a [u8]>>) {
        parts.push(
            self.values
                .iter()
                .map(|(buffer, range)| &buffer.as_slice()[range.clone()])
                .collect(),
        );
        if let Some((bits, range, _)) = &self.validity {
            parts.push(vec![&bits.as_slice()[range.clone()]]);
        }
    }

    /// (values, value bit offset, validity or 0, validity bit offset) from the staged
    /// addresses, consuming them in the order of [`parts`](Self::parts).
    pub(super) fn addresses(&self, next: &mut impl Iterator<Item = u64>) -> [u64; 4] {
        let values = next.next().expect("one address per part");
        let (validity, validity_bit_offset) = match &self.validity {
            Some((_, _, bit_offset)) => (next.next().expect("one address per part"), *bit_offset),
            None => (0, 0),
        };
        [values, self.value_bit_offset, validity, validity_bit_offset]
    }
}

/// The error a generated program's flags stand for ([`crate::fusion::ERROR_NULL_KEY`] and
/// co.): a device error (the operator reruns the query on the host) where only the host
/// reproduces DataFusion's outcome, a query error for a NULL in a key declared not nullable.
pub(super) fn program_error(error: u32) -> Result<()> {
    if error & crate::fusion::ERROR_AMBIGUOUS_NAN != 0 {
        // Not a query error: the host path reproduces DataFusion's result, so rerun there.
        return Err(gpu_error(GpuError(
            "the generated program added or multiplied two different NaNs, whose result \
             only the host reproduces"
                .into(),
        )));
    }
    if error & crate::fusion::ERROR_HOST_ONLY != 0 {
        // DataFusion fails on a row, or would where it evaluates it: the host reruns the
        // query and reports exactly what DataFusion does.
        return Err(gpu_error(GpuError(
            "the generated program met a row DataFusion's evaluation fails on (sqrt of a \
             negative number, abs of a signed minimum, an integer division by zero or of \
             the minimum by -1), whose outcome only the host reproduces"
                .into(),
        )));
    }
    if error & crate::fusion::ERROR_NULL_KEY != 0 {
        return Err(exec_error(
            "a sort key declared not nullable evaluated to NULL".to_string(),
        ));
    }
    Ok(())
}

/// One key column, ready to stage: its raw Arrow buffers and its field in the composite.
struct ColumnPlan {
    buffers: ColumnBuffers,
    native: NativeCode,
    shift: u32,
    xor: u128,
    flags: u32,
}

pub(super) fn exec_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

/// Checks the columns against the layout (as `KeyLayout::encode` does) and collects their
/// buffers.
fn plan_columns(layout: &KeyLayout, columns: &[ArrayRef]) -> Result<Vec<ColumnPlan>> {
    let specs = layout.specs();
    if columns.len() != specs.len() {
        return Err(exec_error(format!(
            "key encoding expects {} columns, got {}",
            specs.len(),
            columns.len()
        )));
    }
    let n = columns.first().map_or(0, |c| c.len());
    let mut plans = Vec::with_capacity(columns.len());
    for (i, (column, spec)) in columns.iter().zip(specs).enumerate() {
        if column.len() != n {
            return Err(exec_error(format!(
                "key column {} has {} rows, key column 1 has {n}",
                i + 1,
                column.len()
            )));
        }
        if column.data_type() != &spec.data_type {
            return Err(exec_error(format!(
                "key column {} has type {}, the key layout expects {}",
                i + 1,
                column.data_type(),
                spec.data_type
            )));
        }
        let native = NativeCode::for_data_type(&spec.data_type)
            .filter(|native| Some(native.bits()) == spec.value_bits())
            .ok_or_else(|| {
                exec_error(format!(
                    "sort key {} has type {}, which the CUDA key encoder does not support",
                    i + 1,
                    spec.data_type
                ))
            })?;
        let nulls = column
            .logical_nulls()
            .filter(|nulls| nulls.null_count() > 0);
        if let Some(nulls) = &nulls
            && !spec.nullable
        {
            return Err(exec_error(format!(
                "key column {} holds {} NULLs but was declared not nullable",
                i + 1,
                nulls.null_count()
            )));
        }
        let buffers = ColumnBuffers::of(column.as_ref(), native.byte_width())?;
        let value_bits = native.bits();
        let value_mask = if value_bits == 128 {
            u128::MAX
        } else {
            (1u128 << value_bits) - 1
        };
        let mut flags = if i == 0 { ENCODE_FIRST } else { 0 };
        if spec.nullable {
            flags |= ENCODE_NULLABLE;
        }
        if spec.nulls_first {
            flags |= ENCODE_NULLS_FIRST;
        }
        plans.push(ColumnPlan {
            buffers,
            native,
            shift: layout.field_shift(i),
            xor: if spec.descending { value_mask } else { 0 },
            flags,
        });
    }
    Ok(plans)
}

/// Where a batch's encoded keys (and staged row ids) are on the device.
struct EncodedBatch {
    keys: u64,
    ids: Option<u64>,
}

/// Stages the columns' buffers (and explicit row ids) with one upload and encodes them into
/// `keys_buffer` (grown as needed).
fn encode_batch(
    engine: &mut TopKEngine,
    keys_buffer: &mut Option<PooledBuffer>,
    columns: &[ColumnPlan],
    n: usize,
    row_ids: &RowIds<'_>,
) -> GpuResult<EncodedBatch> {
    let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * columns.len() + 1);
    for column in columns {
        let mut groups = Vec::new();
        column.buffers.parts(&mut groups);
        parts.extend(groups.into_iter().flatten());
    }
    if let RowIds::Explicit(ids) = row_ids {
        if ids.len() < n {
            return Err(GpuError(format!("{} row ids for {n} rows", ids.len())));
        }
        // SAFETY: viewing initialised u64s as their bytes (no padding, alignment 1).
        parts.push(unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u8, n * 8) });
    }
    let addresses = engine.stage(&parts)?;

    let key_bytes = n * engine.kind().key_bytes();
    if keys_buffer.as_ref().is_none_or(|b| b.bytes() < key_bytes) {
        let device = Arc::clone(engine.device());
        *keys_buffer = Some(device.pool.alloc(key_bytes, engine.stream())?);
    }
    let keys = keys_buffer.as_ref().expect("allocated above").ptr();
    let mut next = addresses.iter().copied();
    for column in columns {
        let [values, value_bit_offset, validity, validity_bit_offset] =
            column.buffers.addresses(&mut next);
        engine.encode_column(
            &EncodeColumn {
                values,
                value_bit_offset,
                validity,
                validity_bit_offset,
                rows: n,
                native: column.native,
                value_bits: column.native.bits(),
                shift: column.shift,
                xor: column.xor,
                flags: column.flags,
            },
            keys,
        )?;
    }
    Ok(EncodedBatch {
        keys,
        ids: next.next(),
    })
}

// ---- entries for tests and benchmarks -------------------------------------------------------

/// Host-encoded composite keys, one per row.
#[derive(Debug, Clone, Copy)]
pub enum HostKeys<'a> {
    U32(&'a [u32]),
    U64(&'a [u64]),
    U128(&'a [u128]),
    U256(&'a [U256]),
}

impl HostKeys<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            HostKeys::U32(v) => v.len(),
            HostKeys::U64(v) => v.len(),
            HostKeys::U128(v) => v.len(),
            HostKeys::U256(v) => v.len(),
        }
    }

    pub fn kind(&self) -> KeyWidth {
        match self {
            HostKeys::U32(_) => KeyWidth::W32,
            HostKeys::U64(_) => KeyWidth::W64,
            HostKeys::U128(_) => KeyWidth::W128,
            HostKeys::U256(_) => KeyWidth::W256,
        }
    }

    /// The keys in the device layout: little-endian words, least significant first.
    pub(crate) fn device_bytes(&self) -> Vec<u8> {
        match self {
            HostKeys::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U128(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U256(v) => v
                .iter()
                .flat_map(|x| {
                    let mut b = [0u8; 32];
                    b[..16].copy_from_slice(&x.lo.to_le_bytes());
                    b[16..].copy_from_slice(&x.hi.to_le_bytes());
                    b
                })
                .collect(),
        }
    }
}

/// Selects the `k` smallest (key, row id) pairs of host-encoded keys on the device and returns
/// their row ids sorted by (key, row id): the first min(n, k) of a stable sort.
pub fn select_topk_device(
    device: &Arc<GpuDevice>,
    keys: HostKeys<'_>,
    ids: &[u64],
    k: usize,
    algorithm: DeviceAlgorithm,
) -> GpuResult<Vec<u64>> {
    if keys.len() != ids.len() {
        return Err(GpuError(format!(
            "{} keys and {} row ids",
            keys.len(),
            ids.len()
        )));
    }
    let mut engine = TopKEngine::new(device, keys.kind())?;
    let n = ids.len();
    let mut pairs = engine.upload_pairs(&keys.device_bytes(), ids)?;
    // Ids 0..n: passes that only filter may skip reading them.
    pairs.set_positional(ids.iter().enumerate().all(|(i, &id)| id == i as u64));
    let (sorted, m) = engine.select_sorted(&pairs, n, k, algorithm)?;
    engine.download_ids(&sorted, m)
}

/// Encodes one batch of key columns on the device (the selector's path) and returns the
/// composites in the layout's width, to compare with [`KeyLayout::encode`].
pub fn encode_keys_device(
    device: &Arc<GpuDevice>,
    layout: &KeyLayout,
    columns: &[ArrayRef],
) -> Result<EncodedKeys> {
    let plans = plan_columns(layout, columns)?;
    let n = columns.first().map_or(0, |c| c.len());
    let kind = layout.width();
    let bytes = (|| {
        let mut engine = TopKEngine::new(device, kind)?;
        if n == 0 {
            return Ok(vec![]);
        }
        let mut buffer = None;
        let batch = encode_batch(&mut engine, &mut buffer, &plans, n, &RowIds::Range(0))?;
        engine.read_bytes(batch.keys, n * kind.key_bytes())
    })()
    .map_err(gpu_error)?;
    let words = |size: usize| bytes.chunks_exact(size);
    Ok(match layout.width() {
        KeyWidth::W32 => EncodedKeys::W64(
            words(4)
                .map(|c| u64::from(u32::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        KeyWidth::W64 => EncodedKeys::W64(
            words(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        KeyWidth::W128 => EncodedKeys::W128(
            words(16)
                .map(|c| u128::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        KeyWidth::W256 => EncodedKeys::W256(
            words(32)
                .map(|c| U256 {
                    lo: u128::from_le_bytes(c[..16].try_into().unwrap()),
                    hi: u128::from_le_bytes(c[16..].try_into().unwrap()),
                })
                .collect(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u256_device_layout_is_little_endian_words() {
        let key = U256 {
            hi: (4u128 << 64) | 3,
            lo: (2u128 << 64) | 1,
        };
        let bytes = HostKeys::U256(&[key]).device_bytes();
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, vec![1, 2, 3, 4]);
    }
}
