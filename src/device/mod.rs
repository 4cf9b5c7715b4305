//! The CUDA device runtime (cudarc, loaded dynamically).
//!
//! Detection never panics: with `dynamic-loading`, cudarc panics on first use of a library it
//! cannot find, so [`gpu_status`] first asks `is_culib_present` for the driver and NVRTC, then
//! initialises the driver and opens device 0. The result is computed once per process. The
//! process's other devices ([`gpu_on`]: other GPUs, or further logical devices of one) open
//! on first use, each with its own pools, column cache and kernels.
//!
//! The rest of the runtime, one module each:
//! - [`memory`]: pooled device buffers (reused by size class) and pinned staging buffers;
//! - [`kernels`]: the `kernels/*.cu` sources, their images precompiled at build time, NVRTC
//!   compilation to CUBIN, the on-disk cache;
//! - [`plan`]: pure planning (key widths, algorithms, tuning constants, routes), no CUDA;
//! - [`engine`]: the host side of each kernel (encode, append, radix select, bitonic top-k,
//!   sampled selection, sorts), on one stream, with staging and the one dispatch over routes;
//! - [`timer`]: CUDA events for timing;
//! - [`u256`]: the 256-bit integer of the widest composite keys;
//! - [`watch`]: one query's device bytes, its device memory limit, injected device faults.

pub mod column_cache;
pub(crate) mod engine;
pub mod error;
pub mod kernels;
pub mod measure;
pub mod memory;
pub mod options;
pub mod plan;
pub(crate) mod timer;
pub mod u256;
pub(crate) mod watch;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

pub(crate) use options::DeviceOptions;

pub use engine::{
    AGG_FILTERED_ENTRY, AGG_HAVING_ENTRY, AGG_MAX_ACCUMULATORS, AGG_MAX_KEYS, AGG_MAX_VALUES,
    AggValue, AggregateCall, AggregateColumn, AggregateDecline, AggregateFilter, AggregateGroup,
    AggregateHaving, AggregateOp, AggregateOrder, AggregateReport, AggregateTopK, DeviceColumns,
    DevicePairs, EncodedChunk, EncodedColumn, EncodedPage, FusedReport, GROUP_SAMPLE, GatherColumn,
    GroupAlgorithm, GroupRanking, GroupSpec, HavingColumn, HostColumn, KeptPiece, KeptRows, RankBy,
    TopKEngine, agg_slot_width, aggregate_top_k_host,
};
pub use kernels::{GeneratedKernel, Kernels};
pub(crate) use memory::{BufferPool, PinnedPool, PooledBuffer};
pub use plan::{DeviceAlgorithm, FUSED_SAMPLE_CLUSTER, FUSED_SAMPLE_ROWS, KeyWidth};
pub use timer::GpuTimer;

/// What the process knows about its GPU.
#[derive(Debug, Clone)]
pub enum GpuStatus {
    /// A usable device.
    Available(Arc<GpuDevice>),
    /// No usable device, and why (shown in EXPLAIN and by the CLI).
    Unavailable(String),
}

impl GpuStatus {
    /// The device, if it is usable.
    pub fn device(&self) -> Option<&Arc<GpuDevice>> {
        match self {
            GpuStatus::Available(device) => Some(device),
            GpuStatus::Unavailable(_) => None,
        }
    }
}

/// An error of the device runtime: a driver error, a kernel compile error (with NVRTC's log),
/// or a failed consistency check. The selectors turn it into a `DataFusionError`, and the
/// caller falls back to the CPU path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuError(pub String);

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuError {}

impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> Self {
        GpuError(format!("CUDA driver error: {e}"))
    }
}

impl From<String> for GpuError {
    fn from(message: String) -> Self {
        GpuError(message)
    }
}

pub type GpuResult<T> = Result<T, GpuError>;

/// A generated program's place in [`GpuDevice`]'s map: empty until it compiled.
type GeneratedSlot = Arc<Mutex<Option<Arc<GeneratedKernel>>>>;

