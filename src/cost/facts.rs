//! What the decisions read of the machine, gathered in one place: [`StartFacts`] without
//! starting the device, and [`DeviceFacts`] by starting it, loading its kernels and reading
//! (or running) its calibration; either with the host's CPU rates where the decision weighs
//! them (`calibration::cpu`, measured without the device). The decisions in `choose.rs` take
//! these facts and touch nothing themselves.

use std::sync::Arc;
use std::time::Duration;

use super::calibration::cpu::{self, CpuRates, cpu_rates};
use super::calibration::{self, Calibration};
use super::choose::Settings;
use crate::config::{Algorithm, Backend};
use crate::device::{DeviceSlot, GpuResult, GpuStatus, gpu_status};

/// What the decision before the device starts reads of it, without starting it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StartFacts {
    /// Whether the device was probed already (started, or found missing).
    pub started: bool,
    /// Whether probing it would start a CUDA driver (slow) rather than find at once that
    /// there is none.
    pub slow_start: bool,
    /// The host's CPU rates, where the device's start is weighed against the CPU path
    /// (measured once per process, or read from the cache directory).
    pub cpu: Option<CpuRates>,
}

impl StartFacts {
    /// Reads them for `settings`: only `auto`, the CPU path not forced, weighs the device's
    /// start, so no other setting probes the driver library here.
    pub(crate) fn read(settings: Settings<'_>) -> Self {
        let weighs_start =
            settings.backend == Backend::Auto && settings.algorithm != Algorithm::Cpu;
        let started = crate::device::probed_status().is_some();
        let slow_start = weighs_start && !started && crate::device::probe_is_slow();
        Self {
            started,
            slow_start,
            cpu: slow_start.then(|| cpu_rates(settings.kernel_cache_dir)),
        }
    }
}

/// What a decision needs of the started device beyond its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Needs {
    /// The calibration (read from disk, or measured on first use: up to a second).
    pub calibration: bool,
    /// The host's CPU rates (read from disk, or measured on first use).
    pub cpu: bool,
}

/// The started device as the decisions see it, or why there is none to run on.
#[derive(Debug, Clone)]
pub(crate) enum DeviceFacts {
    /// No usable GPU, and why.
    NoGpu(String),
    /// A GPU whose kernels cannot be loaded, and why.
    NoKernels(String),
    /// A GPU with its kernels loaded.
    Ready(GpuFacts),
}

/// A started device with its kernels loaded.
#[derive(Debug, Clone)]
pub(crate) struct GpuFacts {
    /// The device's slot among the process's GPUs.
    pub slot: DeviceSlot,
    /// `name (arch, memory)`, as EXPLAIN names the device.
    pub describe: String,
    /// Shared memory a block may use: bounds the bitonic top-k's k.
    pub max_shared_per_block: usize,
    /// This process's last NVRTC compile of a generated program, if it timed one.
    pub last_compile: Option<Duration>,
    /// The calibration, or why it failed; `None` where the decision did not need it (and it
    /// was not read).
    pub calibration: Option<GpuResult<Arc<Calibration>>>,
    /// The host's CPU rates, where the decision needs them.
    pub cpu: Option<CpuRates>,
}

impl DeviceFacts {
    /// Starts the device (once per process), loads its kernels (compiled by NVRTC on first
    /// use, cached in the kernel cache directory) and, where `needs` says so, reads its
    /// calibration (measured once per device, then read from the same directory).
    ///
    /// `program` (a generated program's source and entry point), where it is not compiled
    /// yet and a calibration is measured now, compiles on a thread of its own meanwhile: the
    /// first query of a fresh machine waits for whichever ends last, not for both. (Where
    /// nothing is measured, the query compiles it only if it runs it.)
    pub(crate) fn gather(
        settings: Settings<'_>,
        needs: Needs,
        program: Option<(&str, &str)>,
    ) -> Self {
        let device = match gpu_status() {
            GpuStatus::Unavailable(why) => return DeviceFacts::NoGpu(why.clone()),
            GpuStatus::Available(device) => device,
        };
        if let Err(e) = device.kernels_with_cache_dir(settings.kernel_cache_dir) {
            return DeviceFacts::NoKernels(e.to_string());
        }
        let dir = settings.kernel_cache_dir;
        let measuring = (needs.calibration
            && calibration::must_measure(device, dir, settings.recalibrate))
            || (needs.cpu && cpu::must_measure(dir));
        let compile = program.filter(|(source, _)| measuring && !device.compiled(source));
        let (calibration, cpu) = std::thread::scope(|scope| {
            let compiling = compile.map(|(source, entry)| {
                log::info!("compiling a generated program while calibrating");
                scope.spawn(move || device.generated_kernel(source, entry))
            });
            let calibration = needs
                .calibration
                .then(|| calibration::calibration(device, dir, settings.recalibrate));
            let cpu = needs.cpu.then(|| cpu_rates(dir));
            // A compile error is the query's to report, where it runs the program.
            if let Some(Err(e)) = compiling.map(|c| c.join()).transpose().ok().flatten() {
                log::debug!("the generated program did not compile: {e}");
            }
            (calibration, cpu)
        });
        DeviceFacts::Ready(GpuFacts {
            slot: device.slot,
            describe: device.describe(),
            max_shared_per_block: device.max_shared_per_block,
            last_compile: device.last_compile_time(),
            calibration,
            cpu,
        })
    }
}
