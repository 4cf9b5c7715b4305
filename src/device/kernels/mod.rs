//! The kernels: plain CUDA C files in `kernels/`, loaded as one module per file.
//!
//! Precompiled: a release build with NVRTC at hand (build.rs) compiles every file to CUBIN for
//! sm_80, sm_90, sm_100 and sm_120 (and, on request, to compute_90 PTX) and embeds the images
//! ([`PRECOMPILED_KERNELS`]). A device loads its own architecture's CUBIN, else that of the
//! newest older minor version of its major one (sm_86 runs sm_80's), else the PTX, which the
//! driver compiles ([`choose_target`]); that path never calls NVRTC. An image the driver
//! refuses (a driver older than the build's NVRTC) is compiled instead, with a warning.
//!
//! Compiled: otherwise, and for sources read from `GPU_TOPK_KERNEL_DIR` (to iterate on kernels
//! without rebuilding the crate), NVRTC compiles each file to CUBIN for the device's own
//! architecture (`sm_90` on the H100), the files on parallel threads. Headers (`.cuh`) are
//! handed to NVRTC by name, so `#include "common.cuh"` works as with nvcc. [`Kernels`] records
//! where each module came from ([`ModuleOrigin`]); the device's description says it.
//!
//! Cache: compiled CUBIN is kept, one file per (kernel file, architecture), in
//! `GPU_TOPK_CACHE_DIR`, else `$XDG_CACHE_HOME/datafusion-gpu-topk`, else
//! `~/.cache/datafusion-gpu-topk` (or a directory passed in). The file name carries a hash of
//! everything the CUBIN depends on (the program and header texts, the options, the
//! architecture, the NVRTC and driver versions); a header with that key, the length and a
//! checksum of the CUBIN detects truncated, corrupt or stale files, which are rebuilt. Writes
//! go to a temporary file renamed into place, so concurrent processes never read a partial
//! file. Generated programs (`generated.rs`) are always compiled and cached this way.

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{Ptx, sys as nvrtc};

use super::{GpuError, GpuResult};

use super::options::DeviceOptions;

/// Every file of `kernels/`, embedded at build time.
pub const EMBEDDED: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("fused.cuh", include_str!("../../../kernels/fused.cuh")),
    (
        "aggregate.cuh",
        include_str!("../../../kernels/aggregate.cuh"),
    ),
    ("encode.cu", include_str!("../../../kernels/encode.cu")),
    (
        "candidates.cu",
        include_str!("../../../kernels/candidates.cu"),
    ),
    ("radix.cu", include_str!("../../../kernels/radix.cu")),
    ("bitonic.cu", include_str!("../../../kernels/bitonic.cu")),
    (
        "read_floor.cu",
        include_str!("../../../kernels/read_floor.cu"),
    ),
    ("sample.cu", include_str!("../../../kernels/sample.cu")),
    (
        "radix_sort.cu",
        include_str!("../../../kernels/radix_sort.cu"),
    ),
    (
        "merge_sort.cu",
        include_str!("../../../kernels/merge_sort.cu"),
    ),
    ("delegate.cu", include_str!("../../../kernels/delegate.cu")),
    ("groups.cu", include_str!("../../../kernels/groups.cu")),
    ("parquet.cu", include_str!("../../../kernels/parquet.cu")),
    (
        "aggregate.cu",
        include_str!("../../../kernels/aggregate.cu"),
    ),
];

