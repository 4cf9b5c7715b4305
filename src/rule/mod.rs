//! [`GpuTopKRule`]: the physical-optimizer rule that puts
//! [`GpuTopKExec`](crate::exec::GpuTopKExec) into plans.
//!
//! It collapses DataFusion's top-k subtree
//!
//! ```text
//! [GlobalLimitExec skip=m]
//!   SortPreservingMergeExec fetch=k+m          ═▶   GpuTopKExec k+m, skip=m, keys, filter, output
//!     SortExec TopK fetch=k+m                          input (everything below the absorbed nodes)
//!       [ProjectionExec of columns]
//!         [FilterExec predicate, projection]
//!           [RepartitionExec round-robin] [CoalescePartitionsExec]
//!             input
//! ```
//!
//! (and the single-partition form, a lone `SortExec` TopK). Matching is on node types and
//! expression structure only: column references are followed through each absorbed node's
//! projection, so the rule never depends on DataFusion's column order.
//!
//! Round-robin repartitioning and partition coalescing directly below are dropped: our operator
//! reads every partition itself, and without them the input order (partition, batch, row) is
//! deterministic, which is what makes ties deterministic. For the same reason the file scans
//! below read each partition's own files in order (DataFusion lets idle partitions steal unread
//! files at run time). An input whose own order varies between runs (rows merged from several
//! partitions by a hash repartition, as below a join or an aggregation) breaks its ties in the
//! order it delivers, as DataFusion's TopK does.
//!
//! Unbounded inputs are left to DataFusion (a top-k emits only once its input ends).
//!
//! With several devices (`gpu_topk.devices`), a merge over per-partition sorts of a file or
//! in-memory scan becomes an operator per device, each over a contiguous run of the scan's
//! partitions, under a `UnionExec` and one operator that merges their rows on the CPU path,
//! reading the union's partitions in order so that ties keep the input order (`Split`). Under
//! datafusion-distributed's planner the same split makes an operator per task instead.
//!
//! Before the top-k subtrees, the rule replaces each per-group top-k subtree (a filter on a
//! `ROW_NUMBER()` window over a sort) with [`crate::exec::GpuGroupTopKExec`] (`group`), so
//! that an outer top-k over its rows is then taken as any other.
//!
//! With `gpu_topk.aggregate_topk`, a top-k over an aggregation (`GROUP BY … ORDER BY … LIMIT`)
//! becomes one [`crate::exec::GpuAggregateTopKExec`] (`aggregate`), which keeps DataFusion's
//! subtree as its child: the rule does not enter it. One whose aggregation does not translate
//! is taken as any other top-k, its operator showing why in EXPLAIN.
//!
//! A shape or type the operator cannot take leaves the plan untouched (the rule never errors);
//! the reason is logged and kept in [`GpuTopKRule::last_decisions`].
//!
//! One file each: `top_k` (the top-k subtree and what it selects), `absorb` (the nodes below
//! the sort the operator takes in, and its input's order), `split` (parts per device or per
//! task, and their merge), `build` (the operator's keys, fusion plan and placement), `worker`
//! (a distributed engine's worker planning its part again), `group` (the per-group top-k),
//! `aggregate` (the top-k over an aggregation).

use std::sync::{Arc, Mutex};

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;

mod absorb;
mod aggregate;
mod build;
mod group;
mod split;
mod top_k;
#[cfg(feature = "cluster")]
mod worker;

use crate::config::GpuTopKConfig;
use crate::exec::{GpuAggregateTopKExec, GpuTopKExec};

#[cfg(feature = "cluster")]
pub(crate) use top_k::Shape;
#[cfg(feature = "cluster")]
pub(crate) use worker::decoded_top_k;

/// See the module documentation.
#[derive(Debug)]
pub struct GpuTopKRule {
    /// Used when the session has no `gpu_topk` extension registered.
    default_config: GpuTopKConfig,
    decisions: Mutex<Vec<String>>,
}

impl GpuTopKRule {
    pub const NAME: &'static str = "GpuTopKRule";

    pub fn new(default_config: GpuTopKConfig) -> Self {
        Self {
            default_config,
            decisions: Mutex::new(Vec::new()),
        }
    }

