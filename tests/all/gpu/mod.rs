//! The CUDA backend: kernels compile under NVRTC for sm_90 (no GPU needed), the CUBIN cache,
//! and, on a machine with a GPU, the device encoding and both selection algorithms against the
//! CPU path, element by element. Tests that need NVRTC or a GPU print `SKIP: …` and pass
//! without them.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Date32Array, Date64Array, Decimal32Array, Decimal64Array,
    Decimal128Array, DurationMicrosecondArray, DurationMillisecondArray, DurationNanosecondArray,
    DurationSecondArray, Float16Array, Float32Array, Float64Array, Int8Array, Int16Array,
    Int32Array, Int64Array, Time32MillisecondArray, Time32SecondArray, Time64MicrosecondArray,
    Time64NanosecondArray, TimestampMicrosecondArray, TimestampMillisecondArray,
    TimestampNanosecondArray, TimestampSecondArray, UInt8Array, UInt16Array, UInt32Array,
    UInt64Array,
};
use datafusion::arrow::datatypes::DataType;
use datafusion_gpu_topk::internal::config::Algorithm;
use datafusion_gpu_topk::internal::device::kernels::{
    self, KernelSources, cache_key, compile_cubin, compile_program, cubin_cached, entry_points,
    kernels_without_dependency_wait, nvrtc_available, read_cache_file, write_cache_file,
};
use datafusion_gpu_topk::internal::device::{
    DeviceAlgorithm, GpuDevice, GpuStatus, gpu, gpu_status,
};
use datafusion_gpu_topk::internal::keys::{EncodedKeys, KeyLayout, KeySpec, U256};
use datafusion_gpu_topk::internal::select::cuda::{
    HostKeys, bitonic_max_k, encode_keys_device, new_cuda_selector_with_capacity,
    select_topk_device,
};
use datafusion_gpu_topk::internal::select::{RowIds, SelectInput, SelectionSpec, cpu, row_id};

use crate::common::{Rng, test_dir};

mod aggregate;
mod aggregate_topk;
mod encoding;
mod generated;
mod nvrtc;
mod precompiled;
mod selection;
mod selector;
mod sorts;

use encoding::*;
use selection::*;

// ---- helpers ----------------------------------------------------------------------------------

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        true
    } else {
        eprintln!(
            "SKIP: {test}: no NVRTC library (run .ci/install-nvrtc.sh and put its output on LD_LIBRARY_PATH)"
        );
        false
    }
}

fn gpu_or_skip(test: &str) -> Option<Arc<GpuDevice>> {
    match gpu_status() {
        GpuStatus::Available(device) => {
            device.pool.set_poison(true);
            Some(Arc::clone(device))
        }
        GpuStatus::Unavailable(why) => {
            eprintln!("SKIP: {test}: no GPU ({why})");
            None
        }
    }
}

/// The reference: row ids of the min(n, k) smallest (key, id) pairs, in order.
fn oracle<K: Ord + Copy>(keys: &[K], ids: &[u64], k: usize) -> Vec<u64> {
    let mut pairs: Vec<(K, u64)> = keys.iter().copied().zip(ids.iter().copied()).collect();
    if k == 0 {
        return vec![];
    }
    if pairs.len() > k {
        pairs.select_nth_unstable(k - 1);
        pairs.truncate(k);
    }
    pairs.sort_unstable();
    pairs.into_iter().map(|(_, id)| id).collect()
}

/// The device algorithm a setting resolves to for `spec`, as the cost model resolves it
/// (`None`: it cannot run this k).
fn resolve(
    device: &GpuDevice,
    spec: &SelectionSpec,
    algorithm: Algorithm,
) -> Option<DeviceAlgorithm> {
    datafusion_gpu_topk::internal::cost::device_algorithm(device, &spec.layout, spec.k, algorithm)
        .ok()
}
