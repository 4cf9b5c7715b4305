//! The device's switches from the environment, read once per process into one struct that
//! the device carries: where the kernel sources and the CUBIN cache live, and contributors'
//! A/B switches and tracing (CONTRIBUTING.md lists them).

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Set (to anything) to never use the GPU.
pub(crate) const DISABLE_ENV: &str = "GPU_TOPK_DISABLE_CUDA";
/// Set to `0` to launch kernels without programmatic dependent launch.
pub(crate) const PDL_ENV: &str = "GPU_TOPK_PDL";
/// A directory to read the kernel sources from instead of the embedded ones.
pub const KERNEL_DIR_ENV: &str = "GPU_TOPK_KERNEL_DIR";
/// The CUBIN cache directory.
pub(crate) const CACHE_DIR_ENV: &str = "GPU_TOPK_CACHE_DIR";
/// Set to print each sampled selection's per-phase device times (synchronising after each).
pub(crate) const TRACE_ENV: &str = "GPU_TOPK_TRACE";
/// `0` never takes the top-bits selection, `1` takes it wherever it applies (A/B runs).
pub(crate) const TOP_BITS_ENV: &str = "GPU_TOPK_TOP_BITS";

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceOptions {
    /// [`DISABLE_ENV`].
    pub disabled: bool,
    /// Programmatic dependent launch where the device has it (off with [`PDL_ENV`]` = 0`).
    pub programmatic_launch: bool,
    /// [`KERNEL_DIR_ENV`].
    pub kernel_dir: Option<PathBuf>,
    /// [`CACHE_DIR_ENV`].
    pub cache_dir: Option<PathBuf>,
    /// [`TRACE_ENV`].
    pub trace: bool,
    /// [`TOP_BITS_ENV`]: forced on or off, or `None` for the planner's choice.
    pub top_bits: Option<bool>,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            disabled: false,
            programmatic_launch: true,
            kernel_dir: None,
            cache_dir: None,
            trace: false,
            top_bits: None,
        }
    }
}

impl DeviceOptions {
    /// The options from `var` (an environment lookup).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        let path = |name: &str| set(name).map(PathBuf::from);
        Self {
            disabled: var(DISABLE_ENV).is_some(),
            programmatic_launch: set(PDL_ENV).is_none_or(|v| v != "0"),
            kernel_dir: path(KERNEL_DIR_ENV),
            cache_dir: path(CACHE_DIR_ENV),
            trace: var(TRACE_ENV).is_some(),
            top_bits: set(TOP_BITS_ENV).and_then(|v| match v.to_str() {
                Some("0") => Some(false),
                Some("1") => Some(true),
                _ => None,
            }),
        }
    }

    /// This process's options, read from the environment on first use.
    pub(crate) fn process() -> &'static DeviceOptions {
        // Process-wide: the environment is read once, before the device opens.
        static OPTIONS: OnceLock<DeviceOptions> = OnceLock::new();
        OPTIONS.get_or_init(|| Self::from_vars(|name| std::env::var_os(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_read_their_variables_and_ignore_empty_or_unknown_values() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            DeviceOptions::from_vars(vars(&[])),
            DeviceOptions::default()
        );
        let all = DeviceOptions::from_vars(vars(&[
            (DISABLE_ENV, "1"),
            (PDL_ENV, "0"),
            (KERNEL_DIR_ENV, "/k"),
            (CACHE_DIR_ENV, "/c"),
            (TRACE_ENV, ""),
            (TOP_BITS_ENV, "0"),
        ]));
        assert!(all.disabled && !all.programmatic_launch && all.trace);
        assert_eq!(all.kernel_dir, Some(PathBuf::from("/k")));
        assert_eq!(all.cache_dir, Some(PathBuf::from("/c")));
        assert_eq!(all.top_bits, Some(false));
        let odd = DeviceOptions::from_vars(vars(&[
            (KERNEL_DIR_ENV, ""),
            (TOP_BITS_ENV, "yes"),
            (PDL_ENV, "1"),
        ]));
        assert_eq!((odd.kernel_dir, odd.top_bits), (None, None));
        assert!(odd.programmatic_launch);
    }
}