/// One CUDA device and its context, with the device-wide buffer pools and the kernels.
pub struct GpuDevice {
    /// Which of the process's devices this is (`(0, 0)`: the process's device, [`gpu`]).
    pub slot: DeviceSlot,
    pub context: Arc<CudaContext>,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for the H100.
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    /// Streaming multiprocessors (132 on the H100 SXM).
    pub sm_count: usize,
    /// Shared memory one block may use after opting in (227 KiB on Hopper).
    pub max_shared_per_block: usize,
    /// The driver's CUDA version, e.g. 13000 (part of the kernel cache key).
    pub driver_version: i32,
    /// Whether kernels launch with programmatic stream serialisation (compute capability 9.0
    /// on, unless `GPU_TOPK_PDL=0`; see [`Self::programmatic_launch`]).
    programmatic_launch: bool,
    /// The process's device switches, read once at detection.
    pub options: DeviceOptions,
    /// Device buffers, reused by size class across selections.
    pub pool: Arc<BufferPool>,
    /// In-memory tables' columns kept on the device between queries.
    pub column_cache: column_cache::ColumnCache,
    /// Pinned host staging buffers, reused across selections.
    pub pinned: Arc<PinnedPool>,
    kernels: OnceLock<Result<Arc<Kernels>, String>>,
    /// The CUBIN cache directory the kernels were loaded with (generated code uses it too).
    cache_dir: OnceLock<Option<PathBuf>>,
    /// Generated programs loaded so far, by source text: the second run of a query compiles
    /// nothing. Each entry has its own lock, so that different programs compile in parallel
    /// and one program compiles once.
    generated: Mutex<HashMap<String, GeneratedSlot>>,
    /// How long the last compile (or disk-cache load) of a generated program took.
    last_compile: Mutex<Option<std::time::Duration>>,
    /// Engines of finished selections over resident tables, reused: a new one creates a
    /// stream and its buffers, which a query at device speed would notice.
    idle_engines: Mutex<Vec<TopKEngine>>,
}

impl fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("name", &self.name)
            .field("arch", &self.arch())
            .field("sm_count", &self.sm_count)
            .field("total_memory", &self.total_memory)
            .finish()
    }
}

