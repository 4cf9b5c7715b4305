//! The top-k subtree: what it selects, and its replacement.

use std::sync::Arc;

use datafusion::physical_expr::LexOrdering;
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::config::GpuTopKConfig;
use crate::device::DeviceSlot;

use super::absorb::{absorb_below, in_input_order, is_column_projection, substitute_ordering};
use super::build::build_top_k;
use super::split::{Split, resolve_devices};
use super::{Declined, because};

/// Recognises a top-k subtree rooted at `node` and builds its replacement.
///
/// Under a distributed planner (`distributed`), a merge over per-partition sorts becomes two
/// operators: one per task over its share of the input (marked per-task), and one that merges
/// the tasks' rows, with a coalesce between them where the engine cuts the stages (see
/// [`crate::distributed`]).
pub(super) fn match_top_k(
    node: &Arc<dyn ExecutionPlan>,
    config: &GpuTopKConfig,
    distributed: bool,
) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
    // [GlobalLimitExec skip]
    let (skip, limit_fetch, below_limit) = match node.downcast_ref::<GlobalLimitExec>() {
        Some(limit) => (limit.skip(), limit.fetch(), limit.input()),
        None => (0, None, node),
    };
    // SortPreservingMergeExec over SortExec(preserve_partitioning), or a lone SortExec.
    // DataFusion may put a column projection between the merge and the sorts.
    let mut above_sort: Option<&ProjectionExec> = None;
    // The merge's ordering is the query's; the sorts below may carry a shorter one that
    // DataFusion normalised with the filter's equalities (for floats `x = -0.0` also holds for
    // 0.0, so a key it drops as constant can still order rows).
    let mut merge_order: Option<&LexOrdering> = None;
    let (sort_node, sort, fetch) = if let Some(merge) =
        below_limit.downcast_ref::<SortPreservingMergeExec>()
    {
        merge_order = Some(merge.expr());
        let mut below_merge = merge.input();
        if let Some(projection) = below_merge.downcast_ref::<ProjectionExec>() {
            if !is_column_projection(projection) {
                return because("computed projection between the merge and the sort");
            }
            above_sort = Some(projection);
            below_merge = projection.input();
        }
        let Some(sort) = below_merge.downcast_ref::<SortExec>() else {
            return Err(Declined::NotTopK);
        };
        let (Some(merge_fetch), Some(sort_fetch)) = (merge.fetch(), sort.fetch()) else {
            return Err(Declined::NotTopK);
        };
        (below_merge, sort, merge_fetch.min(sort_fetch))
    } else if let Some(sort) = below_limit.downcast_ref::<SortExec>() {
        let Some(fetch) = sort.fetch() else {
            return Err(Declined::NotTopK);
        };
        if sort.preserve_partitioning() && sort.input().output_partitioning().partition_count() > 1
        {
            // A per-partition TopK without a merge above it is not a whole-query top-k.
            return Err(Declined::NotTopK);
        }
        (below_limit, sort, fetch)
    } else {
        return Err(Declined::NotTopK);
    };
    if below_limit.output_partitioning().partition_count() != 1 {
        return Err(Declined::NotTopK);
    }
    // Rows to select: the limit's window [skip, skip + fetch) within the sorted input.
    let k = match limit_fetch {
        Some(f) => fetch.min(skip.saturating_add(f)),
        None => fetch,
    };
    if k > config.max_k {
        return because(format!("k = {k} exceeds gpu_topk.max_k = {}", config.max_k));
    }

    let order = match (merge_order, above_sort) {
        (Some(order), None) if order.len() > sort.expr().len() => order.clone(),
        (Some(order), Some(projection)) if order.len() > sort.expr().len() => {
            let exprs: Vec<_> = projection
                .expr()
                .iter()
                .map(|p| Arc::clone(&p.expr))
                .collect();
            substitute_ordering(order, &exprs)?
        }
        _ => sort.expr().clone(),
    };
    if merge_order.is_some() {
        let split = Split {
            sort_node,
            order: &order,
            above_sort,
            k,
            skip,
        };
        if distributed {
            return split.between_tasks(node, config);
        }
        let devices = resolve_devices(config).or_else(because)?;
        if devices.len() > 1
            && let Some(exec) = split.between_devices(node, config, &devices)?
        {
            return Ok(exec);
        }
    }
    let absorbed = in_input_order(absorb_below(sort.input(), &order, above_sort)?)?;
    let shape = Shape {
        k,
        skip,
        per_task: false,
        device: None,
    };
    let exec = build_top_k(
        absorbed,
        shape,
        config,
        node.schema(),
        node.equivalence_properties().clone(),
    )?;
    Ok(Arc::new(exec))
}

/// What a top-k operator selects: `k` rows (fetch + offset), of which the first `skip` are
/// dropped; `per_task` when it is one task's part of a distributed top-k; on which `device`
/// where the input is split between devices.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub k: usize,
    pub skip: usize,
    pub per_task: bool,
    pub device: Option<DeviceSlot>,
}
