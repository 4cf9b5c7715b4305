//! Precompiles the built-in kernels (`kernels/*.cu`) with NVRTC, so that a fresh process loads
//! them instead of compiling them at its first query: CUBIN for each of [`CUBIN_TARGETS`] and,
//! on request, PTX for [`PTX_TARGET`] (which the driver compiles for GPUs of a later major
//! version), written
//! to `OUT_DIR` with `precompiled.rs`, a table that embeds them (`src/device/kernels/embedded.rs`).
//!
//! NVRTC is loaded dynamically (`libnvrtc.so.13`, found through `LD_LIBRARY_PATH` or the
//! linker cache; `.ci/install-nvrtc.sh` installs it). Without it the table is empty and the
//! kernels compile at run time as before. A kernel that does not compile fails the build.
//!
//! When: release builds (what users run and `cargo test --release`), unless
//! `GPU_TOPK_PRECOMPILE=0`; other profiles (`cargo check`, debug tests) only with
//! `GPU_TOPK_PRECOMPILE=1`, since compiling every target takes minutes of CPU.

use std::ffi::{CString, c_char, c_int};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Real architectures to make CUBIN for: a GPU runs the CUBIN of its own major version and an
/// equal or lower minor one (sm_86 and sm_89 run sm_80's).
const CUBIN_TARGETS: &[&str] = &["sm_80", "sm_90", "sm_100", "sm_120"];
/// The virtual architecture whose PTX the driver compiles for any later GPU, built only with
/// `GPU_TOPK_PRECOMPILE_PTX=1`: it serves only GPUs of a major version without CUBIN here, and
/// is larger than one architecture's CUBIN, while the driver's compile of it takes about as
/// long as NVRTC's at run time. 9.0, not lower: those GPUs launch with programmatic dependent
/// launch, whose wait (common.cuh) only code for 9.0 on contains.
const PTX_TARGET: &str = "compute_90";
const PTX_ENV: &str = "GPU_TOPK_PRECOMPILE_PTX";
/// The options after `--gpu-architecture`, as `options()` in src/device/kernels/compile.rs
/// gives them (a unit test compares the two).
const OPTIONS: &[&str] = &["--std=c++17"];
const PRECOMPILE_ENV: &str = "GPU_TOPK_PRECOMPILE";

type Program = *mut std::ffi::c_void;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;

/// The NVRTC entry points the build uses.
struct Nvrtc {
    _library: libloading::Library,
    version: VersionFn,
    create: CreateFn,
    compile: CompileFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    log_size: SizeFn,
    log: GetFn,
    destroy: DestroyFn,
}