impl GpuDevice {
    /// `sm_90` and the like: the NVRTC target for CUBIN.
    pub(crate) fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }

    /// Whether the engines launch kernels with programmatic dependent launch (Hopper on):
    /// each kernel is staged while the one before it drains and waits for its writes in its
    /// first statement (common.cuh `grid_dependency_wait`). `GPU_TOPK_PDL=0` turns it off (to
    /// measure it, or to rule it out).
    pub(crate) fn programmatic_launch(&self) -> bool {
        self.programmatic_launch
    }

    /// `name (arch, memory, kernels …)`: the kernels' origin once loaded, else where they
    /// will come from.
    pub fn describe(&self) -> String {
        let kernels = match self.kernels.get() {
            Some(Ok(kernels)) => kernels.describe_origin(),
            Some(Err(_)) => "kernels unusable".into(),
            None => kernels::expected_origin(&self.arch()),
        };
        format!(
            "{} ({}, {} GiB, {kernels})",
            self.name,
            self.arch(),
            self.total_memory >> 30
        )
    }

    /// The kernels, loaded on first use: precompiled where the build made images for this
    /// device, else compiled (or read from the on-disk cache in the default directory). A
    /// failure is remembered: the same sources would fail again.
    pub fn kernels(&self) -> GpuResult<Arc<Kernels>> {
        self.kernels_with_cache_dir(None)
    }

    /// As [`kernels`](Self::kernels), with the CUBIN cache in `cache_dir` (when this is the
    /// first call; later calls return the kernels loaded then).
    pub(crate) fn kernels_with_cache_dir(
        &self,
        cache_dir: Option<&Path>,
    ) -> GpuResult<Arc<Kernels>> {
        self.kernels
            .get_or_init(|| {
                let _ = self.cache_dir.set(cache_dir.map(Path::to_path_buf));
                let started = std::time::Instant::now();
                let loaded = Kernels::load(
                    &self.context,
                    &self.arch(),
                    self.driver_version,
                    self.max_shared_per_block,
                    cache_dir,
                );
                log::info!(
                    "loaded the kernels in {:.3} s",
                    started.elapsed().as_secs_f64()
                );
                loaded.map(Arc::new).map_err(|e| e.0)
            })
            .clone()
            .map_err(GpuError)
    }

    /// A generated program ([`crate::fusion`]), compiled on first use (or read from the disk
    /// cache) and then kept in memory, with the time this call spent compiling or loading it
    /// (zero when it was in memory). Compile errors are not remembered.
    pub fn generated_kernel(
        &self,
        source: &str,
        entry: &str,
    ) -> GpuResult<(Arc<GeneratedKernel>, std::time::Duration)> {
        watch::check(watch::DeviceOp::Compile)?;
        let cell = {
            let mut loaded = self.generated.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(loaded.entry(source.to_string()).or_default())
        };
        let mut slot = cell.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(kernel) = slot.as_ref() {
            return Ok((Arc::clone(kernel), std::time::Duration::ZERO));
        }
        let started = std::time::Instant::now();
        let generated = |cache_dir: Option<PathBuf>| {
            kernels::load_generated(
                &self.context,
                &self.arch(),
                self.driver_version,
                source,
                entry,
                cache_dir.as_deref(),
            )
        };
        let kernel = if self.kernels.get().is_some() {
            self.kernels()?;
            generated(self.cache_dir.get().cloned().flatten())?
        } else {
            // The kernels load (in the default cache directory, which the program then uses
            // too) while the program compiles: neither needs the other.
            let (kernels, kernel) = std::thread::scope(|scope| {
                let kernels = scope.spawn(|| self.kernels());
                let kernel = generated(None);
                let kernels = (kernels.join())
                    .unwrap_or_else(|_| Err(GpuError("loading the kernels panicked".into())));
                (kernels, kernel)
            });
            kernels?;
            kernel?
        };
        let kernel = Arc::new(kernel);
        *slot = Some(Arc::clone(&kernel));
        let took = started.elapsed();
        log::info!(
            "compiled or loaded a generated program in {:.3} s",
            took.as_secs_f64()
        );
        *self.last_compile.lock().unwrap_or_else(|e| e.into_inner()) = Some(took);
        Ok((kernel, took))
    }

    /// Whether the generated program with this source is loaded in this process, or its
    /// CUBIN is in the disk cache: running it then compiles nothing.
    pub(crate) fn has_generated_kernel(&self, source: &str) -> bool {
        let compiled = self.compiled(source);
        observed(|o| o.compiled.push((self.slot, source.to_string(), compiled)));
        compiled
    }

    /// [`has_generated_kernel`](Self::has_generated_kernel), unobserved.
    pub(crate) fn compiled(&self, source: &str) -> bool {
        let entry = {
            let loaded = self.generated.lock().unwrap_or_else(|e| e.into_inner());
            loaded.get(source).cloned()
        };
        let in_memory = entry.is_some_and(|e| e.lock().map(|k| k.is_some()).unwrap_or(false));
        in_memory || {
            let cache_dir = self.cache_dir.get().cloned().flatten();
            kernels::generated_on_disk(
                &self.arch(),
                self.driver_version,
                source,
                cache_dir.as_deref(),
            )
        }
    }

    /// How long this process's last compile (or cache load) of a generated program took.
    pub(crate) fn last_compile_time(&self) -> Option<std::time::Duration> {
        *self.last_compile.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new non-blocking stream on this device.
    /// An engine for keys of `kind`: an idle one ([`Self::idle_engine`]) or a new one.
    pub(crate) fn engine(self: &Arc<Self>, kind: KeyWidth) -> GpuResult<TopKEngine> {
        let idle = {
            let mut idle = self.idle_engines.lock().unwrap_or_else(|e| e.into_inner());
            let at = idle.iter().position(|e| e.kind() == kind);
            at.map(|at| idle.swap_remove(at))
        };
        match idle {
            Some(engine) => {
                self.context.bind_to_thread()?;
                Ok(engine)
            }
            None => TopKEngine::new(self, kind),
        }
    }

    /// Keeps an engine whose work completed without error for the next [`Self::engine`].
    pub(crate) fn idle_engine(&self, mut engine: TopKEngine) {
        engine.release_staging();
        let mut idle = self.idle_engines.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE_ENGINES {
            idle.push(engine);
        }
    }

    pub(crate) fn new_stream(&self) -> GpuResult<Arc<CudaStream>> {
        Ok(self.context.new_stream()?)
    }
}

