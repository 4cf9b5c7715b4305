//! Measuring device work: the read floor (a kernel that only reads the keys), L2 flushing, and
//! the timed selection. The kernel benchmark and the cost model's calibration measure with
//! these, so that the model is fitted to the same quantity the benchmark reports.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg, result};

use super::{
    DeviceAlgorithm, DevicePairs, GpuDevice, GpuError, GpuResult, GpuTimer, PooledBuffer,
    TopKEngine,
};

const FLOOR_THREADS: u32 = 256;
/// Bytes read before every timed repetition to evict the L2 cache (50 MB on the H100).
pub const FLUSH_BYTES: usize = 256 << 20;

/// The read-floor kernels (read_floor.cu), an 8-byte result word and the L2 flush buffer.
pub struct ReadFloor {
    w32: CudaFunction,
    w64: CudaFunction,
    sm_count: usize,
    /// 8 bytes the kernels reduce into.
    out: PooledBuffer,
    flush: PooledBuffer,
}

impl ReadFloor {
    pub fn new(device: &Arc<GpuDevice>, engine: &TopKEngine) -> GpuResult<Self> {
        let kernels = device.kernels()?;
        let load = |name: &str| kernels.get(name).cloned();
        let out = device.pool.alloc(4096, engine.stream())?;
        let flush = device.pool.alloc(FLUSH_BYTES, engine.stream())?;
        device.context.bind_to_thread()?;
        // SAFETY: the whole buffer, on the stream that uses it.
        unsafe {
            result::memset_d8_async(flush.ptr(), 0x5A, FLUSH_BYTES, engine.stream().cu_stream())
        }?;
        Ok(Self {
            w32: load("read_floor_w32")?,
            w64: load("read_floor_w64")?,
            sm_count: device.sm_count,
            out,
            flush,
        })
    }