impl Nvrtc {
    fn open() -> Result<Self, String> {
        let mut errors = Vec::new();
        for name in ["libnvrtc.so.13", "libnvrtc.so"] {
            // SAFETY: loading NVRTC runs no initialisation code with preconditions.
            match unsafe { libloading::Library::new(name) } {
                Ok(library) => return Self::resolve(library),
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(errors.join("; "))
    }

    fn resolve(library: libloading::Library) -> Result<Self, String> {
        /// # Safety
        /// `T` must be the C signature of `name`.
        unsafe fn symbol<T: Copy>(library: &libloading::Library, name: &str) -> Result<T, String> {
            // SAFETY: per the function contract.
            unsafe { library.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| format!("{name}: {e}"))
        }
        // SAFETY: each type above is the signature NVRTC's header declares.
        unsafe {
            Ok(Self {
                version: symbol(&library, "nvrtcVersion")?,
                create: symbol(&library, "nvrtcCreateProgram")?,
                compile: symbol(&library, "nvrtcCompileProgram")?,
                cubin_size: symbol(&library, "nvrtcGetCUBINSize")?,
                cubin: symbol(&library, "nvrtcGetCUBIN")?,
                ptx_size: symbol(&library, "nvrtcGetPTXSize")?,
                ptx: symbol(&library, "nvrtcGetPTX")?,
                log_size: symbol(&library, "nvrtcGetProgramLogSize")?,
                log: symbol(&library, "nvrtcGetProgramLog")?,
                destroy: symbol(&library, "nvrtcDestroyProgram")?,
                _library: library,
            })
        }
    }

    fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: plain out-parameters.
        match unsafe { (self.version)(&mut major, &mut minor) } {
            0 => Ok((major, minor)),
            code => Err(format!("nvrtcVersion failed ({code})")),
        }
    }

    /// Compiles `source` (named `name`) for `target`: CUBIN for `sm_XY`, PTX for `compute_XY`.
    fn build(
        &self,
        name: &str,
        source: &str,
        headers: &[(String, String)],
        target: &str,
    ) -> Result<Vec<u8>, String> {
        let c = |s: &str| CString::new(s).map_err(|_| format!("{name}: text with a NUL byte"));
        let c_source = c(source)?;
        let c_name = c(name)?;
        let c_headers = (headers.iter().map(|(_, t)| c(t))).collect::<Result<Vec<_>, _>>()?;
        let c_includes = (headers.iter().map(|(n, _)| c(n))).collect::<Result<Vec<_>, _>>()?;
        let mut opts = vec![format!("--gpu-architecture={target}")];
        opts.extend(OPTIONS.iter().map(|o| o.to_string()));
        let c_opts = (opts.iter().map(|o| c(o))).collect::<Result<Vec<_>, _>>()?;
        let ptrs = |v: &[CString]| v.iter().map(|s| s.as_ptr()).collect::<Vec<_>>();
        let (header_ptrs, include_ptrs, opt_ptrs) =
            (ptrs(&c_headers), ptrs(&c_includes), ptrs(&c_opts));
        let ptx = target.starts_with("compute_");
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: every pointer refers to a live NUL-terminated string during the calls; the
        // program is destroyed once, below.
        unsafe {
            let created = (self.create)(
                &mut program,
                c_source.as_ptr(),
                c_name.as_ptr(),
                header_ptrs.len() as c_int,
                header_ptrs.as_ptr(),
                include_ptrs.as_ptr(),
            );
            if created != 0 {
                return Err(format!("nvrtcCreateProgram({name}) failed ({created})"));
            }
            let compiled = (self.compile)(program, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let result = if compiled != 0 {
                Err(format!(
                    "NVRTC could not compile kernels/{name} for {target} ({compiled}), \
                     options {opts:?}:\n{}",
                    self.text(program, self.log_size, self.log)
                ))
            } else if ptx {
                Ok(self.bytes(program, self.ptx_size, self.ptx))
            } else {
                Ok(self.bytes(program, self.cubin_size, self.cubin))
            };
            (self.destroy)(&mut program);
            let mut output = result?;
            // PTX is a C string: the table holds its text alone.
            if ptx && output.last() == Some(&0) {
                output.pop();
            }
            if output.is_empty() {
                return Err(format!("NVRTC produced nothing for {name} ({target})"));
            }
            Ok(output)
        }
    }

    /// # Safety
    /// `program` must be a compiled program.
    unsafe fn bytes(&self, program: Program, size: SizeFn, get: GetFn) -> Vec<u8> {
        let mut len = 0usize;
        // SAFETY: per the function contract; the buffer has the size NVRTC asked for.
        unsafe {
            if size(program, &mut len) != 0 || len == 0 {
                return Vec::new();
            }
            let mut data = vec![0u8; len];
            if get(program, data.as_mut_ptr() as *mut c_char) != 0 {
                return Vec::new();
            }
            data
        }
    }

    /// # Safety
    /// `program` must be a created program.
    unsafe fn text(&self, program: Program, size: SizeFn, get: GetFn) -> String {
        // SAFETY: per the function contract.
        let data = unsafe { self.bytes(program, size, get) };
        let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
        String::from_utf8_lossy(&data[..end]).trim_end().to_string()
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=LD_LIBRARY_PATH");
    println!("cargo:rerun-if-env-changed={PRECOMPILE_ENV}");
    println!("cargo:rerun-if-env-changed={PTX_ENV}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let table = match precompile(&out) {
        Ok(table) => table,
        Err(Skip(why)) => {
            if !why.is_empty() {
                println!(
                    "cargo:warning=kernels are not precompiled ({why}): they compile at run time"
                );
            }
            empty_table(&why)
        }
    };
    std::fs::write(out.join("precompiled.rs"), table).expect("cannot write precompiled.rs");
}

/// Why the kernels are not precompiled (empty where that needs no warning).
struct Skip(String);

/// The table's source, or why there is none. Panics (fails the build) when a kernel does not
/// compile.
fn precompile(out: &Path) -> Result<String, Skip> {
    let asked = std::env::var(PRECOMPILE_ENV).ok();
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    match asked.as_deref() {
        Some("0") => return Err(Skip(String::new())),
        Some("1") => {}
        _ if release => {}
        _ => return Err(Skip(String::new())),
    }
    let nvrtc = Nvrtc::open().map_err(|e| {
        Skip(format!(
            "no libnvrtc.so.13 on LD_LIBRARY_PATH or in the linker cache ({e}); \
             .ci/install-nvrtc.sh installs it"
        ))
    })?;
    let (major, minor) = nvrtc.version().map_err(Skip)?;
    let (programs, headers) = read_kernels(Path::new("kernels"));
    let ptx = std::env::var(PTX_ENV).is_ok_and(|v| v == "1");
    let targets: Vec<&str> = (CUBIN_TARGETS.iter().copied())
        .chain(ptx.then_some(PTX_TARGET))
        .collect();
    let jobs: Vec<(usize, &str)> = (0..programs.len())
        .flat_map(|p| targets.iter().map(move |t| (p, *t)))
        .collect();
    let results = compile_all(&nvrtc, &programs, &headers, &jobs);

    let dir = out.join("kernels");
    std::fs::create_dir_all(&dir).expect("cannot create OUT_DIR/kernels");
    let mut rows = String::new();
    for ((p, target), result) in jobs.iter().zip(results) {
        let name = &programs[*p].0;
        let data = result.unwrap_or_else(|e| panic!("{e}"));
        let ext = if target.starts_with("compute_") {
            "ptx"
        } else {
            "cubin"
        };
        let path = dir.join(format!("{}.{target}.{ext}", name.trim_end_matches(".cu")));
        std::fs::write(&path, data).expect("cannot write a precompiled kernel");
        let path = path.to_str().expect("OUT_DIR is not UTF-8");
        writeln!(
            rows,
            "    ({name:?}, {target:?}, include_bytes!({path:?})),"
        )
        .unwrap();
    }
    Ok(format!(
        "/// Whether the build precompiled the kernels.\n\
         pub const PRECOMPILED: bool = true;\n\
         /// Why not, when it did not.\n\
         pub const PRECOMPILED_NOTE: &str = \"\";\n\
         /// NVRTC's version at build time.\n\
         pub const PRECOMPILED_NVRTC: (i32, i32) = ({major}, {minor});\n\
         /// The options after `--gpu-architecture`.\n\
         pub const PRECOMPILED_OPTIONS: &[&str] = &{OPTIONS:?};\n\
         /// (kernel file, target, CUBIN or PTX text).\n\
         pub static PRECOMPILED_KERNELS: &[(&str, &str, &[u8])] = &[\n{rows}];\n"
    ))
}

fn empty_table(why: &str) -> String {
    format!(
        "pub const PRECOMPILED: bool = false;\n\
         pub const PRECOMPILED_NOTE: &str = {why:?};\n\
         pub const PRECOMPILED_NVRTC: (i32, i32) = (0, 0);\n\
         pub const PRECOMPILED_OPTIONS: &[&str] = &{OPTIONS:?};\n\
         pub static PRECOMPILED_KERNELS: &[(&str, &str, &[u8])] = &[];\n"
    )
}

/// The programs (`.cu`) and headers (`.cuh`) of `dir`, by file name, sorted.
type Files = Vec<(String, String)>;
fn read_kernels(dir: &Path) -> (Files, Files) {
    let mut files: Files = std::fs::read_dir(dir)
        .expect("cannot read kernels/")
        .map(|entry| {
            let path = entry.expect("cannot read kernels/").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, path)
        })
        .filter(|(name, _)| name.ends_with(".cu") || name.ends_with(".cuh"))
        .map(|(name, path)| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            (name, text)
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .partition(|(name, _)| name.ends_with(".cu"))
}

/// An image, or NVRTC's error.
type Built = Result<Vec<u8>, String>;

/// Compiles every (program, target) job on as many threads as cargo allows.
fn compile_all(
    nvrtc: &Nvrtc,
    programs: &Files,
    headers: &Files,
    jobs: &[(usize, &str)],
) -> Vec<Built> {
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
        .clamp(1, jobs.len().max(1));
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Option<Built>>> = Mutex::new(jobs.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let at = {
                        let mut next = next.lock().unwrap();
                        *next += 1;
                        *next - 1
                    };
                    let Some(&(p, target)) = jobs.get(at) else {
                        break;
                    };
                    let (name, source) = &programs[p];
                    let result = nvrtc.build(name, source, headers, target);
                    results.lock().unwrap()[at] = Some(result);
                }
            });
        }
    });
    (results.into_inner().unwrap().into_iter())
        .map(|r| r.expect("every job ran"))
        .collect()
}