    /// Why top-k subtrees of the last optimized plan were left to DataFusion (one line each).
    pub fn last_decisions(&self) -> Vec<String> {
        self.decisions.lock().map(|d| d.clone()).unwrap_or_default()
    }
}

impl PhysicalOptimizerRule for GpuTopKRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let config = options
            .extensions
            .get::<GpuTopKConfig>()
            .unwrap_or(&self.default_config);
        let mut decisions = Vec::new();
        if !config.enabled {
            decisions.push("gpu_topk.enabled = false".to_string());
            *self.decisions.lock().unwrap_or_else(|e| e.into_inner()) = decisions;
            return Ok(plan);
        }
        let distributed = split::distributed_planning(options);
        // Per-group top-k first: an outer top-k may absorb the filter on the row number.
        let plan = if distributed {
            // The engine splits a window plan's stages by its hash repartition; the operator
            // reads every group of its input, so it would have to run as one task.
            decisions.push(
                "per-group top-k in a distributed plan stays with DataFusion's window plan"
                    .to_string(),
            );
            plan
        } else {
            let plan = rewrite(plan, &mut decisions, "window plan", |node| {
                group::match_group_top_k(node, config)
            })?;
            group::drop_unneeded_hashing(plan)?
        };
        // The engine cuts a distributed plan's stages at the aggregation's repartition.
        let aggregates = config.aggregate_topk && !distributed;
        let plan = rewrite(plan, &mut decisions, "TopK", |node| {
            let top_k = || top_k::match_top_k(node, config, distributed);
            if !aggregates {
                return top_k();
            }
            match aggregate::match_aggregate_top_k(node, config) {
                Err(Declined::NotTopK) => top_k(),
                Err(Declined::Because(why)) => match top_k() {
                    Ok(exec) => Ok(noting_aggregate_kept(exec, &why)),
                    Err(Declined::Because(also)) => because(format!("{why}; {also}")),
                    Err(Declined::NotTopK) => because(why),
                },
                taken => taken,
            }
        })?;
        *self.decisions.lock().unwrap_or_else(|e| e.into_inner()) = decisions;
        Ok(plan)
    }

    fn name(&self) -> &str {
        Self::NAME
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `plan` with every node `replace` takes replaced, top down; why a node was left to
/// DataFusion (its `kept` plan) goes to `decisions`.
fn rewrite(
    plan: Arc<dyn ExecutionPlan>,
    decisions: &mut Vec<String>,
    kept: &str,
    replace: impl Fn(&Arc<dyn ExecutionPlan>) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_down(|node| {
        // It keeps DataFusion's subtree as its child, to run as it is.
        let keeps_subtree = |n: &Arc<dyn ExecutionPlan>| n.is::<GpuAggregateTopKExec>();
        if keeps_subtree(&node) {
            return Ok(Transformed::new(node, false, TreeNodeRecursion::Jump));
        }
        match replace(&node) {
            Ok(exec) if keeps_subtree(&exec) => {
                Ok(Transformed::new(exec, true, TreeNodeRecursion::Jump))
            }
            Ok(exec) => Ok(Transformed::yes(exec)),
            Err(Declined::NotTopK) => Ok(Transformed::no(node)),
            Err(Declined::Because(why)) => {
                log::info!("gpu-topk: DataFusion's {kept} kept: {why}");
                decisions.push(why);
                Ok(Transformed::no(node))
            }
        }
    })
    .data()
}

/// `exec` (a top-k's replacement) showing in EXPLAIN why the aggregation below stays
/// DataFusion's.
fn noting_aggregate_kept(exec: Arc<dyn ExecutionPlan>, why: &str) -> Arc<dyn ExecutionPlan> {
    match exec.downcast_ref::<GpuTopKExec>() {
        Some(top_k) => Arc::new(top_k.with_aggregate_kept(why)),
        None => exec,
    }
}

enum Declined {
    /// The node does not start a top-k subtree.
    NotTopK,
    /// It does, but we leave it to DataFusion, for this reason.
    Because(String),
}

fn because<T>(why: impl Into<String>) -> std::result::Result<T, Declined> {
    Err(Declined::Because(why.into()))
}
