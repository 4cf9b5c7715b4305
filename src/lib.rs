//! datafusion-gpu-topk: run DataFusion's `ORDER BY … LIMIT k` on NVIDIA GPUs.
//!
//! An application adds the operator to its session with one line,
//! [`SessionStateBuilderExt::with_gpu_topk`], and tunes it with [`GpuTopKConfig`] (also from
//! SQL: `SET gpu_topk.backend = 'cpu'`). The rule ([`GpuTopKRule`]) replaces DataFusion's
//! TopK by [`GpuTopKExec`] wherever the query's shape allows; results are exactly DataFusion's,
//! and a GPU failure falls back to the operator's CPU path. Over in-memory tables and Parquet
//! files the GPU keeps
//! the columns top-k queries read in device memory between queries, in a column cache that is
//! the process's ([`set_column_cache_budget`] sizes it); [`GpuTable`] is the in-memory table
//! made for that (constant-time planning, columns loaded and pinned ahead).
//! [`datasets`] generates the tweets table of the benchmarks and the CLI. Under
//! datafusion-distributed (feature `cluster`, on by default),
//! [`SessionStateBuilderExt::with_gpu_topk_cluster`] and [`gpu_worker`] run the operator on a
//! cluster's workers, each with its own GPU. With `default-features = false` the crate is the
//! library alone: no CLI (feature `cli`), no cluster and no gRPC stack.
//!
//! Inside, one module per step of the data flow, each importing only those after it
//! (`distributed`, the operator's codec and stage rules for a cluster, sits above them all;
//! [`SessionStateBuilderExt`], here, calls `session`'s and its builders): `rule`
//! rewrites the physical plan → `exec` runs the operator, executing the plan and owning the
//! fallbacks → `cost` chooses where, with which algorithm and over which input form (one
//! `SelectionPlan`) → `select` runs the selection on the CPU or the device → `fusion`
//! generates the CUDA code that evaluates the predicate and keys on the device, and `keys`
//! encodes sort keys into order-preserving integers → `device` holds the CUDA runtime, its
//! planning and the kernels' host side.

// Internal docs link internal items: contributors read them with --document-private-items.
#![allow(rustdoc::private_intra_doc_links)]

mod config;
mod cost;
#[path = "../datasets/mod.rs"]
pub mod datasets;
mod device;
#[cfg(feature = "cluster")]
mod distributed;
mod exec;
mod fusion;
mod input;
mod keys;
mod plan_cache;
mod report;
mod rule;
mod select;
mod session;

pub use config::{Algorithm, Backend, DeviceOp, FaultPoint, GpuTopKConfig, GpuTopKSettings};
pub use device::column_cache::{column_cache_budget, set_column_cache_budget};
#[cfg(feature = "cluster")]
pub use distributed::{GpuTopKCodec, StaticWorkers, gpu_worker};
pub use exec::{GpuGroupTopKExec, GpuTopKExec};
pub use input::gpu_table::{GpuTable, GpuTableExec, GpuTableFactory};
pub use plan_cache::{CachedPlan, PlanCache, PlanCacheStats};
pub use report::{gpu_summary, topk_report};
pub use rule::GpuTopKRule;

use datafusion::execution::SessionStateBuilder;

/// Adds the GPU top-k operator to a [`SessionStateBuilder`].
pub trait SessionStateBuilderExt {
    /// Registers the `gpu_topk` settings (with `config` as their values), inserts
    /// [`GpuTopKRule`] into the physical optimizer just before `PushdownSort` (and so before
    /// `FilterPushdown(Post)`), registers the table functions `gpu_topk_cache()` (the
    /// device column cache's entries) and `gpu_topk_cache_clear()` (evicts every entry not in
    /// use and says how many), and `CREATE EXTERNAL TABLE … STORED AS GPU` ([`GpuTableFactory`]).
    fn with_gpu_topk(self, config: GpuTopKConfig) -> Self;

    /// Makes the operator run under datafusion-distributed: registers its codec
    /// ([`GpuTopKCodec`]) and the rules by which the engine splits its stages
    /// ([`crate::distributed`]). Call it on the coordinator's builder (with the engine's
    /// `with_distributed_worker_resolver` and `with_distributed_planner`) and on every
    /// worker's ([`gpu_worker`] does). Feature `cluster`.
    #[cfg(feature = "cluster")]
    fn with_gpu_topk_cluster(self) -> Self;
}

impl SessionStateBuilderExt for SessionStateBuilder {
    fn with_gpu_topk(self, config: GpuTopKConfig) -> Self {
        session::with_gpu_topk(self, config)
    }

    #[cfg(feature = "cluster")]
    fn with_gpu_topk_cluster(self) -> Self {
        distributed::with_gpu_topk_cluster(self)
    }
}

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