/// Idle engines kept: about as many as queries run at once.
const MAX_IDLE_ENGINES: usize = 32;

/// The process's GPU, detected on first call.
pub fn gpu_status() -> &'static GpuStatus {
    STATUS.get_or_init(|| {
        let status = match contain_panics(detect) {
            Ok(Ok(device)) => GpuStatus::Available(Arc::new(device)),
            Ok(Err(reason)) => GpuStatus::Unavailable(reason),
            Err(panic) => {
                GpuStatus::Unavailable(format!("the CUDA libraries are unusable: {panic}"))
            }
        };
        planning_changed();
        status
    })
}

/// Runs `work`, turning a panic into its message. The CUDA bindings load their functions
/// lazily and panic when a library lacks one (a wrong or broken `libcuda`/`libnvrtc`), which
/// must make the GPU unusable, not take the process down.
/// The panic is reported as an error, so the default hook's message is kept off stderr.
pub(crate) fn contain_panics<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    thread_local! {
        static CONTAINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    // The panic hook is the process's: it is wrapped once, and stays quiet only on threads
    // inside `contain_panics`.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CONTAINED.with(|c| c.get()) {
                previous(info)
            }
        }));
    });
    let outer = CONTAINED.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    CONTAINED.with(|c| c.set(outer));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic without a message".into())
    })
}

/// The process's device, probed once ([`gpu_status`]). Process-wide: a CUDA context belongs
/// to the process, and every session shares its device and column cache.
static STATUS: OnceLock<GpuStatus> = OnceLock::new();

/// Counts the changes of the device state planning reads as a whole: its status, the
/// calibration, the column cache's budget. What it reads per query (whether a column is
/// resident, a program compiled) is observed instead ([`observe_planning`]). Process-wide, as
/// that state is.
static PLANNING_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The number of changes so far to the device state planning reads as a whole (whether the
/// device is started, the calibration, the column cache's budget): a physical plan built at
/// one value may be reused while the value holds and its [`PlanningObservations`] still do.
pub fn planning_generation() -> u64 {
    PLANNING_GENERATION.load(std::sync::atomic::Ordering::Acquire)
}

/// Records a change of the device state planning reads as a whole ([`planning_generation`]).
pub(crate) fn planning_changed() {
    PLANNING_GENERATION.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
}

/// What one planning read of the device's state, per column and program: a plan made from
/// it is as valid as [`PlanningObservations::hold`] says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanningObservations {
    /// Cache keys looked up on each device, and whether its cache held each.
    resident: Vec<(DeviceSlot, column_cache::CacheKey, bool)>,
    /// Generated programs asked about on each device, and whether each was compiled.
    compiled: Vec<(DeviceSlot, String, bool)>,
}

impl PlanningObservations {
    /// Whether the devices would answer every observation the same now.
    pub fn hold(&self) -> bool {
        if started_gpu().is_none() {
            return self.resident.iter().all(|(_, _, held)| !held)
                && self.compiled.iter().all(|(_, _, compiled)| !compiled);
        }
        // Every device observed was opened while planning: looking it up opens nothing.
        let device = |slot: &DeviceSlot| static_gpu_on(*slot);
        (self.resident.iter()).all(|(slot, key, held)| {
            device(slot).is_some_and(|d| d.column_cache.holds_key(key)) == *held
        }) && (self.compiled.iter()).all(|(slot, source, compiled)| {
            device(slot).is_some_and(|d| d.compiled(source)) == *compiled
        })
    }
}

