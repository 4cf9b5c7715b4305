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
//! # Module map
//!
//! One folder per step of the data flow, each importing only those below it:
//!
//! | module | what it holds |
//! |---|---|
//! | `rule` | [`GpuTopKRule`]: recognises TopK and per-group window plans and replaces them |
//! | `exec` | the operators ([`GpuTopKExec`], [`GpuGroupTopKExec`], [`GpuAggregateTopKExec`]): they run the plan the cost model made and own the fallbacks |
//! | `cost` | the one place that decides: pure decisions over gathered device facts (`facts`), the model and its calibration, every policy threshold (`policy`) |
//! | `select` | the selectors, CPU and CUDA, streamed or over a whole table, built by one entry point (`create_selector`) |
//! | `input` | what a table is to the operators: memory batches, [`GpuTable`], Parquet footers, pages and dictionaries, zones, column images and their uploads, the background loader |
//! | `fusion` | the generated CUDA program that evaluates the filter and the keys, and which expressions cannot fail |
//! | `keys` | sort keys encoded into order-preserving integers |
//! | `device` | the CUDA runtime: devices, the column cache, memory pools, the engine's kernels' host side, planning of launches, errors |
//!
//! Beside them: `config` (the `gpu_topk` settings), `session` (the builder behind
//! [`SessionStateBuilderExt`]), `distributed` (feature `cluster`: the codec and stage rules for
//! datafusion-distributed, above all of them), `plan_cache` and `report`; the CLI is
//! `src/cli/` (feature `cli`).
//!
//! # Process-wide state
//!
//! A CUDA context belongs to the process, so the device and what lives on it are shared by
//! every session of the process. Each piece is a static beside its owner, which says why:
//!
//! | state | where | what |
//! |---|---|---|
//! | `STATUS`, `OTHERS` | `device` | the devices, opened once |
//! | `PLANNING_GENERATION` | `device` | changes of the device state plans depend on ([`PlanCache`] reuses plans while it holds) |
//! | `OPTIONS` | `device::options` | the environment's device options, read once |
//! | `REQUESTED_BUDGET` | `device::column_cache` | the column cache's budget ([`set_column_cache_budget`]) |
//! | `FILL_THREADS` | `device::engine::staging` | the threads that fill upload staging buffers |
//! | `CALIBRATION` | `cost::calibration` | the device's measured rates |
//! | `FOOTERS`, `DICTIONARIES` | `input::parquet` | Parquet footers, and the dictionaries of cached codes |
//! | `STARTING` | `input::loader` | background cache loads being started |
//! | `NEXT_ID` | `input::gpu_table` | [`GpuTable`] identities, which key the column cache |

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
pub use exec::{
    AggregateBackend, AggregateItem, AggregateKind, AggregateTopKSpec, GpuAggregateTopKExec,
    GpuGroupTopKExec, GpuTopKExec, GroupKey,
};
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

/// What the crate's own CLI, tests and benchmarks use of its internals: not part of the API,
/// and free to change.
#[doc(hidden)]
pub mod internal {
    pub mod config {
        pub use crate::config::{Algorithm, DeviceOp, FaultPoint};
    }
    pub mod cost {
        pub use crate::cost::{CostModel, calibration, device_algorithm, validation};
    }
    pub mod device {
        pub use crate::device::{
            AGG_FILTERED_ENTRY, AGG_HAVING_ENTRY, AggValue, AggregateCall, AggregateColumn,
            AggregateDecline, AggregateFilter, AggregateGroup, AggregateHaving, AggregateOp,
            AggregateOrder, AggregateReport, AggregateTopK, DeviceColumns, HavingColumn,
            HostColumn, RankBy, aggregate_top_k_host,
        };
        pub use crate::device::{
            DeviceAlgorithm, DevicePairs, FUSED_SAMPLE_CLUSTER, FUSED_SAMPLE_ROWS, FusedReport,
            GpuDevice, GpuError, GpuResult, GpuStatus, GpuTimer, KeyWidth, TopKEngine,
            column_cache, gpu, gpu_on, gpu_status, kernels, measure, options, plan,
            planning_generation, probed_status, slots, started_device_count, started_gpu,
        };
    }
    pub mod exec {
        pub use crate::exec::{GpuTopKExec, TopKSpec, warming_up};
    }
    pub mod fusion {
        pub use crate::fusion::aggregate::{aggregate_filter, aggregate_having};
        pub use crate::fusion::{
            ENTRY, FusedProgram, KernelInput, Part, dictionary_codes, dictionary_match,
            host_default_nan,
        };
    }
    pub mod keys {
        pub use crate::keys::{EncodedKeys, KeyLayout, KeySpec, U256};
    }
    pub mod select {
        pub use crate::select::{
            ColumnsInput, ResidentColumns, RowIds, SelectInput, SelectionSpec, cpu, cuda, row_id,
        };
    }
}
