//! The kernels: plain CUDA C files in `kernels/`, compiled at run time by NVRTC to CUBIN for
//! the device's own architecture (`sm_90` on the H100; a virtual `compute_XY` target would give
//! PTX, not CUBIN), cached on disk, and loaded as one module per file.
//!
//! The sources are embedded with `include_str!`; setting `GPU_TOPK_KERNEL_DIR` reads them from
//! that directory instead, to iterate on kernels without rebuilding the crate. Headers (`.cuh`)
//! are handed to NVRTC by name, so `#include "common.cuh"` works as with nvcc.
//!
//! Cache: one file per (kernel file, architecture) in `GPU_TOPK_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/datafusion-gpu-topk`, else `~/.cache/datafusion-gpu-topk` (or a directory
//! passed in). The file name carries a hash of everything the CUBIN depends on (the program
//! and header texts, the options, the architecture, the NVRTC and driver versions); a header
//! with that key, the length and a checksum of the CUBIN detects truncated, corrupt or stale
//! files, which are rebuilt. Writes go to a temporary file renamed into place, so concurrent
//! processes never read a partial file.

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{Ptx, sys as nvrtc};

use super::{GpuError, GpuResult};

/// Environment variable: a directory to read the kernel sources from.
pub const KERNEL_DIR_ENV: &str = "GPU_TOPK_KERNEL_DIR";
/// Environment variable: the CUBIN cache directory.
pub const CACHE_DIR_ENV: &str = "GPU_TOPK_CACHE_DIR";

/// Every file of `kernels/`, embedded at build time.
pub const EMBEDDED: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    ("fused.cuh", include_str!("../../kernels/fused.cuh")),
    ("encode.cu", include_str!("../../kernels/encode.cu")),
    ("candidates.cu", include_str!("../../kernels/candidates.cu")),
    ("radix.cu", include_str!("../../kernels/radix.cu")),
    ("bitonic.cu", include_str!("../../kernels/bitonic.cu")),
    ("read_floor.cu", include_str!("../../kernels/read_floor.cu")),
    ("sample.cu", include_str!("../../kernels/sample.cu")),
    ("radix_sort.cu", include_str!("../../kernels/radix_sort.cu")),
    ("merge_sort.cu", include_str!("../../kernels/merge_sort.cu")),
    ("delegate.cu", include_str!("../../kernels/delegate.cu")),
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
];