tokio::task_local! {
    static OBSERVING: std::cell::RefCell<PlanningObservations>;
}

/// Runs `planning`, recording the per-column and per-program device state it reads.
pub async fn observe_planning<F: std::future::Future>(
    planning: F,
) -> (F::Output, PlanningObservations) {
    OBSERVING
        .scope(std::cell::RefCell::default(), async move {
            let output = planning.await;
            (output, OBSERVING.with(|o| o.take()))
        })
        .await
}

/// Records an answer about the device's state, where planning is being observed.
fn observed(record: impl FnOnce(&mut PlanningObservations)) {
    let _ = OBSERVING.try_with(|o| record(&mut o.borrow_mut()));
}

/// The status if the device was already probed, without probing it: planning asks this where
/// starting the device (a context, the kernels) could cost more than the query it plans.
pub fn probed_status() -> Option<&'static GpuStatus> {
    STATUS.get()
}

/// Whether probing the device would start a CUDA driver (slow) rather than find at once that
/// there is none (CUDA disabled, no driver library).
pub fn probe_is_slow() -> bool {
    // Process-wide: the libraries found do not change while it runs.
    static SLOW: OnceLock<bool> = OnceLock::new();
    *SLOW.get_or_init(|| {
        // SAFETY: only probes whether the shared library can be loaded.
        !DeviceOptions::process().disabled && unsafe { cudarc::driver::sys::is_culib_present() }
    })
}

/// The device if it is started and usable, without starting it.
pub fn started_gpu() -> Option<Arc<GpuDevice>> {
    probed_status()?.device().cloned()
}

/// The usable device, if any.
pub fn gpu() -> Option<Arc<GpuDevice>> {
    gpu_status().device().cloned()
}

/// One of the devices an operator may run on: a GPU (`ordinal`, as CUDA numbers them) and,
/// where a setting names that GPU more than once, which of its logical devices (`instance`),
/// each with its own buffers and column cache. `(0, 0)` is the process's device ([`gpu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeviceSlot {
    pub ordinal: usize,
    pub instance: usize,
}

impl fmt::Display for DeviceSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.instance {
            0 => write!(f, "{}", self.ordinal),
            n => write!(f, "{}#{n}", self.ordinal),
        }
    }
}

/// The devices of `ordinals` (GPUs as CUDA numbers them; one named twice is two logical
/// devices), in order.
pub fn slots(ordinals: &[usize]) -> Vec<DeviceSlot> {
    let mut seen = HashMap::<usize, usize>::new();
    (ordinals.iter())
        .map(|&ordinal| {
            let instance = seen.entry(ordinal).or_default();
            *instance += 1;
            DeviceSlot {
                ordinal,
                instance: *instance - 1,
            }
        })
        .collect()
}

/// The GPUs the driver reports, once the process's device is started (`None` before, so that
/// planning does not start it).
pub fn started_device_count() -> Option<usize> {
    // Process-wide: the driver's devices do not change while it runs.
    static COUNT: OnceLock<usize> = OnceLock::new();
    started_gpu()?;
    Some(*COUNT.get_or_init(|| CudaContext::device_count().map_or(1, |n| n.max(1) as usize)))
}

/// The device in `slot`, opened on first use; `(0, 0)` is [`gpu`]'s.
pub fn gpu_on(slot: DeviceSlot) -> Option<Arc<GpuDevice>> {
    static_gpu_on(slot).map(Arc::clone)
}

/// The devices opened besides the process's, by [`static_gpu_on`]. Process-wide, as
/// [`STATUS`] is.
static OTHERS: OnceLock<Mutex<HashMap<DeviceSlot, &'static GpuStatus>>> = OnceLock::new();