/// Entry points instantiated once per key type (`NAME_k32` … `NAME_k256`), per file.
const KEYED_ENTRIES: &[(&str, &[&str])] = &[
    ("encode.cu", &["encode_column"]),
    (
        "candidates.cu",
        &[
            "append",
            "pair_max",
            "threshold_from",
            "filter_below",
            "filter_fraction",
            "key_span",
        ],
    ),
    ("radix.cu", &["radix_masks", "radix_hist", "radix_filter"]),
    (
        "bitonic.cu",
        &[
            "bitonic_topk",
            "bitonic_sort_local",
            "bitonic_sort_step",
            "bitonic_merge_local",
            "bitonic_rank_sort",
            "bitonic_chunk_sort",
            "bitonic_chunk_rank",
            "bitonic_chunk_scatter",
            "bitonic_sort_segments",
        ],
    ),
    (
        "sample.cu",
        &["sample_threshold", "filter_pairs", "refine_threshold"],
    ),
    (
        "radix_sort.cu",
        &[
            "rsort_hist",
            "rsort_pass",
            "rsort_pass_wide",
            "rsort_count",
            "rsort_top_hist",
            "rsort_top_scatter",
        ],
    ),
    (
        "merge_sort.cu",
        &[
            "msort_tiles",
            "msort_merge",
            "msort_tiles_packed",
            "msort_merge_unpack",
        ],
    ),
    ("delegate.cu", &["delegate_min", "delegate_gather"]),
    (
        "groups.cu",
        &[
            "group_count",
            "group_write",
            "group_sample",
            "group_filter",
            "group_min_word",
            "group_min_filter",
        ],
    ),
];

/// Entry points without a key type.
const PLAIN_ENTRIES: &[(&str, &[&str])] = &[
    ("radix.cu", &["radix_init"]),
    ("radix_sort.cu", &["rsort_scan"]),
    ("merge_sort.cu", &["msort_merge_words"]),
    ("read_floor.cu", &["read_floor_w32", "read_floor_w64"]),
    ("groups.cu", &["group_scan", "group_gather"]),
    ("parquet.cu", &["parquet_decode"]),
    (
        "aggregate.cu",
        &[
            "agg_columns_w1",
            "agg_compact_w1",
            "agg_rank_w1",
            "agg_gather_w1",
            "agg_outputs_w1",
            "agg_columns_w2",
            "agg_compact_w2",
            "agg_rank_w2",
            "agg_gather_w2",
            "agg_outputs_w2",
        ],
    ),
];

/// Entry points that take more than 48 KiB of dynamic shared memory.
const LARGE_SHARED: &[&str] = &[
    "bitonic_topk",
    "bitonic_sort_local",
    "bitonic_merge_local",
    "bitonic_chunk_sort",
    "bitonic_chunk_rank",
    "rsort_pass_wide",
];

/// Suffixes of the key types, see `INSTANTIATE_KEYS` in common.cuh.
pub(crate) const KEY_SUFFIXES: &[&str] = &["k32", "k64", "k128", "k256"];

/// The names of a kernel file's entry points.
pub fn entry_points(file: &str) -> Vec<String> {
    let keyed = KEYED_ENTRIES
        .iter()
        .filter(|(f, _)| *f == file)
        .flat_map(|(_, names)| names.iter())
        .flat_map(|name| KEY_SUFFIXES.iter().map(move |s| format!("{name}_{s}")));
    let plain = PLAIN_ENTRIES
        .iter()
        .filter(|(f, _)| *f == file)
        .flat_map(|(_, names)| names.iter().map(|n| n.to_string()));
    keyed.chain(plain).collect()
}

