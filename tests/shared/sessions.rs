//! The sessions every test binary builds: the backend the operator is forced to
//! (`GPU_TOPK_TEST_BACKEND`: `cpu` by default, `cuda` on the GPU machine) and a session with
//! the operator, enabled or not, under a given DataFusion configuration.

use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, SessionStateBuilderExt};

/// The backend the operator is forced to in the tests.
pub fn test_backend() -> Backend {
    std::env::var("GPU_TOPK_TEST_BACKEND")
        .ok()
        .map(|b| b.parse().expect("GPU_TOPK_TEST_BACKEND: auto, cuda or cpu"))
        .unwrap_or(Backend::Cpu)
}

/// The operator's default settings on one device (GPU 0): the plan shapes, metrics and
/// cache contents the tests check are one operator's. On a host with several GPUs the default
/// (`all`) splits a top-k between them; the tests of the split say so themselves
/// (`with_devices`), and the fuzzer splits half of its setups ([`split_devices`]).
pub fn base_config() -> GpuTopKConfig {
    GpuTopKConfig::default().with_devices(Some(&[0]))
}

/// The operator's settings in the tests: on the test backend, the rule `enabled` or not.
pub fn test_config(enabled: bool) -> GpuTopKConfig {
    base_config()
        .with_enabled(enabled)
        .with_backend(test_backend())
}

/// The devices a test that checks answers splits a top-k between: GPUs 0 and 1 where there
/// are two or more, else two logical devices of GPU 0 (without a GPU, the same plan of two
/// parts and a merge on the CPU path).
#[allow(dead_code)] // the sqllogictests binary shares this file
pub fn split_devices() -> Vec<usize> {
    if test_backend() == Backend::Cuda {
        datafusion_gpu_topk::internal::device::gpu_status(); // starts the device
    }
    match datafusion_gpu_topk::internal::device::started_device_count() {
        Some(2..) => vec![0, 1],
        _ => vec![0, 0],
    }
}

/// A session under `config` with the operator configured as `gpu`.
pub fn session_with_config(config: SessionConfig, gpu: GpuTopKConfig) -> SessionContext {
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_gpu_topk(gpu)
        .build();
    SessionContext::new_with_state(state)
}