/// Entry points without a key type.
const PLAIN_ENTRIES: &[(&str, &[&str])] = &[
    ("radix.cu", &["radix_init"]),
    ("radix_sort.cu", &["rsort_scan"]),
    ("merge_sort.cu", &["msort_merge_words"]),
    ("read_floor.cu", &["read_floor_w32", "read_floor_w64"]),
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
pub const KEY_SUFFIXES: &[&str] = &["k32", "k64", "k128", "k256"];

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
        match std::env::var_os(KERNEL_DIR_ENV) {
            Some(dir) if !dir.is_empty() => Self::from_dir(Path::new(&dir)),
            _ => Ok(Self::embedded()),
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

/// Whether the NVRTC library can be loaded (with dynamic loading, using it when it cannot
/// would panic).
pub fn nvrtc_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only probes whether the shared library can be loaded.
    *PRESENT.get_or_init(|| unsafe { nvrtc::is_culib_present() })
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    if !nvrtc_available() {
        return Err("no NVRTC library (libnvrtc) found".into());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; plain out-parameters.
    unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion failed: {e}"))?;
    Ok((major, minor))
}

/// The options every kernel is compiled with, then `extra`. `arch` must be a real
/// architecture (`sm_XY`), the only kind NVRTC makes CUBIN for.
fn options(arch: &str, extra: &[&str]) -> Result<Vec<String>, String> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.len() < 2
        || !digits
            .trim_end_matches('a')
            .chars()
            .all(|c| c.is_ascii_digit())
    {
        return Err(format!(
            "kernel target '{arch}' is not a real GPU architecture like sm_90 (NVRTC makes \
             CUBIN only for those)"
        ));
    }
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    opts.extend(extra.iter().map(|s| s.to_string()));
    Ok(opts)
}

/// A compiled program: the CUBIN and NVRTC's log (warnings; with `--ptxas-options=-v`, the
/// registers and spills of every kernel).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Destroys an NVRTC program on every path.
struct Program(nvrtc::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        let _ = unsafe { nvrtc::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn cstring(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

/// Compiles one program (`name` is its file name, for messages) with `headers` available to
/// `#include "…"`. Needs NVRTC only, no GPU. A compile error carries NVRTC's log.
pub fn compile_program(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: &str,
    extra: &[&str],
) -> Result<Compiled, String> {
    if !nvrtc_available() {
        return Err("no NVRTC library (libnvrtc) found".into());
    }
    let opts = options(arch, extra)?;
    let c_source = cstring(name, source)?;
    let c_name = cstring("program name", name)?;
    let c_headers: Vec<CString> = headers
        .iter()
        .map(|(n, t)| cstring(n, t))
        .collect::<Result<_, _>>()?;
    let c_includes: Vec<CString> = headers
        .iter()
        .map(|(n, _)| cstring("header name", n))
        .collect::<Result<_, _>>()?;
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| cstring("option", o))
        .collect::<Result<_, _>>()?;
    let header_ptrs: Vec<*const c_char> = c_headers.iter().map(|c| c.as_ptr()).collect();
    let include_ptrs: Vec<*const c_char> = c_includes.iter().map(|c| c.as_ptr()).collect();
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();

    // SAFETY: NVRTC is present; every pointer refers to a live NUL-terminated string for the
    // duration of the calls; the program is destroyed by `Program`'s Drop.
    unsafe {
        let mut raw = std::ptr::null_mut();
        nvrtc::nvrtcCreateProgram(
            &mut raw,
            c_source.as_ptr(),
            c_name.as_ptr(),
            header_ptrs.len() as i32,
            header_ptrs.as_ptr(),
            include_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| format!("nvrtcCreateProgram({name}) failed: {e}"))?;
        let program = Program(raw);
        let compiled =
            nvrtc::nvrtcCompileProgram(program.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr())
                .result();
        let log = program_log(&program);
        if let Err(e) = compiled {
            return Err(format!(
                "NVRTC could not compile {name} for {arch} ({e}), options {opts:?}:\n{log}"
            ));
        }
        let mut size = 0usize;
        nvrtc::nvrtcGetCUBINSize(program.0, &mut size)
            .result()
            .map_err(|e| format!("nvrtcGetCUBINSize({name}) failed: {e}"))?;
        if size == 0 {
            return Err(format!("NVRTC produced no CUBIN for {name} ({arch})"));
        }
        let mut cubin = vec![0u8; size];
        nvrtc::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char)
            .result()
            .map_err(|e| format!("nvrtcGetCUBIN({name}) failed: {e}"))?;
        Ok(Compiled { cubin, log })
    }
}

/// # Safety
/// `program` must hold a created NVRTC program.
unsafe fn program_log(program: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: per the function contract.
    if unsafe { nvrtc::nvrtcGetProgramLogSize(program.0, &mut size) }
        .result()
        .is_err()
        || size == 0
    {
        return String::new();
    }
    let mut log = vec![0u8; size];
    // SAFETY: `log` has the size NVRTC asked for.
    if unsafe { nvrtc::nvrtcGetProgramLog(program.0, log.as_mut_ptr() as *mut c_char) }
        .result()
        .is_err()
    {
        return String::new();
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    String::from_utf8_lossy(&log[..end]).trim_end().to_string()
}

/// Compiles CUDA C `source` (which may include the kernel headers) to CUBIN for `arch`
/// (`sm_90`), with `opts` after the default options. NVRTC alone, no GPU needed.
pub fn compile_cubin(source: &str, arch: &str, opts: &[&str]) -> Result<Vec<u8>, String> {
    let sources = KernelSources::load()?;
    compile_program("program.cu", source, &sources.headers(), arch, opts).map(|c| c.cubin)
}

// ---- the on-disk cache ---------------------------------------------------------------------

const CACHE_MAGIC: &[u8; 8] = b"GTKCUBIN";
const CACHE_FORMAT: u32 = 1;
const CACHE_HEADER: usize = 48;

/// The cache directory when none is passed: `GPU_TOPK_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/datafusion-gpu-topk`, else `~/.cache/datafusion-gpu-topk`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(CACHE_DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(xdg).join("datafusion-gpu-topk"));
    }
    var("HOME").map(|home| {
        PathBuf::from(home)
            .join(".cache")
            .join("datafusion-gpu-topk")
    })
}

/// FNV-1a, 64 bits, from `basis`.
fn fnv1a(basis: u64, data: &[u8]) -> u64 {
    data.iter().fold(basis, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn checksum(data: &[u8]) -> u64 {
    fnv1a(0xcbf2_9ce4_8422_2325, data)
}

/// 128-bit key of everything a CUBIN depends on (length-prefixed, so fields cannot run into
/// each other).
pub fn cache_key(parts: &[&[u8]]) -> u128 {
    let mut data = Vec::new();
    for part in parts {
        data.extend_from_slice(&(part.len() as u64).to_le_bytes());
        data.extend_from_slice(part);
    }
    let lo = fnv1a(0xcbf2_9ce4_8422_2325, &data);
    let hi = fnv1a(0x6c62_272e_07bb_0142, &data);
    (u128::from(hi) << 64) | u128::from(lo)
}

/// Reads a cache file; `None` when missing, truncated, corrupt or for another key.
pub fn read_cache_file(path: &Path, key: u128) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    if data.len() < CACHE_HEADER || &data[0..8] != CACHE_MAGIC {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().unwrap());
    let stored_key = u128::from_le_bytes(data[16..32].try_into().unwrap());
    let len = u64_at(32) as usize;
    let payload = &data[CACHE_HEADER..];
    (u32_at(8) == CACHE_FORMAT
        && stored_key == key
        && payload.len() == len
        && checksum(payload) == u64_at(40))
    .then(|| payload.to_vec())
}

/// Writes a cache file atomically (temporary file, then rename).
pub fn write_cache_file(path: &Path, key: u128, cubin: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut data = Vec::with_capacity(CACHE_HEADER + cubin.len());
    data.extend_from_slice(CACHE_MAGIC);
    data.extend_from_slice(&CACHE_FORMAT.to_le_bytes());
    data.extend_from_slice(&0u32.to_le_bytes());
    data.extend_from_slice(&key.to_le_bytes());
    data.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    data.extend_from_slice(&checksum(cubin).to_le_bytes());
    data.extend_from_slice(cubin);
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The CUBIN of program `name`: from the cache when a valid entry exists, else compiled (and
/// stored; a cache that cannot be written only costs a recompilation next time).
pub fn cubin_cached(
    name: &str,
    sources: &KernelSources,
    arch: &str,
    extra: &[&str],
    driver_version: i32,
    cache_dir: Option<&Path>,
) -> Result<Vec<u8>, String> {
    let source = sources
        .get(name)
        .ok_or_else(|| format!("no kernel source named {name}"))?;
    cubin_cached_with(
        name,
        source,
        sources,
        arch,
        extra,
        driver_version,
        cache_dir,
        |h| compile_program(name, source, h, arch, extra).map(|c| c.cubin),
    )
}

/// The CUBIN of a program text (a kernel file, or generated code, which may include the
/// kernel headers): from the cache, else compiled by `compile` (given the headers) and stored.
/// `extra` keys the cache entry.
#[allow(clippy::too_many_arguments)]
fn cubin_cached_with(
    name: &str,
    source: &str,
    sources: &KernelSources,
    arch: &str,
    extra: &[&str],
    driver_version: i32,
    cache_dir: Option<&Path>,
    compile: impl FnOnce(&[(&str, &str)]) -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, String> {
    let headers = sources.headers();
    let (path, key) = source_cache_file(
        name,
        source,
        sources,
        arch,
        extra,
        driver_version,
        cache_dir,
    )?;
    if let Some(path) = path.as_deref()
        && path.exists()
    {
        match read_cache_file(path, key) {
            Some(cubin) => return Ok(cubin),
            None => log::warn!(
                "kernel cache file {} is corrupt or stale: compiling it again",
                path.display()
            ),
        }
    }
    let cubin = compile(&headers)?;
    if let Some(path) = &path
        && let Err(e) = write_cache_file(path, key, &cubin)
    {
        log::warn!("cannot write the kernel cache file {}: {e}", path.display());
    }
    Ok(cubin)
}

/// The cache file (when there is a cache directory) and key of a program text.
fn source_cache_file(
    name: &str,
    source: &str,
    sources: &KernelSources,
    arch: &str,
    extra: &[&str],
    driver_version: i32,
    cache_dir: Option<&Path>,
) -> Result<(Option<PathBuf>, u128), String> {
    let headers = sources.headers();
    let (major, minor) = nvrtc_version()?;
    let opts = options(arch, extra)?;
    let versions = format!("nvrtc {major}.{minor} driver {driver_version}");
    let mut parts: Vec<&[u8]> = vec![name.as_bytes(), source.as_bytes()];
    for (n, t) in &headers {
        parts.push(n.as_bytes());
        parts.push(t.as_bytes());
    }
    let opts_text = opts.join(" ");
    parts.push(opts_text.as_bytes());
    parts.push(arch.as_bytes());
    parts.push(versions.as_bytes());
    let key = cache_key(&parts);

    let dir = cache_dir.map(Path::to_path_buf).or_else(default_cache_dir);
    let stem = name.trim_end_matches(".cu");
    let path = dir.map(|d| d.join(format!("{stem}-{arch}-{key:032x}.cubin")));
    Ok((path, key))
}

/// Whether a generated program's CUBIN is in the disk cache (a load, not a compile, away).
pub fn generated_on_disk(
    arch: &str,
    driver_version: i32,
    source: &str,
    cache_dir: Option<&Path>,
) -> bool {
    let Ok(sources) = KernelSources::load() else {
        return false;
    };
    source_cache_file(
        "generated.cu",
        source,
        &sources,
        arch,
        GENERATED_CACHE_OPTIONS,
        driver_version,
        cache_dir,
    )
    .ok()
    .and_then(|(path, key)| path.and_then(|p| read_cache_file(&p, key)))
    .is_some()
}

// ---- loaded modules --------------------------------------------------------------------------

/// Every kernel, loaded into a context, by entry-point name.
pub struct Kernels {
    functions: HashMap<String, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
    arch: String,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("arch", &self.arch)
            .field("functions", &self.functions.len())
            .finish()
    }
}

impl Kernels {
    /// Compiles (or reads from the cache) and loads every kernel file for `arch`, and lets the
    /// shared-memory-hungry kernels use up to `max_shared` bytes.
    pub fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        driver_version: i32,
        max_shared: usize,
        cache_dir: Option<&Path>,
    ) -> GpuResult<Self> {
        let sources = KernelSources::load()?;
        let mut functions = HashMap::new();
        let mut modules = Vec::new();
        for (name, _) in sources.programs() {
            let cubin = cubin_cached(name, &sources, arch, &[], driver_version, cache_dir)?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| GpuError(format!("cannot load the {name} module: {e}")))?;
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
        }
        Ok(Self {
            functions,
            _modules: modules,
            arch: arch.to_string(),
        })
    }

    /// The kernel named `name`.
    pub fn get(&self, name: &str) -> GpuResult<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| GpuError(format!("no kernel named {name} is loaded")))
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }
}

