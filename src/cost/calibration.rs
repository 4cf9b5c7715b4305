//! The calibration: the device's parameters and a short set of measurements, once per device,
//! cached on disk.
//!
//! Read at start-up: SM count, shared memory per SM and per block, L2 size, SM and memory
//! clocks and bus width (the SMs' shared-memory bandwidth, 128 bytes per clock per SM, comes
//! from these). Measured (about a second, mostly generating and uploading the data):
//!
//! - the read bandwidth (the read floor over 256 MiB of keys, L2 flushed);
//! - the launch gap (64 dependent tiny kernels on one stream) and a read-back's round trip;
//! - the host-to-device bandwidth from a filled pinned staging buffer (the DMA alone);
//! - the CPU selector's rows per second on one core (from the host's CPU calibration, `cpu.rs`);
//! - two reference runs per modelled part (sort, filter, then each algorithm at k = 32 over
//!   2^16 and 2^26 uniform 32-bit keys), from which [`solve_fit`] takes its two constants.
//!
//! The result is kept in memory for the process and written to
//! `<cache dir>/calibration-<key>.txt`, the key hashing the device, driver, crate version and
//! kernel sources: another GPU, driver or build calibrates afresh. `SET gpu_topk.recalibrate =
//! true` measures again (once per process while it stays set).

pub mod cpu;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdevice_attribute;

use super::model::{Case, CostModel, Fit, Fits, Machine, Part, solve_fit};
use crate::device::engine::{DevicePairs, fill_staging};
use crate::device::kernels::{KernelSources, cache_key, default_cache_dir};
use crate::device::measure::{ReadFloor, time_selection};
use crate::device::{
    DeviceAlgorithm, GpuDevice, GpuError, GpuResult, GpuTimer, KeyWidth, TopKEngine,
};

/// What the device reports about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceParams {
    pub name: String,
    pub arch: String,
    pub driver_version: i32,
    pub sm_count: usize,
    pub shared_per_sm: usize,
    pub shared_per_block: usize,
    pub l2_bytes: usize,
    /// SM clock, kHz (0 when the driver does not say).
    pub clock_khz: usize,
    /// Memory clock, kHz (0 when the driver does not say).
    pub memory_clock_khz: usize,
    pub bus_width_bits: usize,
}

impl DeviceParams {
    pub(crate) fn read(device: &GpuDevice) -> Self {
        let attribute = |a| device.context.attribute(a).map_or(0, |v| v.max(0) as usize);
        use CUdevice_attribute::*;
        Self {
            name: device.name.clone(),
            arch: device.arch(),
            driver_version: device.driver_version,
            sm_count: device.sm_count,
            shared_per_sm: attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            shared_per_block: device.max_shared_per_block,
            l2_bytes: attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            clock_khz: attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
            memory_clock_khz: attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
            bus_width_bits: attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
        }
    }

    /// Shared-memory bandwidth of all SMs: 128 bytes per clock each (1.75 GHz when the
    /// driver does not report the clock).
    pub(crate) fn shared_bandwidth(&self) -> f64 {
        let hz = if self.clock_khz > 0 {
            self.clock_khz as f64 * 1e3
        } else {
            1.75e9
        };
        self.sm_count as f64 * 128.0 * hz
    }

    /// The DRAM's nominal bandwidth (double data rate × bus width), when reported.
    pub(crate) fn nominal_bandwidth(&self) -> Option<f64> {
        (self.memory_clock_khz > 0 && self.bus_width_bits > 0)
            .then(|| 2.0 * self.memory_clock_khz as f64 * 1e3 * self.bus_width_bits as f64 / 8.0)
    }
}

/// One reference run: what it was, measured and (after the fit) predicted seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub what: String,
    pub measured_s: f64,
    pub predicted_s: f64,
}

/// A calibrated model and where it came from.
#[derive(Debug, Clone)]
pub struct Calibration {
    pub params: DeviceParams,
    pub model: CostModel,
    pub references: Vec<Reference>,
    /// Time the measurement took (when measured by this process).
    pub took: Option<Duration>,
    /// The cache file read or written, if any.
    pub file: Option<PathBuf>,
}

