//! datafusion-gpu-topk: run DataFusion's `ORDER BY … LIMIT k` on NVIDIA GPUs.
//!
//! Data flow (one module each): [`rule`] rewrites the physical plan → [`exec`] runs the
//! fused top-k operator → [`keys`] encodes sort keys into order-preserving integers, and
//! [`fusion`] generates the CUDA code that evaluates the predicate and keys on the device →
//! [`cost`] chooses the algorithm → [`select`] runs the selection on the CPU or the device
//! ([`device`] holds the CUDA runtime and the kernels).

pub mod config;
pub mod cost;
#[path = "../datasets/mod.rs"]
pub mod datasets;
pub mod device;
pub mod exec;
pub mod fusion;
pub mod keys;
pub mod rule;
pub mod select;
pub mod session;

pub use config::{Backend, GpuTopKConfig};
pub use exec::GpuTopKExec;
pub use rule::GpuTopKRule;
pub use session::SessionStateBuilderExt;
