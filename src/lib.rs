//! datafusion-gpu-topk: run DataFusion's `ORDER BY … LIMIT k` on NVIDIA GPUs.
//!
//! Data flow (one module each): [`rule`] rewrites the physical plan → [`exec`] runs the
//! fused top-k operator → [`keys`] encodes sort keys into order-preserving integers, and
//! [`fusion`] generates the CUDA code that evaluates the predicate and keys on the device →
//! [`cost`] chooses the algorithm → [`select`] runs the selection on the CPU or the device
//! ([`device`] holds the CUDA runtime and the kernels).

mod config;
mod cost;
#[path = "../datasets/mod.rs"]
pub mod datasets;
mod device;
mod exec;
mod fusion;
mod keys;
mod rule;
mod select;
mod session;

pub use config::{Algorithm, Backend, FaultPoint, GpuTopKConfig, GpuTopKSettings};
pub use exec::GpuTopKExec;
pub use rule::GpuTopKRule;
pub use session::SessionStateBuilderExt;

/// The crate's internals, for its own CLI, tests and benchmarks: not part of the API, and
/// free to change.
#[doc(hidden)]
pub mod internal {
    pub mod config {
        pub use crate::config::*;
    }
    pub mod cost {
        pub use crate::cost::*;
    }
    pub mod device {
        pub use crate::device::*;
    }
    pub mod exec {
        pub use crate::exec::*;
    }
    pub mod fusion {
        pub use crate::fusion::*;
    }
    pub mod keys {
        pub use crate::keys::*;
    }
    pub mod rule {
        pub use crate::rule::*;
    }
    pub mod select {
        pub use crate::select::*;
    }
}