impl Calibration {
    /// One line for EXPLAIN VERBOSE and logs.
    pub fn describe(&self) -> String {
        let m = &self.model.machine;
        format!(
            "calibrated {}: read {:.0} GB/s, launch {:.1} µs, read-back {:.1} µs, upload {:.1} GB/s, \
             CPU {:.0} M rows/s/core × {}",
            match self.took {
                Some(t) => format!("in {:.2} s", t.as_secs_f64()),
                None => "from cache".into(),
            },
            m.read_bw / 1e9,
            m.launch_s * 1e6,
            m.readback_s * 1e6,
            m.pcie_bw / 1e9,
            m.cpu_rows_per_s / 1e6,
            m.cpu_cores
        )
    }
}

const FORMAT: &str = "datafusion-gpu-topk calibration 3";

struct Cached {
    /// Whether this process measured it because recalibration was asked for.
    recalibrated: bool,
    /// The calibration, or why it failed (not retried in this process unless forced: every
    /// query would pay for another attempt).
    calibration: Result<Arc<Calibration>, GpuError>,
}

/// The device's calibration, read or measured once per process (measuring takes seconds and
/// occupies the device; every session plans with the same figures).
static CALIBRATION: Mutex<Option<Cached>> = Mutex::new(None);

/// Whether [`calibration`] would measure the device now: neither this process nor the disk
/// cache holds its calibration, or a recalibration is asked for.
pub(crate) fn must_measure(
    device: &Arc<GpuDevice>,
    cache_dir: Option<&Path>,
    recalibrate: bool,
) -> bool {
    let held = CALIBRATION.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cached) = held.as_ref()
        && (!recalibrate || cached.recalibrated)
    {
        return false;
    }
    if recalibrate {
        return true;
    }
    let params = DeviceParams::read(device);
    calibration_file(cache_dir, &params).is_none_or(|path| read_file(&path, &params).is_none())
}

/// `<cache dir>/calibration-<key>.txt` for the device of `params` (the default cache directory
/// where `cache_dir` is `None`; `None` where there is none).
fn calibration_file(cache_dir: Option<&Path>, params: &DeviceParams) -> Option<PathBuf> {
    let dir = cache_dir
        .map(Path::to_path_buf)
        .or_else(default_cache_dir)?;
    Some(dir.join(format!("calibration-{:032x}.txt", key(params))))
}

/// The device's calibration: from memory, else the disk cache, else measured now (and
/// written to the cache). `recalibrate` measures again, once per process.
pub fn calibration(
    device: &Arc<GpuDevice>,
    cache_dir: Option<&Path>,
    recalibrate: bool,
) -> GpuResult<Arc<Calibration>> {
    let mut held = CALIBRATION.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cached) = held.as_ref()
        && (!recalibrate || cached.recalibrated)
    {
        return cached.calibration.clone();
    }
    let params = DeviceParams::read(device);
    let file = calibration_file(cache_dir, &params);
    if !recalibrate
        && let Some(path) = &file
        && let Some(mut calibration) = read_file(path, &params)
    {
        calibration.model.machine.cpu_cores = cpu_cores();
        let calibration = Arc::new(calibration);
        crate::device::planning_changed();
        *held = Some(Cached {
            recalibrated: false,
            calibration: Ok(Arc::clone(&calibration)),
        });
        return Ok(calibration);
    }
    let started = Instant::now();
    // The CPU selector's rate is the host's CPU calibration's, measured once for both, on
    // other cores while the device is measured: neither waits for the other.
    let (cpu_rows_per_s, measured) = std::thread::scope(|scope| {
        let cpu = scope.spawn(|| cpu::cpu_rates(cache_dir).topk_rows_per_s);
        let measured = measure(device, &params);
        (cpu.join(), measured)
    });
    let cpu_rows_per_s = cpu_rows_per_s.unwrap_or(cpu::FALLBACK.0);
    let (mut model, references, spread) = match measured {
        Ok(measured) => measured,
        Err(e) => {
            let e = GpuError(format!("the calibration failed: {e}"));
            crate::device::planning_changed();
            *held = Some(Cached {
                recalibrated: recalibrate,
                calibration: Err(e.clone()),
            });
            return Err(e);
        }
    };
    model.machine.cpu_rows_per_s = cpu_rows_per_s;
    let mut calibration = Calibration {
        params,
        model,
        references,
        took: Some(started.elapsed()),
        file: None,
    };
    // A busy GPU (another process, or tests running beside) makes every measurement slow;
    // such a calibration serves this process but is not written for the next ones.
    let nominal = calibration.params.nominal_bandwidth();
    let plausible = nominal.is_none_or(|b| calibration.model.machine.read_bw > 0.5 * b)
        && spread <= QUIET_SPREAD;
    if !plausible {
        log::warn!(
            "calibration read {:.0} GB/s (nominal {:.0} GB/s), runs spread up to {spread:.2}×: \
             the GPU looks busy; not caching it",
            calibration.model.machine.read_bw / 1e9,
            nominal.unwrap_or(0.0) / 1e9
        );
    }
    if let Some(path) = file.as_ref().filter(|_| plausible) {
        match write_file(path, &calibration) {
            Ok(()) => calibration.file = Some(path.clone()),
            Err(e) => log::warn!("cannot write the calibration to {}: {e}", path.display()),
        }
    }
    log::info!("{}", calibration.describe());
    let calibration = Arc::new(calibration);
    crate::device::planning_changed();
    *held = Some(Cached {
        recalibrated: recalibrate,
        calibration: Ok(Arc::clone(&calibration)),
    });
    Ok(calibration)
}