// ---- generated programs ----------------------------------------------------------------------

/// NVRTC options of generated code: no contraction of `a * b + c` into an FMA, whose single
/// rounding would differ from the host's two.
pub const GENERATED_OPTIONS: &[&str] = &["--fmad=false"];

/// The generated kernel's `__launch_bounds__` minimum of resident blocks a SM
/// (`FUSED_MIN_BLOCKS`): ptxas then keeps a thread to 51 registers. On the H100
/// (250M rows, one call), against no minimum: Q3's program went from 57 registers and 4 blocks
/// a SM to 5 blocks with 56 bytes of spill traffic, and its pass from 1.067 to 1.034× its read
/// floor; Q1's and Q2's (48 registers or fewer already) within noise; 6 blocks (40 registers)
/// made Q1's pass 4% slower. A program that spills more than [`GENERATED_SPILL_ALLOWANCE`]
/// under it is compiled without it ([`compile_generated`]).
pub const GENERATED_MIN_BLOCKS: u32 = 5;

/// Bytes of spill stores and loads (ptxas) that a generated program may take for
/// [`GENERATED_MIN_BLOCKS`]: Q3's 56 cost less than its fifth resident block gained; larger
/// spills (up to ~200 bytes in the fusion tests' programs) are not measured, so those keep
/// their registers.
pub const GENERATED_SPILL_ALLOWANCE: u64 = 64;

