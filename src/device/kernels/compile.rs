//! NVRTC: the options every kernel is compiled with, and compilation to CUBIN for the
//! device's own architecture.

use super::*;

/// Whether the NVRTC library can be loaded (with dynamic loading, using it when it cannot
/// would panic).
pub fn nvrtc_available() -> bool {
    // Process-wide: the libraries found do not change while it runs.
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only probes whether the shared library can be loaded.
    *PRESENT.get_or_init(|| unsafe { nvrtc::is_culib_present() })
}

/// NVRTC's version, e.g. (13, 0).
pub(crate) fn nvrtc_version() -> Result<(i32, i32), String> {
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
pub(super) fn options(arch: &str, extra: &[&str]) -> Result<Vec<String>, String> {
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

pub(super) fn cstring(what: &str, s: &str) -> Result<CString, String> {
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
