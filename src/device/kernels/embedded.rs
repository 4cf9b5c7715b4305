//! The kernels precompiled at build time (build.rs): which image a device loads, and where
//! each loaded module came from.

use super::*;

mod table {
    include!(concat!(env!("OUT_DIR"), "/precompiled.rs"));
}

pub use table::{
    PRECOMPILED, PRECOMPILED_KERNELS, PRECOMPILED_NOTE, PRECOMPILED_NVRTC, PRECOMPILED_OPTIONS,
};

/// A target's (major, minor) version and whether it is PTX: `sm_90` is (9, 0) CUBIN,
/// `compute_80` (8, 0) PTX; the last digit is the minor one. `None` for anything else
/// (arch-specific `sm_90a` images run on their own architecture only).
pub fn parse_target(target: &str) -> Option<((u32, u32), bool)> {
    let (digits, ptx) = match (target.strip_prefix("sm_"), target.strip_prefix("compute_")) {
        (Some(d), _) => (d, false),
        (_, Some(d)) => (d, true),
        _ => return None,
    };
    if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some(((major.parse().ok()?, minor.parse().ok()?), ptx))
}

/// Which of `targets` a device of architecture `arch` (`sm_XY`) loads: CUBIN for `sm_XY`, else
/// the newest CUBIN of the same major version and an older minor one (binary compatible), else
/// the newest PTX for an architecture not above the device's (the driver compiles it). A device
/// of 9.0 on takes no PTX below 9.0: its kernels launch with programmatic dependent launch,
/// and only code for 9.0 on waits for the previous kernel (`grid_dependency_wait`).
pub fn choose_target<'a>(arch: &str, targets: &[&'a str]) -> Option<&'a str> {
    let ((major, minor), false) = parse_target(arch)? else {
        return None;
    };
    let parsed = || targets.iter().filter_map(|t| Some((*t, parse_target(t)?)));
    let cubin = parsed()
        .filter(|(_, ((ma, mi), ptx))| !ptx && *ma == major && *mi <= minor)
        .max_by_key(|(_, (version, _))| *version);
    let ptx = || {
        parsed()
            .filter(|(_, (version, ptx))| *ptx && *version <= (major, minor))
            .filter(|(_, ((ptx_major, _), _))| *ptx_major >= 9 || major < 9)
            .max_by_key(|(_, (version, _))| *version)
    };
    cubin.or_else(ptx).map(|(t, _)| t)
}

/// The precompiled image of kernel file `file` for `arch`, with its target.
pub fn embedded_image(file: &str, arch: &str) -> Option<(&'static str, &'static [u8])> {
    let rows = || PRECOMPILED_KERNELS.iter().filter(|(f, _, _)| *f == file);
    let targets: Vec<&'static str> = rows().map(|(_, t, _)| *t).collect();
    let target = choose_target(arch, &targets)?;
    rows()
        .find(|(_, t, _)| *t == target)
        .map(|(_, t, image)| (*t, *image))
}