/// The cache entry of a generated program names the rule that compiled it.
const GENERATED_CACHE_OPTIONS: &[&str] = &[
    "--fmad=false",
    "-DFUSED_PIPELINE=1?,FUSED_MIN_BLOCKS=5,spill<=64",
];
const _: () = assert!(
    GENERATED_MIN_BLOCKS == 5 && GENERATED_SPILL_ALLOWANCE == 64,
    "GENERATED_CACHE_OPTIONS names the rule"
);

/// A generated program compiled by [`compile_generated`].
#[derive(Debug, Clone)]
pub struct GeneratedCompile {
    pub cubin: Vec<u8>,
    /// The `FUSED_MIN_BLOCKS` it was compiled with: [`GENERATED_MIN_BLOCKS`], or 1.
    pub min_blocks: u32,
    /// Bytes of spill stores and loads that ptxas reported.
    pub spill_bytes: u64,
    /// Whether its full pass fetches a round ahead (`FUSED_PIPELINE`).
    pub pipelined: bool,
}

/// Compiles a generated program with [`GENERATED_MIN_BLOCKS`], its full pass pipelined
/// (`FUSED_PIPELINE`: each round's loads issued before the previous round is evaluated) where
/// that fits the hint without spilling more than [`GENERATED_SPILL_ALLOWANCE`], else not; when
/// that still spills more, again without the hint, and keeps the one that spills less (the
/// hinted one on a tie). NVRTC only.
pub fn compile_generated(
    source: &str,
    headers: &[(&str, &str)],
    arch: &str,
) -> Result<GeneratedCompile, String> {
    let variant = |min_blocks: u32, pipelined: bool| {
        let define = format!("-DFUSED_MIN_BLOCKS={min_blocks}");
        let pipeline = format!("-DFUSED_PIPELINE={}", u8::from(pipelined));
        let mut opts = GENERATED_OPTIONS.to_vec();
        opts.extend([define.as_str(), pipeline.as_str(), "--ptxas-options=-v"]);
        compile_program("generated.cu", source, headers, arch, &opts).map(|c| GeneratedCompile {
            spill_bytes: spill_bytes(&c.log),
            cubin: c.cubin,
            min_blocks,
            pipelined,
        })
    };
    // Pipelined where it fits: Q2's pass 669–670 → 649–651 µs over 2 GB (its read floor,
    // 651), 707 → 681–683 at k = 10^6 (H100). At 4 blocks a SM it measured no
    // better than at 5. Both hinted variants compile at once, so that a program that does not
    // fit pipelined waits for one compile, not two.
    let (pipelined, hinted) = std::thread::scope(|scope| {
        let other = scope.spawn(|| variant(GENERATED_MIN_BLOCKS, false));
        let pipelined = variant(GENERATED_MIN_BLOCKS, true);
        let hinted = other
            .join()
            .unwrap_or_else(|_| Err("the NVRTC compile thread panicked".to_string()));
        (pipelined, hinted)
    });
    let pipelined = pipelined?;
    if pipelined.spill_bytes <= GENERATED_SPILL_ALLOWANCE {
        return Ok(pipelined);
    }
    let hinted = hinted?;
    if hinted.spill_bytes <= GENERATED_SPILL_ALLOWANCE {
        return Ok(hinted);
    }
    let plain = variant(1, false)?;
    Ok(if plain.spill_bytes < hinted.spill_bytes {
        plain
    } else {
        hinted
    })
}