/// The `__global__` functions of a CUDA source whose body does not begin with
/// `grid_dependency_wait();` (common.cuh), by the start of their signature. The engine
/// launches kernels with programmatic stream serialisation: a kernel that touched memory before
/// that wait could read what the previous kernel has not yet made visible.
pub fn kernels_without_dependency_wait(source: &str) -> Vec<String> {
    let mut missing = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("__global__") {
        let from = &rest[at..];
        let Some(open) = from.find('{') else {
            missing.push(from.chars().take(80).collect());
            break;
        };
        // Continuation backslashes of a macro definition are not statements.
        let body = from[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        if !body.starts_with("grid_dependency_wait();") {
            missing.push(
                from[..open]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        rest = &from[open..];
    }
    missing
}

/// The kernel files' texts, by file name.
#[derive(Debug, Clone)]
pub struct KernelSources {
    files: Vec<(String, String)>,
}

impl KernelSources {
    /// The sources embedded in the binary.
    pub fn embedded() -> Self {
        Self {
            files: EMBEDDED
                .iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect(),
        }
    }

    /// The same files read from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, String> {
        let files = EMBEDDED
            .iter()
            .map(|(name, _)| {
                let path = dir.join(name);
                std::fs::read_to_string(&path)
                    .map(|text| (name.to_string(), text))
                    .map_err(|e| format!("cannot read kernel source {}: {e}", path.display()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { files })
    }

    /// From `GPU_TOPK_KERNEL_DIR` when set, else embedded.
    pub fn load() -> Result<Self, String> {
        match &DeviceOptions::process().kernel_dir {
            Some(dir) => Self::from_dir(dir),
            None => Ok(Self::embedded()),
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// The headers (`.cuh`), as (include name, text).
    pub fn headers(&self) -> Vec<(&str, &str)> {
        self.files
            .iter()
            .filter(|(n, _)| n.ends_with(".cuh"))
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect()
    }

    /// The programs (`.cu`), as (file name, text).
    pub fn programs(&self) -> Vec<(&str, &str)> {
        self.files
            .iter()
            .filter(|(n, _)| n.ends_with(".cu"))
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect()
    }
}

mod compile;
mod cubin_cache;
mod embedded;
mod generated;

pub use compile::*;
pub use cubin_cache::*;
pub use embedded::*;
pub use generated::*;

// ---- loaded modules --------------------------------------------------------------------------

/// Every kernel, loaded into a context, by entry-point name.
pub struct Kernels {
    functions: HashMap<String, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
    /// Where each kernel file's module came from, by file name.
    origins: Vec<(String, ModuleOrigin)>,
    arch: String,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("arch", &self.arch)
            .field("functions", &self.functions.len())
            .field("origins", &self.origins)
            .finish()
    }
}

impl Kernels {
    /// Loads every kernel file for `arch`: the precompiled image where the sources are the
    /// embedded ones and the build made one for this device, else compiled by NVRTC (or read
    /// from the cache); lets the shared-memory-hungry kernels use up to `max_shared` bytes.
    pub fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        driver_version: i32,
        max_shared: usize,
        cache_dir: Option<&Path>,
    ) -> GpuResult<Self> {
        let nvrtc = NvrtcUse::Allowed {
            driver_version,
            cache_dir,
        };
        Self::load_with(ctx, arch, max_shared, nvrtc)
    }

    /// As [`load`](Self::load), from the precompiled images alone: never calls NVRTC, and
    /// fails where the build made no image this device can load.
    pub fn load_embedded_only(
        ctx: &Arc<CudaContext>,
        arch: &str,
        max_shared: usize,
    ) -> GpuResult<Self> {
        Self::load_with(ctx, arch, max_shared, NvrtcUse::Forbidden)
    }

    fn load_with(
        ctx: &Arc<CudaContext>,
        arch: &str,
        max_shared: usize,
        nvrtc: NvrtcUse<'_>,
    ) -> GpuResult<Self> {
        let sources = KernelSources::load()?;
        let embedded = DeviceOptions::process().kernel_dir.is_none();
        let mut loaded = Vec::new();
        let mut to_compile = Vec::new();
        for (name, _) in sources.programs() {
            match embedded.then(|| load_embedded(ctx, name, arch)).flatten() {
                Some(Ok(module)) => loaded.push((name, module)),
                Some(Err(e)) if matches!(nvrtc, NvrtcUse::Allowed { .. }) => {
                    log::warn!("{e}: compiling it with NVRTC");
                    to_compile.push(name);
                }
                Some(Err(e)) => return Err(GpuError(e)),
                None if matches!(nvrtc, NvrtcUse::Allowed { .. }) => to_compile.push(name),
                None => {
                    return Err(GpuError(format!(
                        "no precompiled {name} for {arch} in this build ({})",
                        describe_missing()
                    )));
                }
            }
        }
        if let NvrtcUse::Allowed {
            driver_version,
            cache_dir,
        } = nvrtc
        {
            for (name, compiled) in
                compile_all(&to_compile, &sources, arch, driver_version, cache_dir)
            {
                let (cubin, origin) = compiled?;
                let module = ctx
                    .load_module(Ptx::from_binary(cubin))
                    .map_err(|e| GpuError(format!("cannot load the {name} module: {e}")))?;
                loaded.push((name, (module, origin)));
            }
        }
        let mut functions = HashMap::new();
        let mut modules = Vec::new();
        let mut origins = Vec::new();
        for (name, (module, origin)) in loaded {
            for entry in entry_points(name) {
                let function = module
                    .load_function(&entry)
                    .map_err(|e| GpuError(format!("kernel {entry} is missing from {name}: {e}")))?;
                if LARGE_SHARED.iter().any(|p| entry.starts_with(p)) && max_shared > 48 * 1024 {
                    // The block's static shared memory counts against the same limit.
                    let fixed = function.shared_size_bytes()?.max(0) as usize;
                    function.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        max_shared.saturating_sub(fixed) as i32,
                    )?;
                }
                functions.insert(entry, function);
            }
            modules.push(module);
            origins.push((name.to_string(), origin));
        }
        Ok(Self {
            functions,
            _modules: modules,
            origins,
            arch: arch.to_string(),
        })
    }

    /// The kernel named `name`.
    pub fn get(&self, name: &str) -> GpuResult<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| GpuError(format!("no kernel named {name} is loaded")))
    }

    /// Where each kernel file's module came from, by file name.
    pub fn origins(&self) -> &[(String, ModuleOrigin)] {
        &self.origins
    }

    /// `kernels precompiled for sm_90`, `kernels compiled by NVRTC`, …
    pub fn describe_origin(&self) -> String {
        describe_origins(self.origins.iter().map(|(_, o)| *o))
    }
}

/// Whether [`Kernels::load_with`] may compile what has no precompiled image.
#[derive(Clone, Copy)]
enum NvrtcUse<'a> {
    Allowed {
        driver_version: i32,
        cache_dir: Option<&'a Path>,
    },
    Forbidden,
}

/// Loads the precompiled image of `name` for `arch`; `None` where the build made none.
fn load_embedded(
    ctx: &Arc<CudaContext>,
    name: &str,
    arch: &str,
) -> Option<Result<(Arc<CudaModule>, ModuleOrigin), String>> {
    let (target, image) = embedded_image(name, arch)?;
    let (module, origin) = match parse_target(target) {
        Some((_, true)) => {
            let text = String::from_utf8_lossy(image).into_owned();
            (Ptx::from_src(text), ModuleOrigin::Ptx(target))
        }
        _ => (
            Ptx::from_binary(image.to_vec()),
            ModuleOrigin::Precompiled(target),
        ),
    };
    Some(
        ctx.load_module(module)
            .map(|m| (m, origin))
            .map_err(|e| format!("cannot load the precompiled {name} ({target}): {e}")),
    )
}

/// Why the build has no image for a device (for an error message).
fn describe_missing() -> String {
    match (PRECOMPILED, PRECOMPILED_NOTE) {
        (true, _) => {
            let targets: std::collections::BTreeSet<&str> =
                PRECOMPILED_KERNELS.iter().map(|(_, t, _)| *t).collect();
            let targets: Vec<&str> = targets.into_iter().collect();
            format!("it has {}", targets.join(", "))
        }
        (false, "") => "it precompiled none".into(),
        (false, why) => format!("it precompiled none: {why}"),
    }
}

/// A kernel file's CUBIN and where it came from, or why there is none.
type Built = Result<(Vec<u8>, ModuleOrigin), String>;

/// Compiles (or reads from the cache) each of `names`, on up to as many threads as the host
/// has cores: NVRTC compiles one program on one thread.
fn compile_all<'n>(
    names: &[&'n str],
    sources: &KernelSources,
    arch: &str,
    driver_version: i32,
    cache_dir: Option<&Path>,
) -> Vec<(&'n str, Built)> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(names.len()) {
            scope.spawn(|| {
                while let Some(&name) =
                    names.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                {
                    let compiled = sources
                        .get(name)
                        .ok_or_else(|| format!("no kernel source named {name}"))
                        .and_then(|source| {
                            cubin_cached_with(
                                name,
                                source,
                                sources,
                                arch,
                                &[],
                                driver_version,
                                cache_dir,
                                |h| compile_program(name, source, h, arch, &[]).map(|c| c.cubin),
                            )
                        });
                    results
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((name, compiled));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    // In file order, as the modules load.
    results.sort_by_key(|(name, _)| names.iter().position(|n| n == name));
    results
}
