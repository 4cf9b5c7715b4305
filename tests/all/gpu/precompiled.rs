//! The kernels precompiled at build time: loaded without NVRTC, they run, and the process's
//! device uses them.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use datafusion_gpu_topk::internal::device::kernels::{
    Kernels, ModuleOrigin, PRECOMPILED, PRECOMPILED_KERNELS, PRECOMPILED_NOTE, choose_target,
    parse_target,
};

use super::*;

/// The device and its architecture (`sm_90`) when it has precompiled kernels to load.
fn precompiled_or_skip(test: &str) -> Option<(Arc<GpuDevice>, String)> {
    let device = gpu_or_skip(test)?;
    let (major, minor) = device.compute_capability;
    let arch = format!("sm_{major}{minor}");
    let targets: Vec<&str> = PRECOMPILED_KERNELS.iter().map(|(_, t, _)| *t).collect();
    if !PRECOMPILED {
        eprintln!(
            "SKIP: {test}: this build has no precompiled kernels ({})",
            match PRECOMPILED_NOTE {
                "" => "not a release build, or GPU_TOPK_PRECOMPILE=0",
                why => why,
            }
        );
        return None;
    }
    if std::env::var_os("GPU_TOPK_KERNEL_DIR").is_some_and(|v| !v.is_empty()) {
        eprintln!("SKIP: {test}: GPU_TOPK_KERNEL_DIR asks for compiled kernels");
        return None;
    }
    if choose_target(&arch, &targets).is_none() {
        eprintln!("SKIP: {test}: no precompiled kernels for {arch} (built: {targets:?})");
        return None;
    }
    Some((device, arch))
}

/// The largest of `words` by `function`, a read_floor_w32 kernel.
fn device_max(device: &GpuDevice, function: &CudaFunction, words: &[u32]) -> u32 {
    let stream = device.context.new_stream().unwrap();
    let input = stream.clone_htod(words).unwrap();
    let mut out = stream.alloc_zeros::<u32>(1).unwrap();
    let n = words.len() as u64;
    let mut builder = stream.launch_builder(function);
    builder.arg(&input).arg(&n).arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (((words.len() as u32).div_ceil(1024)).clamp(1, 64), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: read_floor_w32(const u32 *words, u64 n, u32 *out) with `n` live words and one
    // zeroed output word; the buffers outlive the work (the copy below synchronises).
    unsafe { builder.launch(cfg) }.unwrap();
    stream.clone_dtoh(&out).unwrap()[0]
}

#[test]
fn gpu_precompiled_kernels_load_and_run_without_nvrtc() {
    let test = "gpu_precompiled_kernels_load_and_run_without_nvrtc";
    let Some((device, arch)) = precompiled_or_skip(test) else {
        return;
    };
    let kernels =
        Kernels::load_embedded_only(&device.context, &arch, device.max_shared_per_block).unwrap();
    for (file, origin) in kernels.origins() {
        assert!(
            matches!(origin, ModuleOrigin::Precompiled(_) | ModuleOrigin::Ptx(_)),
            "{file} came from {origin:?}"
        );
    }
    assert_eq!(
        kernels.origins().len(),
        KernelSources::embedded().programs().len()
    );
    let mut rng = Rng::new(7);
    // Aligned and not (the vector loads and the scalar tail), one block and many.
    for n in [1usize, 5, 1000, 4099, 1 << 20] {
        let words: Vec<u32> = (0..n).map(|_| (rng.next_u64() >> 33) as u32).collect();
        let expected = words.iter().copied().max().unwrap();
        let function = kernels.get("read_floor_w32").unwrap();
        assert_eq!(device_max(&device, function, &words), expected, "n={n}");
    }
    eprintln!("{test}: {}", kernels.describe_origin());
}

#[test]
fn gpu_device_runs_selections_on_its_precompiled_kernels() {
    let test = "gpu_device_runs_selections_on_its_precompiled_kernels";
    let Some((device, arch)) = precompiled_or_skip(test) else {
        return;
    };
    let kernels = device.kernels().unwrap();
    let targets: Vec<&str> = PRECOMPILED_KERNELS.iter().map(|(_, t, _)| *t).collect();
    let target = choose_target(&arch, &targets).unwrap();
    for (file, origin) in kernels.origins() {
        let precompiled = [ModuleOrigin::Precompiled(target), ModuleOrigin::Ptx(target)];
        assert!(precompiled.contains(origin), "{file} came from {origin:?}");
    }
    let description = device.describe();
    assert!(
        description.contains(&format!("kernels precompiled for {target}"))
            || description.contains(&format!("kernels {target} PTX")),
        "{description}"
    );
    for (n, k) in [(1000, 10), (8193, 257), (50_000, 1000)] {
        check_select(&device, Dist::Uniform, n, k, n as u64 + k as u64);
        check_select(&device, Dist::HeavyTies, n, k, 3 * n as u64 + k as u64);
    }
}

/// The PTX images (a build with `GPU_TOPK_PRECOMPILE_PTX=1`) compile in the driver and run,
/// on any device at least as new as their target.
#[test]
fn gpu_precompiled_ptx_compiles_in_the_driver_and_runs() {
    let test = "gpu_precompiled_ptx_compiles_in_the_driver_and_runs";
    let Some((device, _)) = precompiled_or_skip(test) else {
        return;
    };
    let (major, minor) = device.compute_capability;
    let device_version = (major as u32, minor as u32);
    let ptx: Vec<(&str, &[u8])> = (PRECOMPILED_KERNELS.iter())
        .filter(|(file, target, _)| {
            *file == "read_floor.cu"
                && parse_target(target).is_some_and(|(v, ptx)| ptx && v <= device_version)
        })
        .map(|(_, target, image)| (*target, *image))
        .collect();
    if ptx.is_empty() {
        eprintln!("SKIP: {test}: no PTX for this device in the build (GPU_TOPK_PRECOMPILE_PTX=1)");
        return;
    }
    let words: Vec<u32> = (0..100_003u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 1)
        .collect();
    for (target, image) in ptx {
        let text = std::str::from_utf8(image).unwrap().to_string();
        let module = device.context.load_module(Ptx::from_src(text)).unwrap();
        let function = module.load_function("read_floor_w32").unwrap();
        let expected = words.iter().copied().max().unwrap();
        assert_eq!(device_max(&device, &function, &words), expected, "{target}");
    }
}