/// Every usable device opened so far: the process's (if started) and those [`gpu_on`] opened.
pub(crate) fn opened_devices() -> Vec<&'static Arc<GpuDevice>> {
    let mut devices: Vec<_> = probed_status()
        .and_then(GpuStatus::device)
        .into_iter()
        .collect();
    if let Some(others) = OTHERS.get() {
        let others = others.lock().unwrap_or_else(|e| e.into_inner());
        devices.extend(others.values().filter_map(|status| status.device()));
    }
    devices
}

/// [`gpu_on`], as the process keeps it: like the process's device, every device opened
/// lives as long as the process.
pub(crate) fn static_gpu_on(slot: DeviceSlot) -> Option<&'static Arc<GpuDevice>> {
    // The driver is initialised, and the libraries checked, by the process's device.
    let GpuStatus::Available(first) = gpu_status() else {
        return None;
    };
    if slot == DeviceSlot::default() {
        return Some(first);
    }
    let mut others =
        (OTHERS.get_or_init(Default::default).lock()).unwrap_or_else(|e| e.into_inner());
    let status: &'static GpuStatus = others.entry(slot).or_insert_with(|| {
        let opened = contain_panics(|| open(slot, DeviceOptions::process().clone()));
        Box::leak(Box::new(match opened {
            Ok(Ok(device)) => GpuStatus::Available(Arc::new(device)),
            Ok(Err(reason)) | Err(reason) => {
                log::warn!("gpu-topk: device {slot} unusable: {reason}");
                GpuStatus::Unavailable(reason)
            }
        }))
    });
    status.device()
}

fn detect() -> Result<GpuDevice, String> {
    let options = DeviceOptions::process().clone();
    if options.disabled {
        return Err(format!("CUDA disabled by {}", options::DISABLE_ENV));
    }
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda) found".into());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("no NVRTC library (libnvrtc) found".into());
    }
    // Resolve NVRTC now, so that a broken library is found here rather than at a query's compile.
    kernels::nvrtc_version()?;
    let count = CudaContext::device_count().map_err(|e| format!("CUDA driver error: {e}"))?;
    if count < 1 {
        return Err("the CUDA driver reports no device".into());
    }
    open(DeviceSlot::default(), options)
}

/// Opens GPU `ordinal` (the driver initialised) with its own pools, cache and kernels.
fn open(slot: DeviceSlot, options: DeviceOptions) -> Result<GpuDevice, String> {
    let ordinal = slot.ordinal;
    let context =
        CudaContext::new(ordinal).map_err(|e| format!("cannot open CUDA device {ordinal}: {e}"))?;
    let name = context.name().unwrap_or_else(|_| "unknown GPU".into());
    let compute_capability = context
        .compute_capability()
        .map_err(|e| format!("cannot read the compute capability: {e}"))?;
    let total_memory = context.total_mem().unwrap_or(0);
    let attribute = |a| {
        context
            .attribute(a)
            .map_err(|e| format!("cannot read device attribute {a:?}: {e}"))
    };
    let sm_count = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let max_shared_per_block =
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    let mut driver_version = 0;
    // SAFETY: the driver library is loaded and initialised (CudaContext::new succeeded).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| format!("cannot read the driver version: {e}"))?;
    Ok(GpuDevice {
        pool: Arc::new(BufferPool::new(Arc::clone(&context), total_memory / 4)),
        column_cache: column_cache::ColumnCache::new(total_memory, slot),
        slot,
        pinned: Arc::new(PinnedPool::new(Arc::clone(&context), 1 << 30)),
        context,
        name,
        compute_capability,
        total_memory,
        sm_count: sm_count.max(1) as usize,
        max_shared_per_block: max_shared_per_block.max(0) as usize,
        driver_version,
        programmatic_launch: compute_capability.0 >= 9 && options.programmatic_launch,
        options,
        kernels: OnceLock::new(),
        cache_dir: OnceLock::new(),
        generated: Mutex::new(HashMap::new()),
        last_compile: Mutex::new(None),
        idle_engines: Mutex::new(Vec::new()),
    })
}
