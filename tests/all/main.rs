//! The integration tests, one binary (easy to carry to the GPU machine).
//!
//! The operator's backend is `GPU_TOPK_TEST_BACKEND` (`cpu` by default; `cuda` on a GPU
//! machine), so the same suite checks the CPU path in CI and the CUDA path on the GPU.

mod aggregate_fuzz;
mod aggregate_topk;
mod bad_input;
mod cache;
#[cfg(feature = "cli")]
mod cli;
mod common;
mod devices;
mod differential;
#[cfg(feature = "cluster")]
mod distributed;
mod files;
mod fusion;
mod fuzz;
mod gpu;
mod groups;
mod hits;
mod plan;
mod plan_cache;
mod reliability;
mod resident;
#[path = "../shared/sessions.rs"]
mod sessions;
#[path = "../shared/slt_format.rs"]
mod slt_format;
mod strings;
mod tables;
mod ties;
mod tpch;
