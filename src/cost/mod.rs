//! The cost model: chooses where the selection runs and with which algorithm.
//!
//! Today the choice is the settings' (backend, algorithm) resolved against the machine: a GPU
//! backend needs a detected device, and `auto` on the GPU is bitonic top-k up to its k limit
//! (shared memory bound) and radix select beyond ([`crate::select::cuda::device_algorithm`]).
//! The analytical per-algorithm model (DESIGN §6) plugs in here, in [`choose`], the one place
//! the choice is made.

use std::fmt;
use std::path::Path;

use crate::config::{Algorithm, Backend};
use crate::device::{DeviceAlgorithm, GpuStatus, gpu_status};
use crate::keys::KeyLayout;
use crate::select::cuda::device_algorithm;

/// The resolved choice for one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionChoice {
    /// This crate's CPU selector.
    Cpu,
    /// The CUDA selector with this algorithm.
    Cuda(DeviceAlgorithm),
}

impl SelectionChoice {
    /// `cpu` or `cuda`.
    pub fn backend(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "cpu",
            SelectionChoice::Cuda(_) => "cuda",
        }
    }

    /// The selection algorithm, e.g. `select-nth` (the CPU's) or `radix`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "select-nth",
            SelectionChoice::Cuda(algorithm) => algorithm.name(),
        }
    }

    /// The setting that selects this algorithm, for building the selector.
    pub fn setting(&self) -> Algorithm {
        match self {
            SelectionChoice::Cpu => Algorithm::Cpu,
            SelectionChoice::Cuda(DeviceAlgorithm::Bitonic) => Algorithm::Bitonic,
            SelectionChoice::Cuda(DeviceAlgorithm::Radix) => Algorithm::Radix,
            SelectionChoice::Cuda(DeviceAlgorithm::Sample) => Algorithm::Sample,
            SelectionChoice::Cuda(DeviceAlgorithm::Delegate) => Algorithm::Delegate,
        }
    }
}

impl fmt::Display for SelectionChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.backend(), self.algorithm())
    }
}

/// What the rule decided for a query's backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Run our operator with this selection.
    Run {
        choice: SelectionChoice,
        /// Why (shown in EXPLAIN VERBOSE), e.g. "CPU path forced by settings".
        reason: String,
    },
    /// Leave DataFusion's own TopK in place, and why.
    Decline(String),
}

/// Resolves the settings against the machine. `k` is fetch + offset. On the GPU the kernels are
/// loaded here (compiled by NVRTC on first use, cached in `kernel_cache_dir`), so a compile
/// failure shows in EXPLAIN and the query runs on the CPU path.
pub fn choose(
    backend: Backend,
    algorithm: Algorithm,
    layout: &KeyLayout,
    k: usize,
    kernel_cache_dir: Option<&Path>,
) -> Placement {
    if backend == Backend::Cpu || algorithm == Algorithm::Cpu {
        return Placement::Run {
            choice: SelectionChoice::Cpu,
            reason: "CPU path forced by settings".into(),
        };
    }
    let cpu_or_decline = |why: String| match backend {
        Backend::Cuda => Placement::Run {
            choice: SelectionChoice::Cpu,
            reason: format!("backend=cuda, but {why}: CPU path"),
        },
        _ => Placement::Decline(why),
    };
    match gpu_status() {
        GpuStatus::Unavailable(why) => cpu_or_decline(format!("no GPU found ({why})")),
        GpuStatus::Available(device) => match device_algorithm(device, layout, k, algorithm) {
            Ok(_) if let Err(e) = device.kernels_with_cache_dir(kernel_cache_dir) => {
                cpu_or_decline(format!("the GPU kernels are unusable ({e})"))
            }
            Ok(chosen) => Placement::Run {
                choice: SelectionChoice::Cuda(chosen),
                reason: format!(
                    "GPU {}; algorithm={algorithm}, k={k}, {}-bit keys",
                    device.describe(),
                    layout.total_bits()
                ),
            },
            Err(e) => cpu_or_decline(format!("the GPU cannot run this selection ({e})")),
        },
    }
}
