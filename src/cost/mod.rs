//! The cost model: chooses where the selection runs and with which algorithm.
//!
//! Today the choice is the settings' (backend, algorithm) resolved against the machine: a GPU
//! backend needs a detected device; otherwise the CPU selector runs. The analytical per-algorithm
//! model (DESIGN §6) plugs in here, in [`choose`], the one place the choice is made.

use std::fmt;

use crate::config::{Algorithm, Backend};
use crate::device::{GpuStatus, gpu_status};

/// The resolved choice for one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelectionChoice {
    /// This crate's CPU selector.
    Cpu,
}

impl SelectionChoice {
    /// `cpu` or `cuda`.
    pub fn backend(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "cpu",
        }
    }

    /// The selection algorithm, e.g. `select-nth` (the CPU's) or `radix`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "select-nth",
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
        /// Why (shown in EXPLAIN), e.g. "backend=cpu forced".
        reason: String,
    },
    /// Leave DataFusion's own TopK in place, and why.
    Decline(String),
}

/// Resolves the settings against the machine. `k` is fetch + offset.
pub fn choose(backend: Backend, algorithm: Algorithm, _k: usize) -> Placement {
    let forced_cpu = backend == Backend::Cpu || algorithm == Algorithm::Cpu;
    if forced_cpu {
        return Placement::Run {
            choice: SelectionChoice::Cpu,
            reason: "CPU path forced by settings".into(),
        };
    }
    match gpu_status() {
        GpuStatus::Unavailable(why) => match backend {
            Backend::Cuda => Placement::Run {
                choice: SelectionChoice::Cpu,
                reason: format!("backend=cuda but no GPU: {why}; CPU fallback"),
            },
            _ => Placement::Decline(format!("no GPU found ({why})")),
        },
        GpuStatus::Available(device) => Placement::Run {
            choice: SelectionChoice::Cpu,
            reason: format!(
                "GPU {} found, but this build has no GPU selector yet; CPU path",
                device.describe()
            ),
        },
    }
}
