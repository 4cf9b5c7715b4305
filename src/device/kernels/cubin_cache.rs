//! The on-disk CUBIN cache: one file per (program, architecture), keyed by a hash of
//! everything the CUBIN depends on, checked by a header and a checksum.

use super::*;

pub(super) const CACHE_MAGIC: &[u8; 8] = b"GTKCUBIN";
pub(super) const CACHE_FORMAT: u32 = 1;
pub(super) const CACHE_HEADER: usize = 48;

/// The cache directory when none is passed: `GPU_TOPK_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/datafusion-gpu-topk`, else `~/.cache/datafusion-gpu-topk`.
pub(crate) fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = &DeviceOptions::process().cache_dir {
        return Some(dir.clone());
    }
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
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
pub(super) fn fnv1a(basis: u64, data: &[u8]) -> u64 {
    data.iter().fold(basis, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub(super) fn checksum(data: &[u8]) -> u64 {
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
    .map(|(cubin, _)| cubin)
}

/// The CUBIN of a program text (a kernel file, or generated code, which may include the
/// kernel headers): from the cache, else compiled by `compile` (given the headers) and stored;
/// with where it came from. `extra` keys the cache entry.
#[allow(clippy::too_many_arguments)]
pub(super) fn cubin_cached_with(
    name: &str,
    source: &str,
    sources: &KernelSources,
    arch: &str,
    extra: &[&str],
    driver_version: i32,
    cache_dir: Option<&Path>,
    compile: impl FnOnce(&[(&str, &str)]) -> Result<Vec<u8>, String>,
) -> Result<(Vec<u8>, ModuleOrigin), String> {
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
            Some(cubin) => return Ok((cubin, ModuleOrigin::DiskCache)),
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
    Ok((cubin, ModuleOrigin::Compiled))
}

/// The cache file (when there is a cache directory) and key of a program text.
pub(super) fn source_cache_file(
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
pub(crate) fn generated_on_disk(
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