/// Where a loaded module came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModuleOrigin {
    /// CUBIN built into the binary for this target (`sm_90`).
    Precompiled(&'static str),
    /// PTX built into the binary for this target (`compute_90`), compiled by the driver.
    Ptx(&'static str),
    /// CUBIN from the on-disk cache.
    DiskCache,
    /// Compiled by NVRTC in this process.
    Compiled,
}

impl ModuleOrigin {
    fn describe(self) -> String {
        match self {
            ModuleOrigin::Precompiled(target) => format!("precompiled for {target}"),
            ModuleOrigin::Ptx(target) => format!("{target} PTX compiled by the driver"),
            ModuleOrigin::DiskCache => "read from the kernel cache".into(),
            ModuleOrigin::Compiled => "compiled by NVRTC".into(),
        }
    }
}

/// `kernels …`: the distinct origins of `modules`, in order.
pub(crate) fn describe_origins(modules: impl IntoIterator<Item = ModuleOrigin>) -> String {
    let mut seen: Vec<String> = Vec::new();
    for origin in modules {
        let text = origin.describe();
        if !seen.contains(&text) {
            seen.push(text);
        }
    }
    match seen.is_empty() {
        true => "no kernels".into(),
        false => format!("kernels {}", seen.join(", ")),
    }
}

/// What loading the kernels for `arch` will do, before it has: `kernels precompiled for
/// sm_90`, or `kernels compiled by NVRTC at first use` (or read from the kernel cache then).
pub(crate) fn expected_origin(arch: &str) -> String {
    if DeviceOptions::process().kernel_dir.is_some() {
        let dir = crate::device::options::KERNEL_DIR_ENV;
        return format!("kernels compiled from {dir} at first use");
    }
    let images: Option<Vec<_>> = KernelSources::embedded()
        .programs()
        .iter()
        .map(|(file, _)| embedded_image(file, arch).map(|(t, _)| t))
        .collect();
    match images {
        Some(targets) => describe_origins(targets.into_iter().map(|t| match parse_target(t) {
            Some((_, true)) => ModuleOrigin::Ptx(t),
            _ => ModuleOrigin::Precompiled(t),
        })),
        None => "kernels compiled by NVRTC at first use".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT: &[&str] = &["sm_80", "sm_90", "sm_100", "sm_120", "compute_90"];

    #[test]
    fn a_device_loads_its_own_cubin_else_its_majors_older_one_else_ptx() {
        let choose = |arch| choose_target(arch, BUILT);
        assert_eq!(choose("sm_90"), Some("sm_90"));
        assert_eq!(choose("sm_80"), Some("sm_80"));
        assert_eq!(choose("sm_86"), Some("sm_80"));
        assert_eq!(choose("sm_89"), Some("sm_80"));
        assert_eq!(choose("sm_100"), Some("sm_100"));
        assert_eq!(choose("sm_103"), Some("sm_100"));
        assert_eq!(choose("sm_121"), Some("sm_120"));
        // No CUBIN of its major: the PTX, which the driver compiles for it.
        assert_eq!(choose("sm_110"), Some("compute_90"));
        assert_eq!(choose("sm_130"), Some("compute_90"));
        // Older than every target, or not a real architecture.
        assert_eq!(choose("sm_75"), None);
        assert_eq!(choose("sm_70"), None);
        assert_eq!(choose("compute_90"), None);
        assert_eq!(choose("sm_90a"), None);
        assert_eq!(choose("gpu"), None);
    }

    #[test]
    fn the_newest_compatible_image_wins() {
        let targets = ["sm_80", "sm_86", "compute_80", "compute_90", "compute_100"];
        assert_eq!(choose_target("sm_89", &targets), Some("sm_86"));
        assert_eq!(choose_target("sm_87", &targets), Some("sm_86"));
        assert_eq!(choose_target("sm_90", &targets), Some("compute_90"));
        assert_eq!(choose_target("sm_100", &targets), Some("compute_100"));
        assert_eq!(choose_target("sm_103", &targets), Some("compute_100"));
        assert_eq!(choose_target("sm_90", &["sm_80", "sm_100"]), None);
        // PTX below 9.0 has no wait for programmatic dependent launch, which 9.0 on uses.
        assert_eq!(choose_target("sm_90", &["sm_80", "compute_80"]), None);
        assert_eq!(choose_target("sm_110", &["compute_80"]), None);
        assert_eq!(
            choose_target("sm_110", &["compute_80", "compute_90"]),
            Some("compute_90")
        );
        assert_eq!(choose_target("sm_87", &["compute_80"]), Some("compute_80"));
        assert_eq!(choose_target("sm_90", &[]), None);
    }

    #[test]
    fn targets_parse_to_their_version() {
        assert_eq!(parse_target("sm_90"), Some(((9, 0), false)));
        assert_eq!(parse_target("sm_120"), Some(((12, 0), false)));
        assert_eq!(parse_target("compute_90"), Some(((9, 0), true)));
        assert_eq!(parse_target("sm_9"), None);
        assert_eq!(parse_target("sm_90a"), None);
    }

    #[test]
    fn origins_are_described_once_each() {
        let origins = [
            ModuleOrigin::Precompiled("sm_90"),
            ModuleOrigin::Precompiled("sm_90"),
            ModuleOrigin::Compiled,
        ];
        assert_eq!(
            describe_origins(origins),
            "kernels precompiled for sm_90, compiled by NVRTC"
        );
        assert_eq!(
            describe_origins([ModuleOrigin::Ptx("compute_90")]),
            "kernels compute_90 PTX compiled by the driver"
        );
    }

    #[test]
    fn the_expected_origin_names_the_precompiled_target() {
        if DeviceOptions::process().kernel_dir.is_some() {
            eprintln!("skipped: GPU_TOPK_KERNEL_DIR is set, so every device compiles");
            return;
        }
        let compiled = "kernels compiled by NVRTC at first use";
        assert_eq!(expected_origin("sm_75"), compiled);
        let expected = match PRECOMPILED {
            true => "kernels precompiled for sm_80",
            false => compiled,
        };
        assert_eq!(expected_origin("sm_86"), expected);
    }

    /// The build precompiled every kernel file for every target it names, with the options
    /// the run time compiles with, into images of the right kind.
    #[test]
    fn the_precompiled_table_covers_every_kernel_file() {
        if !PRECOMPILED {
            eprintln!(
                "skipped: this build has no precompiled kernels ({})",
                match PRECOMPILED_NOTE {
                    "" => "not a release build, or GPU_TOPK_PRECOMPILE=0",
                    why => why,
                }
            );
            return;
        }
        let targets: Vec<&str> = PRECOMPILED_KERNELS.iter().map(|(_, t, _)| *t).collect();
        for target in ["sm_80", "sm_90", "sm_100", "sm_120"] {
            assert!(targets.contains(&target), "no {target} images");
        }
        let sources = KernelSources::embedded();
        for (file, _) in sources.programs() {
            for target in targets
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
            {
                let image = PRECOMPILED_KERNELS
                    .iter()
                    .find(|(f, t, _)| *f == file && *t == target)
                    .map(|(_, _, image)| *image)
                    .unwrap_or_else(|| panic!("{file} has no {target} image"));
                match parse_target(target) {
                    Some((_, false)) => assert!(image.starts_with(b"\x7fELF"), "{file} {target}"),
                    Some((_, true)) => {
                        let text = std::str::from_utf8(image).expect("PTX is text");
                        assert!(text.contains(".version") && text.contains(".target"));
                    }
                    None => panic!("unknown target {target}"),
                }
                // Entry points keep their C names, in the ELF symbol table or the PTX text.
                for entry in entry_points(file) {
                    let name = entry.as_bytes();
                    assert!(
                        image.windows(name.len()).any(|w| w == name),
                        "{entry} is missing from {file}'s {target} image"
                    );
                }
            }
        }
        let table_files = PRECOMPILED_KERNELS.iter().map(|(f, _, _)| *f);
        for file in table_files {
            assert!(sources.get(file).is_some(), "{file} is not a kernel file");
        }
        let runtime = options("sm_90", &[]).unwrap();
        assert_eq!(runtime[0], "--gpu-architecture=sm_90");
        assert_eq!(
            &runtime[1..],
            PRECOMPILED_OPTIONS,
            "build.rs compiles as the run time"
        );
        assert!(PRECOMPILED_NVRTC.0 >= 12, "{PRECOMPILED_NVRTC:?}");
    }
}
