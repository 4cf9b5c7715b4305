//! The one-line integration: `SessionStateBuilder::with_gpu_topk`.

use std::sync::Arc;

use datafusion::execution::SessionStateBuilder;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::prelude::SessionConfig;

use crate::config::GpuTopKConfig;
use crate::rule::GpuTopKRule;

/// Names of the DataFusion rules [`GpuTopKRule`] goes before (the first present):
/// `PushdownSort` lets a Parquet scan read row groups in the sort's order, which would change
/// the input order that ties are broken by; `FilterPushdown(Post)` pushes dynamic filters (ours
/// included) into the scans, so our node must exist by then.
pub(crate) const INSERT_BEFORE_RULES: [&str; 2] = ["PushdownSort", "FilterPushdown(Post)"];

/// Adds the GPU top-k operator to a [`SessionStateBuilder`].
pub trait SessionStateBuilderExt {
    /// Registers the `gpu_topk` settings (with `config` as their values) and inserts
    /// [`GpuTopKRule`] into the physical optimizer just before `PushdownSort` (and so before
    /// `FilterPushdown(Post)`).
    fn with_gpu_topk(self, config: GpuTopKConfig) -> Self;
}

impl SessionStateBuilderExt for SessionStateBuilder {
    fn with_gpu_topk(mut self, config: GpuTopKConfig) -> Self {
        let session_config = self.config().take().unwrap_or_default();
        *self.config() = Some(with_config_extension(session_config, config.clone()));

        let mut rules = self.physical_optimizers().take().unwrap_or_default().rules;
        rules.retain(|rule| rule.name() != GpuTopKRule::NAME);
        let at = rules
            .iter()
            .position(|rule| INSERT_BEFORE_RULES.contains(&rule.name()))
            .unwrap_or(rules.len());
        rules.insert(at, Arc::new(GpuTopKRule::new(config)));
        *self.physical_optimizers() = Some(PhysicalOptimizer::with_rules(rules));
        self
    }
}

/// Sets (or replaces) the `gpu_topk` extension of a session config.
pub(crate) fn with_config_extension(
    mut session: SessionConfig,
    config: GpuTopKConfig,
) -> SessionConfig {
    match session.options_mut().extensions.get_mut::<GpuTopKConfig>() {
        Some(existing) => *existing = config,
        None => session = session.with_option_extension(config),
    }
    session
}