/// The spill stores and loads (bytes) in a `--ptxas-options=-v` log, over every function.
pub fn spill_bytes(log: &str) -> u64 {
    let mut total = 0;
    for line in log.lines() {
        for what in [" bytes spill stores", " bytes spill loads"] {
            if let Some(before) = line.split(what).next().filter(|_| line.contains(what)) {
                let digits = before.rsplit(|c: char| !c.is_ascii_digit()).next();
                total += digits.and_then(|d| d.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    total
}

/// A generated program (see [`crate::fusion`]), compiled and loaded.
pub struct GeneratedKernel {
    pub function: CudaFunction,
    _module: Arc<CudaModule>,
    /// Time spent in NVRTC (zero when the CUBIN came from the disk cache).
    pub compile_time: std::time::Duration,
    /// Blocks of [`GENERATED_THREADS`] threads resident on one SM (its registers and shared
    /// memory decide): the pass's grid is one wave of them.
    pub blocks_per_sm: u32,
}

/// Threads per block of a generated kernel (its `__launch_bounds__`).
pub const GENERATED_THREADS: u32 = 256;

impl std::fmt::Debug for GeneratedKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeneratedKernel")
            .field("compile_time", &self.compile_time)
            .finish()
    }
}

/// Compiles (or reads from the disk cache) and loads a generated program with entry `entry`.
pub fn load_generated(
    ctx: &Arc<CudaContext>,
    arch: &str,
    driver_version: i32,
    source: &str,
    entry: &str,
    cache_dir: Option<&Path>,
) -> GpuResult<GeneratedKernel> {
    let sources = KernelSources::load()?;
    let start = std::time::Instant::now();
    let cubin = cubin_cached_with(
        "generated.cu",
        source,
        &sources,
        arch,
        GENERATED_CACHE_OPTIONS,
        driver_version,
        cache_dir,
        |headers| compile_generated(source, headers, arch).map(|c| c.cubin),
    )?;
    let compile_time = start.elapsed();
    let module = ctx
        .load_module(Ptx::from_binary(cubin))
        .map_err(|e| GpuError(format!("cannot load a generated module: {e}")))?;
    let function = module.load_function(entry).map_err(|e| {
        GpuError(format!(
            "kernel {entry} is missing from generated code: {e}"
        ))
    })?;
    let blocks_per_sm = function
        .occupancy_max_active_blocks_per_multiprocessor(GENERATED_THREADS, 0, None)
        .map_err(|e| GpuError(format!("occupancy of a generated kernel: {e}")))?
        .max(1);
    Ok(GeneratedKernel {
        function,
        _module: module,
        compile_time,
        blocks_per_sm,
    })
}
