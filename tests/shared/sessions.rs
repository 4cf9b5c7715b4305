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

/// The operator's settings in the tests: on the test backend, the rule `enabled` or not.
pub fn test_config(enabled: bool) -> GpuTopKConfig {
    GpuTopKConfig::default()
        .with_enabled(enabled)
        .with_backend(test_backend())
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
