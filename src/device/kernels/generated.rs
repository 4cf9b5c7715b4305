//! Generated programs ([`crate::fusion`]): their compile options and policy (occupancy,
//! spills), compiled once per process and cached on disk like the kernels.

use super::*;

/// Name of a generated program's entry point.
pub(crate) const GENERATED_ENTRY: &str = "fused_append";

/// NVRTC options of generated code: no contraction of `a * b + c` into an FMA, whose single
/// rounding would differ from the host's two.
pub(crate) const GENERATED_OPTIONS: &[&str] = &["--fmad=false"];

/// The generated kernel's `__launch_bounds__` minimum of resident blocks a SM
/// (`FUSED_MIN_BLOCKS`): ptxas then keeps a thread to 51 registers. A fifth resident block keeps
/// more loads in flight than a little spilling costs (Q3's program: 57 registers and 4 blocks
/// without it, 5 blocks with 56 bytes of spill traffic and a pass nearer its read floor); 6
/// blocks (40 registers) slowed the pass. A program that spills more than
/// [`GENERATED_SPILL_ALLOWANCE`] under it is compiled without it ([`compile_generated`]).
pub const GENERATED_MIN_BLOCKS: u32 = 5;

/// Bytes of spill stores and loads (ptxas) that a generated program may take for
/// [`GENERATED_MIN_BLOCKS`]: Q3's 56 cost less than its fifth resident block gains; larger
/// spills (up to ~200 bytes in the fusion tests' programs) are not known to pay, so those keep
/// their registers.
pub const GENERATED_SPILL_ALLOWANCE: u64 = 64;

/// The cache entry of a generated program names the rule that compiled it.
pub(super) const GENERATED_CACHE_OPTIONS: &[&str] = &[
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
    // Pipelined where it fits: the next round's loads in flight while this one is evaluated
    // bring the pass to its read floor (benches/PERFORMANCE.md); 4 blocks a SM do no better
    // than 5. Both hinted variants compile at once, so that a program that does not fit
    // pipelined waits for one compile, not two.
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
pub(crate) const GENERATED_THREADS: u32 = 256;

impl std::fmt::Debug for GeneratedKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeneratedKernel")
            .field("compile_time", &self.compile_time)
            .finish()
    }
}

/// Compiles (or reads from the disk cache) and loads a generated program with entry `entry`.
pub(crate) fn load_generated(
    ctx: &Arc<CudaContext>,
    arch: &str,
    driver_version: i32,
    source: &str,
    entry: &str,
    cache_dir: Option<&Path>,
) -> GpuResult<GeneratedKernel> {
    let sources = KernelSources::load()?;
    let start = std::time::Instant::now();
    let (cubin, _) = cubin_cached_with(
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