    /// Enqueues a max over `words` words of `width` bytes (4 or 8) at `ptr` into the result
    /// word (which the caller zeroes first, [`zero_out`](Self::zero_out)).
    pub fn launch(
        &self,
        engine: &TopKEngine,
        ptr: u64,
        words: usize,
        width: usize,
    ) -> GpuResult<()> {
        let vectors = words * width / 16;
        let grid = vectors
            .div_ceil(FLOOR_THREADS as usize * 4)
            .clamp(1, self.sm_count * 8) as u32;
        let function = if width == 4 { &self.w32 } else { &self.w64 };
        let (out, n) = (self.out.ptr(), words as u64);
        let mut builder = engine.stream().launch_builder(function);
        builder.arg(&ptr).arg(&n).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (FLOOR_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: read_floor_wNN(const W *words, u64 n, W *out): `ptr` holds `words` live words
        // of that width, `out` 8 live bytes; both buffers outlive the stream's work (callers
        // synchronise before dropping them).
        unsafe { builder.launch(cfg) }
            .map_err(|e| GpuError(format!("launching read_floor failed: {e}")))?;
        Ok(())
    }

    pub fn zero_out(&self, engine: &TopKEngine) -> GpuResult<()> {
        engine.device().context.bind_to_thread()?;
        // SAFETY: 8 bytes of a live buffer, on its stream.
        unsafe { result::memset_d8_async(self.out.ptr(), 0, 8, engine.stream().cu_stream()) }?;
        Ok(())
    }

    /// The result word's 8 bytes (the largest word read, zero-extended for 4-byte words).
    pub fn result(&self, engine: &mut TopKEngine, width: usize) -> GpuResult<u64> {
        let bytes = engine.read_bytes(self.out.ptr(), 8)?;
        Ok(if width == 4 {
            u64::from(u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")))
        } else {
            u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
        })
    }

    /// Reads the whole flush buffer, evicting L2 (before each timed repetition).
    pub fn flush_l2(&self, engine: &TopKEngine) -> GpuResult<()> {
        self.launch(engine, self.flush.ptr(), FLUSH_BYTES / 8, 8)
    }

    /// Milliseconds of one read of `words` words of `width` bytes at `ptr`, after an L2 flush.
    pub fn time_read(
        &self,
        engine: &mut TopKEngine,
        ptr: u64,
        words: usize,
        width: usize,
    ) -> GpuResult<f64> {
        self.flush_l2(engine)?;
        self.zero_out(engine)?;
        let timer = GpuTimer::start(engine.stream())?;
        self.launch(engine, ptr, words, width)?;
        Ok(f64::from(timer.stop()?))
    }
}

/// One timed selection: the device time from its first kernel to its last, in milliseconds,
/// with the sorted result and its length. A pending sampled selection's status read-back
/// comes after (callers read it with the result); when work ran after it (a missed estimate,
/// or survivors left to sort), the round trip and that work count too. The caller flushes L2
/// first when it wants a cold cache.
pub fn time_selection(
    engine: &mut TopKEngine,
    pairs: &DevicePairs,
    n: usize,
    k: usize,
    algorithm: DeviceAlgorithm,
) -> GpuResult<(f64, DevicePairs, usize)> {
    let timer = GpuTimer::start(engine.stream())?;
    let selection = engine.enqueue_select(pairs, n, k, algorithm)?;
    let enqueued = timer.elapsed()?;
    let (sorted, m, more) = engine.finish_reporting(selection)?;
    let ms = if more { timer.stop()? } else { enqueued };
    Ok((f64::from(ms), sorted, m))
}

/// Median of a non-empty sample (NaN when empty).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let h = v.len() / 2;
    if v.len() % 2 == 1 {
        v[h]
    } else {
        (v[h - 1] + v[h]) / 2.0
    }
}

/// The cut of [`TopKEngine::filter_fraction`] for a fraction: rows whose
/// [`fraction_hash`] is below it are kept.
pub fn fraction_cut(fraction: f64) -> u32 {
    (fraction.clamp(0.0, 1.0) * 4294967296.0).min(u32::MAX as f64) as u32
}

/// The row hash of candidates.cu `HashedFraction` (the filter of a given selectivity).
pub fn fraction_hash(row: u64) -> u32 {
    let mut x = row.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 32;
    x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (x >> 32) as u32
}

/// Host→device copy rates in GB/s, see [`upload_rates`].
#[derive(Debug, Clone, Copy)]
pub struct UploadRates {
    /// A plain copy from one pinned buffer: the link's own rate.
    pub pinned: f64,
    /// The engine's upload of pageable memory through its pinned staging buffers: what a
    /// query shipping its columns gets.
    pub staged: f64,
    /// A copy straight from pageable memory registered with the driver
    /// (`cuMemHostRegister`).
    pub registered: f64,
    /// The same counting its registration and unregistration once.
    pub registering: f64,
}

/// Host→device copy rates over `bytes`, best of three (registration once).
pub fn upload_rates(device: &Arc<GpuDevice>, bytes: usize) -> GpuResult<UploadRates> {
    use cudarc::driver::sys;
    let mut engine = TopKEngine::new(device, super::KeyWidth::W64)?;
    let target = device.pool.alloc(bytes, engine.stream())?;
    let mut pinned = super::memory::PinnedBuffer::new(&device.context, bytes, true)?;
    pinned.as_mut_slice()?.fill(0x5A);
    let mut pageable = vec![0xA5u8; bytes];
    let seconds = |copy: &mut dyn FnMut(&mut TopKEngine) -> GpuResult<()>,
                   engine: &mut TopKEngine|
     -> GpuResult<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            engine.synchronize()?;
            let started = std::time::Instant::now();
            copy(engine)?;
            engine.synchronize()?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let pinned_s = seconds(
        &mut |engine| pinned.upload(bytes, target.ptr(), engine.stream()),
        &mut engine,
    )?;
    let staged_s = seconds(
        &mut |engine| engine.upload_bytes(&pageable, target.ptr()),
        &mut engine,
    )?;
    device.context.bind_to_thread()?;
    let started = std::time::Instant::now();
    // SAFETY: `pageable` is live, unmoved and unregistered below before it is dropped.
    unsafe { sys::cuMemHostRegister_v2(pageable.as_mut_ptr().cast(), bytes, 0) }.result()?;
    let register_s = started.elapsed().as_secs_f64();
    let copied = seconds(
        &mut |engine| {
            // SAFETY: the source stays alive and unmodified until the stream is synchronised
            // (`seconds` waits after each copy).
            unsafe {
                result::memcpy_htod_async(target.ptr(), &pageable, engine.stream().cu_stream())
            }?;
            Ok(())
        },
        &mut engine,
    );
    let started = std::time::Instant::now();
    // SAFETY: registered above; no copy from it is in flight (`seconds` synchronised).
    let unregistered = unsafe { sys::cuMemHostUnregister(pageable.as_mut_ptr().cast()) }.result();
    let unregister_s = started.elapsed().as_secs_f64();
    let registered_s = copied?;
    unregistered?;
    let rate = |s: f64| bytes as f64 / s / 1e9;
    Ok(UploadRates {
        pinned: rate(pinned_s),
        staged: rate(staged_s),
        registered: rate(registered_s),
        registering: rate(register_s + registered_s + unregister_s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fraction_hash_keeps_about_the_fraction() {
        for fraction in [0.01, 0.1, 0.5, 0.9] {
            let cut = fraction_cut(fraction);
            let kept = (0..1u64 << 20).filter(|&i| fraction_hash(i) < cut).count();
            let expected = fraction * (1u64 << 20) as f64;
            assert!(
                (kept as f64 - expected).abs() < 5.0 * expected.sqrt() + 10.0,
                "{fraction}: {kept}"
            );
        }
        assert_eq!(fraction_cut(1.0), u32::MAX);
        assert_eq!(fraction_cut(0.0), 0);
    }
}