fn cpu_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Everything the measurements depend on.
fn key(params: &DeviceParams) -> u128 {
    let sources = KernelSources::load().unwrap_or_else(|_| KernelSources::embedded());
    let mut parts: Vec<Vec<u8>> = vec![
        FORMAT.as_bytes().to_vec(),
        env!("CARGO_PKG_VERSION").as_bytes().to_vec(),
        params.name.as_bytes().to_vec(),
        params.arch.as_bytes().to_vec(),
        params.driver_version.to_le_bytes().to_vec(),
    ];
    for (name, text) in sources.programs().into_iter().chain(sources.headers()) {
        parts.push(name.as_bytes().to_vec());
        parts.push(text.as_bytes().to_vec());
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    cache_key(&refs)
}

/// Repetitions per reference (after one warm-up); the median counts.
const REPS: usize = 5;
const SMALL: usize = 1 << 16;
/// Large enough that a kernel's ramp-up and tail are a small part of it (at 2^24 keys they
/// made the efficiencies fitted for 2^29 keys far too high).
const LARGE: usize = 1 << 26;
const REFERENCE_K: usize = 32;

/// Measures the device (the CPU selector's rate left 0 for the caller to fill in).
fn measure(
    device: &Arc<GpuDevice>,
    params: &DeviceParams,
) -> GpuResult<(CostModel, Vec<Reference>, f64)> {
    let mut spread = 1.0f64;
    let mut engine = TopKEngine::new(device, KeyWidth::W32)?;
    let floor = ReadFloor::new(device, &engine)?;
    let (keys, ids) = reference_pairs();
    let mut input = engine.upload_pair_bytes(&keys, &ids)?;
    input.set_positional(true);

    let machine = measure_machine(
        device,
        params,
        &mut engine,
        &floor,
        (&input, &keys),
        &mut spread,
    )?;
    let mut model = CostModel {
        machine,
        fits: Fits::default(),
    };
    let mut references = Vec::new();

    // Candidates for the sort references: a 32nd of the rows (about 2^21), as pairs.
    let candidates = engine.alloc_pairs(LARGE / 16)?;
    let kept = engine.filter_fraction(&input, LARGE, 1.0 / 32.0, &candidates)?;
    let sort_ms = |e: &mut TopKEngine, m: usize| -> GpuResult<f64> {
        floor.flush_l2(e)?;
        let timer = GpuTimer::start(e.stream())?;
        e.sort_pairs(&candidates, m, u64::MAX)?;
        Ok(f64::from(timer.stop()?))
    };
    let small_sort = 1 << 15;
    let t_small = times(&mut engine, &mut spread, |e| sort_ms(e, small_sort))?;
    let t_large = times(&mut engine, &mut spread, |e| sort_ms(e, kept))?;
    let sort_case = |m| Case::pairs(m, m, KeyWidth::W32, LARGE);
    model.fits.sort = fit(
        &model,
        Part::Sort,
        [(sort_case(small_sort), t_small), (sort_case(kept), t_large)],
        &mut references,
        "radix sort of pairs",
    );

    // Half the rows kept, with room for the hash's spread (σ ≈ 4100 at 2^26 rows).
    let scratch = engine.alloc_pairs(LARGE / 2 + LARGE / 64)?;
    let filter_ms = |e: &mut TopKEngine, n: usize| -> GpuResult<f64> {
        floor.flush_l2(e)?;
        let timer = GpuTimer::start(e.stream())?;
        e.filter_fraction(&input, n, 0.5, &scratch)?;
        Ok(f64::from(timer.stop()?))
    };
    let t_small = times(&mut engine, &mut spread, |e| filter_ms(e, SMALL))?;
    let t_large = times(&mut engine, &mut spread, |e| filter_ms(e, LARGE))?;
    // A filter keeping a 32nd (reads dominate) fits the fixed part and the read efficiency;
    // one keeping half, the weight of the written bytes.
    let t_few = times(&mut engine, &mut spread, |e| {
        floor.flush_l2(e)?;
        let timer = GpuTimer::start(e.stream())?;
        e.filter_fraction(&input, LARGE, 1.0 / 32.0, &scratch)?;
        Ok(f64::from(timer.stop()?))
    })?;
    let filter_case =
        |rows: usize, kept: usize| Case::pairs(kept, REFERENCE_K, KeyWidth::W32, rows);
    model.fits.filter = fit(
        &model,
        Part::Filter,
        [
            (filter_case(SMALL, SMALL / 2), t_small),
            (filter_case(LARGE, LARGE / 32), t_few),
        ],
        &mut references,
        "filter (n = kept pairs)",
    );
    // The written bytes' weight, from the filter keeping half: what the fit leaves of its
    // time over what its written bytes would cost at the read efficiency.
    let half = filter_case(LARGE, LARGE / 2);
    let (c, a, b) = model
        .linear_terms(Part::Filter, &half)
        .unwrap_or((0.0, 0.0, 0.0));
    let filter = model.fits.filter;
    let read_s = filter.efficiency * (4 * LARGE) as f64 / model.machine.read_bw;
    let written_s = filter.efficiency * b - read_s;
    let measured_written_s = t_large - c - filter.fixed_s * a - read_s;
    model.fits.filter_write = if written_s > 0.0 {
        (measured_written_s / written_s).clamp(0.5, 20.0)
    } else {
        1.0
    };
    references.push(Reference {
        what: format!("filter (n = kept pairs), n = {}", LARGE / 2),
        measured_s: t_large,
        predicted_s: model.filter_time(LARGE, LARGE / 2, KeyWidth::W32),
    });

    fit_algorithms(
        &mut model,
        &mut engine,
        &floor,
        &input,
        &mut spread,
        &mut references,
    )?;
    engine.synchronize()?;
    Ok((model, references, spread))
}

/// The machine's rates ([`Machine`]): the read floor over `input`'s keys, the launch gap, a
/// read-back's round trip and the upload of `keys` from pinned staging; the CPU selector's
/// rows per second are left 0 (the host's, filled in by the caller).
fn measure_machine(
    device: &Arc<GpuDevice>,
    params: &DeviceParams,
    engine: &mut TopKEngine,
    floor: &ReadFloor,
    (input, keys): (&DevicePairs, &[u8]),
    spread: &mut f64,
) -> GpuResult<Machine> {
    let read_s = times(engine, spread, |e| {
        floor.time_read(e, input.key_at(0), LARGE, 4)
    })?;
    let launch_s = times(engine, spread, |e| {
        let timer = GpuTimer::start(e.stream())?;
        for _ in 0..64 {
            floor.launch(e, input.key_at(0), 1024, 4)?;
        }
        Ok(f64::from(timer.stop()?) / 64.0)
    })?;
    let readback_s = times(engine, &mut 1.0, |e| {
        e.synchronize()?;
        let started = Instant::now();
        e.read_bytes(input.key_at(0), 8)?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    })?;
    // The DMA from pinned memory alone: the operator's partitions fill their staging
    // buffers in parallel, off the device lock.
    let upload_bytes = 64 << 20;
    let mut staged = fill_staging(device, &[vec![&keys[..upload_bytes]]])?;
    let upload_s = times(engine, &mut 1.0, |e| {
        e.synchronize()?;
        let started = Instant::now();
        e.upload_staged(&mut staged)?;
        e.synchronize()?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    })?;
    drop(staged);
    Ok(Machine {
        read_bw: (4 * LARGE) as f64 / read_s,
        launch_s,
        readback_s,
        pcie_bw: upload_bytes as f64 / upload_s,
        shared_bw: params.shared_bandwidth(),
        max_shared_per_block: params.shared_per_block,
        sm_count: params.sm_count,
        cpu_rows_per_s: 0.0,
        cpu_cores: cpu_cores(),
    })
}

/// The reference input as device bytes: `LARGE` uniform 32-bit keys (xorshift) and the row
/// ids 0..n, written by several threads: one thread takes longer than the measurements.
fn reference_pairs() -> (Vec<u8>, Vec<u8>) {
    let mut keys = vec![0u8; 4 * LARGE];
    let mut ids = vec![0u8; 8 * LARGE];
    let threads = cpu_cores().clamp(1, 8);
    let rows = LARGE.div_ceil(threads);
    std::thread::scope(|scope| {
        for (part, (keys, ids)) in keys
            .chunks_mut(4 * rows)
            .zip(ids.chunks_mut(8 * rows))
            .enumerate()
        {
            scope.spawn(move || {
                let mut x =
                    0x9E37_79B9_7F4A_7C15u64 ^ (part as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
                let first = (part * rows) as u64;
                for (i, (key, id)) in keys
                    .chunks_exact_mut(4)
                    .zip(ids.chunks_exact_mut(8))
                    .enumerate()
                {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    key.copy_from_slice(&((x >> 32) as u32).to_le_bytes());
                    id.copy_from_slice(&(first + i as u64).to_le_bytes());
                }
            });
        }
    });
    (keys, ids)
}

/// Fits each device algorithm's two constants from its runs over 2^16 and 2^26 of `input`'s
/// keys, into `model` (the sort and filter fitted before), with their references.
fn fit_algorithms(
    model: &mut CostModel,
    engine: &mut TopKEngine,
    floor: &ReadFloor,
    input: &DevicePairs,
    spread: &mut f64,
    references: &mut Vec<Reference>,
) -> GpuResult<()> {
    // Sample before delegate: the delegates' selection is a sampled one.
    for algorithm in [
        DeviceAlgorithm::Sample,
        DeviceAlgorithm::Radix,
        DeviceAlgorithm::Bitonic,
        DeviceAlgorithm::Delegate,
    ] {
        let run = |e: &mut TopKEngine, n: usize| -> GpuResult<f64> {
            floor.flush_l2(e)?;
            Ok(time_selection(e, input, n, REFERENCE_K, algorithm)?.0)
        };
        let t_small = times(engine, spread, |e| run(e, SMALL))?;
        let t_large = times(engine, spread, |e| run(e, LARGE))?;
        let case = |n| Case::positional(n, REFERENCE_K, KeyWidth::W32);
        let fitted = fit(
            model,
            Part::Algorithm(algorithm),
            [(case(SMALL), t_small), (case(LARGE), t_large)],
            references,
            algorithm.name(),
        );
        match algorithm {
            DeviceAlgorithm::Sample => model.fits.sample = fitted,
            DeviceAlgorithm::Radix => model.fits.radix = fitted,
            DeviceAlgorithm::Bitonic => model.fits.bitonic = fitted,
            DeviceAlgorithm::Delegate => model.fits.delegate = fitted,
        }
    }
    Ok(())
}

/// Seconds: the fastest of `REPS` runs of `f` (milliseconds each) after one warm-up. The
/// minimum, not the median: other work on the GPU or the host only ever adds time. `spread`
/// keeps the largest median / minimum seen (a busy GPU spreads the runs).
fn times(
    engine: &mut TopKEngine,
    spread: &mut f64,
    mut f: impl FnMut(&mut TopKEngine) -> GpuResult<f64>,
) -> GpuResult<f64> {
    let mut runs = Vec::with_capacity(REPS);
    for rep in 0..=REPS {
        let ms = f(engine)?;
        if rep > 0 {
            runs.push(ms / 1e3);
        }
    }
    runs.sort_by(f64::total_cmp);
    *spread = spread.max(runs[runs.len() / 2] / runs[0]);
    Ok(runs[0])
}

/// The most a device-timed reference's median may exceed its fastest run in a calibration
/// that is written for later processes: quiet runs stay well within it, and a calibration
/// disturbed by other work would mislead every later process (benches/PERFORMANCE.md).
const QUIET_SPREAD: f64 = 1.3;

/// Fits `part` to its two reference runs and records them with the fitted prediction.
fn fit(
    model: &CostModel,
    part: Part,
    runs: [(Case, f64); 2],
    references: &mut Vec<Reference>,
    what: &str,
) -> Fit {
    let terms = |c: &Case| model.linear_terms(part, c).unwrap_or((0.0, 0.0, 0.0));
    let (c1, a1, b1) = terms(&runs[0].0);
    let (c2, a2, b2) = terms(&runs[1].0);
    let fitted = solve_fit(
        (c1, a1, b1, runs[0].1),
        (c2, a2, b2, runs[1].1),
        Fit::DEFAULT,
    );
    for ((case, measured), (c, a, b)) in runs.iter().zip([(c1, a1, b1), (c2, a2, b2)]) {
        references.push(Reference {
            what: format!("{what}, n = {}", case.n),
            measured_s: *measured,
            predicted_s: c + fitted.fixed_s * a + fitted.efficiency * b,
        });
    }
    fitted
}

fn write_file(path: &Path, c: &Calibration) -> std::io::Result<()> {
    let m = &c.model.machine;
    let mut text = String::new();
    let _ = writeln!(text, "{FORMAT}");
    let _ = writeln!(text, "device {}", c.params.name);
    let _ = writeln!(text, "read_bw {:e}", m.read_bw);
    let _ = writeln!(text, "launch_s {:e}", m.launch_s);
    let _ = writeln!(text, "readback_s {:e}", m.readback_s);
    let _ = writeln!(text, "pcie_bw {:e}", m.pcie_bw);
    let _ = writeln!(text, "shared_bw {:e}", m.shared_bw);
    let _ = writeln!(text, "max_shared_per_block {}", m.max_shared_per_block);
    let _ = writeln!(text, "sm_count {}", m.sm_count);
    let _ = writeln!(text, "cpu_rows_per_s {:e}", m.cpu_rows_per_s);
    let f = &c.model.fits;
    for (name, fit) in [
        ("sample", f.sample),
        ("radix", f.radix),
        ("bitonic", f.bitonic),
        ("delegate", f.delegate),
        ("sort", f.sort),
        ("filter", f.filter),
    ] {
        let _ = writeln!(text, "fit {name} {:e} {:e}", fit.fixed_s, fit.efficiency);
    }
    let _ = writeln!(text, "filter_write {:e}", f.filter_write);
    for r in &c.references {
        let _ = writeln!(
            text,
            "reference {:e} {:e} {}",
            r.measured_s, r.predicted_s, r.what
        );
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// The model of a calibration file (e.g. one a GPU run left), for replaying measurements
/// against it without a GPU; `None` when missing or malformed.
pub fn model_from_file(path: &Path) -> Option<CostModel> {
    let params = DeviceParams {
        name: String::new(),
        arch: String::new(),
        driver_version: 0,
        sm_count: 0,
        shared_per_sm: 0,
        shared_per_block: 0,
        l2_bytes: 0,
        clock_khz: 0,
        memory_clock_khz: 0,
        bus_width_bits: 0,
    };
    read_file(path, &params).map(|c| c.model)
}

/// Parses a cache file; `None` when missing or malformed (the caller measures again).
fn read_file(path: &Path, params: &DeviceParams) -> Option<Calibration> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    if lines.next()? != FORMAT {
        return None;
    }
    let mut value = std::collections::HashMap::new();
    let mut fits = std::collections::HashMap::new();
    let mut references = Vec::new();
    for line in lines {
        let (name, rest) = line.split_once(' ')?;
        match name {
            "fit" => {
                let mut parts = rest.split(' ');
                let which = parts.next()?.to_string();
                let fixed_s = parts.next()?.parse().ok()?;
                let efficiency = parts.next()?.parse().ok()?;
                fits.insert(
                    which,
                    Fit {
                        fixed_s,
                        efficiency,
                    },
                );
            }
            "reference" => {
                let mut parts = rest.splitn(3, ' ');
                let measured_s = parts.next()?.parse().ok()?;
                let predicted_s = parts.next()?.parse().ok()?;
                references.push(Reference {
                    what: parts.next()?.to_string(),
                    measured_s,
                    predicted_s,
                });
            }
            "device" => {}
            _ => {
                value.insert(name.to_string(), rest.parse::<f64>().ok()?);
            }
        }
    }
    let get = |name: &str| {
        value
            .get(name)
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let fit = |name: &str| fits.get(name).copied();
    Some(Calibration {
        params: params.clone(),
        model: CostModel {
            machine: Machine {
                read_bw: get("read_bw")?,
                launch_s: get("launch_s")?,
                readback_s: get("readback_s")?,
                pcie_bw: get("pcie_bw")?,
                shared_bw: get("shared_bw")?,
                max_shared_per_block: get("max_shared_per_block")? as usize,
                sm_count: get("sm_count")? as usize,
                cpu_rows_per_s: get("cpu_rows_per_s")?,
                cpu_cores: cpu_cores(),
            },
            fits: Fits {
                sample: fit("sample")?,
                radix: fit("radix")?,
                bitonic: fit("bitonic")?,
                delegate: fit("delegate")?,
                sort: fit("sort")?,
                filter: fit("filter")?,
                filter_write: get("filter_write")?,
            },
        },
        references,
        took: None,
        file: Some(path.to_path_buf()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calibration_file_round_trips_and_rejects_damage() {
        let params = DeviceParams {
            name: "Test GPU".into(),
            arch: "sm_90".into(),
            driver_version: 13000,
            sm_count: 132,
            shared_per_sm: 233472,
            shared_per_block: 232448,
            l2_bytes: 50 << 20,
            clock_khz: 1_980_000,
            memory_clock_khz: 2_619_000,
            bus_width_bits: 5120,
        };
        let model = CostModel {
            machine: Machine {
                read_bw: 3.05e12,
                launch_s: 2.25e-6,
                readback_s: 9.5e-6,
                pcie_bw: 24.5e9,
                shared_bw: params.shared_bandwidth(),
                max_shared_per_block: params.shared_per_block,
                sm_count: params.sm_count,
                cpu_rows_per_s: 2.5e8,
                cpu_cores: 4,
            },
            fits: Fits {
                radix: Fit {
                    fixed_s: 3.5e-6,
                    efficiency: 1.75,
                },
                ..Fits::default()
            },
        };
        let calibration = Calibration {
            params: params.clone(),
            model,
            references: vec![Reference {
                what: "sample, n = 65536".into(),
                measured_s: 3e-5,
                predicted_s: 2.9e-5,
            }],
            took: Some(Duration::from_millis(900)),
            file: None,
        };
        let dir = std::env::temp_dir().join(format!("gpu-topk-calibration-{}", std::process::id()));
        let path = dir.join("calibration-test.txt");
        write_file(&path, &calibration).unwrap();
        let read = read_file(&path, &params).expect("a valid file");
        let mut expected = calibration.model;
        expected.machine.cpu_cores = cpu_cores();
        assert_eq!(read.model, expected);
        assert_eq!(read.references, calibration.references);
        // A damaged value or a missing fit is not taken.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("read_bw 3.05e12", "read_bw x")).unwrap();
        assert!(read_file(&path, &params).is_none());
        std::fs::write(&path, text.replace("fit radix", "fit radiks")).unwrap();
        assert!(read_file(&path, &params).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn device_bandwidths_follow_the_reported_clocks() {
        let mut params = DeviceParams {
            name: String::new(),
            arch: String::new(),
            driver_version: 0,
            sm_count: 132,
            shared_per_sm: 0,
            shared_per_block: 0,
            l2_bytes: 0,
            clock_khz: 1_000_000,
            memory_clock_khz: 0,
            bus_width_bits: 0,
        };
        assert_eq!(params.shared_bandwidth(), 132.0 * 128.0 * 1e9);
        assert_eq!(params.nominal_bandwidth(), None);
        params.memory_clock_khz = 2_619_000;
        params.bus_width_bits = 5120;
        let nominal = params.nominal_bandwidth().unwrap();
        assert!((nominal - 3.352e12).abs() < 1e9, "{nominal}");
    }
}
