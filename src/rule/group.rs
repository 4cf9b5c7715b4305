//! The per-group top-k subtree: a filter on a `ROW_NUMBER()`, `RANK()` or `DENSE_RANK()`
//! window over a sort by the window's
//! `PARTITION BY` and `ORDER BY` keys.
//!
//! ```text
//! FilterExec rn <= K [AND …]                         FilterExec rn <= K [AND …]
//!   [ProjectionExec of columns]                         GpuGroupTopKExec K, sort order,
//!     BoundedWindowAggExec (or WindowAggExec)   ═▶        [the projection's columns]
//!       ROW_NUMBER() OVER (PARTITION BY g… ORDER BY k…)     input
//!       SortExec g…, k…
//!         input
//! ```
//!
//! The operator takes the projection's place too and outputs only its columns, so the rows it
//! keeps carry only what the operators above read; and the filter's, where every row it keeps
//! passes the filter (`rn <= K`, `rn < K + 1`, `rn = 1` at K = 1). Where no operator above
//! needs the window's hash partitioning (`drop_unneeded_hashing`), the operator claims none
//! and the device run does not hash its rows.
//!
//! K comes from the filter's conjuncts on the row number: `rn <= K`, `rn < K + 1`, `rn = K`
//! (the operator keeps K rows a group; a filter that asks for more, such as `rn = K` at K > 1
//! or a condition on another column, stays).
//! Other window functions, several window expressions in one node, or a sort that is not the
//! window's order leave the plan to DataFusion.
//!
//! With `datafusion.optimizer.enable_window_topn`, DataFusion plans the window over its own
//! `PartitionedTopKExec` (K rows a group) instead of the sort; the operator replaces both.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_expr::split_conjunction;
use datafusion::physical_expr::window::{StandardWindowExpr, WindowExpr};
use datafusion::physical_expr::{PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::partitioned_topk::{PartitionedTopKExec, WindowFnKind};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::union::{InterleaveExec, UnionExec};
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec, WindowUDFExpr};
use datafusion::physical_plan::{Distribution, ExecutionPlan, ExecutionPlanProperties};

mod device;

use super::{Declined, because};
use crate::config::GpuTopKConfig;
use crate::exec::{GpuGroupTopKExec, RankFunction};

/// The operator in place of `node`'s window and sort, when `node` is the filter of a per-group
/// top-k subtree (see the module documentation).
pub(super) fn match_group_top_k(
    node: &Arc<dyn ExecutionPlan>,
    config: &GpuTopKConfig,
) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
    // DataFusion's own per-group plan, under a projection of columns or not.
    let projection = node
        .downcast_ref::<ProjectionExec>()
        .filter(|p| of_columns(p));
    if let Some(projection) = projection {
        match match_partitioned_topk(projection.input(), config) {
            Err(Declined::NotTopK) => {}
            Ok(exec) => return projected(exec, projection),
            Err(declined) => return Err(declined),
        }
    }
    match match_partitioned_topk(node, config) {
        Err(Declined::NotTopK) => {}
        taken_or_declined => return taken_or_declined.map(|exec| Arc::new(exec) as _),
    }
    let Some(filter) = node.downcast_ref::<FilterExec>() else {
        return Err(Declined::NotTopK);
    };
    // A projection of columns may lie between the filter and the window.
    let projection = (filter.input().downcast_ref::<ProjectionExec>()).filter(|p| of_columns(p));
    let window = projection.map_or(filter.input(), |p| p.input());
    let Some((exprs, sorted)) = window_parts(window) else {
        return Err(Declined::NotTopK);
    };
    // The row number is the window's last output column, at its place in the projection.
    let window_row_number = window.schema().fields().len() - 1;
    let row_number = match projection {
        None => Some(window_row_number),
        Some(p) => (p.expr().iter()).position(|e| {
            e.expr
                .downcast_ref::<Column>()
                .is_some_and(|c| c.index() == window_row_number)
        }),
    };
    let (Some(row_number), Some(k)) = (
        row_number,
        row_number.and_then(|rn| rows_kept(filter.predicate(), rn)),
    ) else {
        return Err(Declined::NotTopK);
    };
    let exec = if sorted.downcast_ref::<PartitionedTopKExec>().is_some() {
        match_partitioned_topk(window, config)?
    } else {
        over_sort(exprs, sorted, window, k, config)?
    };
    let exec = match projection {
        Some(projection) => exec
            .with_projection(projection)
            .or_else(|e| because(format!("per-group top-k: {e}")))?,
        None => exec,
    };
    // A filter on nothing but the number, which every kept row passes, goes too.
    if filter.fetch().is_none() && passes_every_kept_row(filter.predicate(), row_number, exec.k()) {
        return match exec.in_place_of_filter(filter) {
            Ok(exec) => Ok(Arc::new(exec)),
            Err(e) => because(format!("per-group top-k: {e}")),
        };
    }
    Arc::clone(node)
        .replace_children(
            vec![Arc::new(exec)],
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
        .or_else(|e| because(format!("per-group top-k: {e}")))
}

/// The operator in place of `window` (`exprs`) over `sorted`, keeping `k` rows a group,
/// where `sorted` is a sort by the window's `PARTITION BY` then `ORDER BY` keys.
fn over_sort(
    exprs: &[Arc<dyn WindowExpr>],
    sorted: &Arc<dyn ExecutionPlan>,
    window: &Arc<dyn ExecutionPlan>,
    k: usize,
    config: &GpuTopKConfig,
) -> std::result::Result<GpuGroupTopKExec, Declined> {
    let [expr] = exprs else {
        return because("per-group top-k: several window functions in one window");
    };
    let Some(function) = rank_function(expr.as_ref()) else {
        return because(format!(
            "per-group top-k: {} is not ROW_NUMBER(), RANK() or DENSE_RANK()",
            expr.name()
        ));
    };
    let Some(sort) = sorted.downcast_ref::<SortExec>() else {
        return because("per-group top-k: the window's input is not a sort");
    };
    if sort.fetch().is_some() {
        return because("per-group top-k: the sort below the window has a limit");
    }
    let ordering = sort.expr().clone();
    let groups = expr.partition_by();
    let order = expr.order_by();
    let sort_exprs: Vec<_> = ordering.iter().collect();
    // The window's order as DataFusion sorts it: without the keys that repeat a group key
    // (constant within a group) or an earlier order key.
    let mut order_keys: Vec<&PhysicalSortExpr> = Vec::new();
    for o in order {
        let repeated = groups.iter().any(|g| g.eq(&o.expr))
            || order_keys.iter().any(|earlier| earlier.expr.eq(&o.expr));
        if !repeated {
            order_keys.push(o);
        }
    }
    let leading_are_groups = sort_exprs.len() == groups.len() + order_keys.len()
        && groups
            .iter()
            .all(|g| sort_exprs[..groups.len()].iter().any(|s| s.expr.eq(g)))
        && (sort_exprs[groups.len()..].iter().zip(&order_keys)).all(|(s, o)| s == o);
    if !leading_are_groups {
        return because(format!(
            "per-group top-k: the sort [{ordering}] is not the window's PARTITION BY then ORDER BY"
        ));
    }
    let input = Arc::clone(sort.input());
    if input.boundedness().is_unbounded() {
        return because("per-group top-k: the input is unbounded");
    }
    group_exec(input, function, ordering, groups.len(), k, window, config)
}

/// Whether `projection` only picks (and names) columns.
fn of_columns(projection: &ProjectionExec) -> bool {
    (projection.expr().iter()).all(|e| e.expr.downcast_ref::<Column>().is_some())
}

/// `exec` in place of `projection` (of columns) over its window: it outputs only the columns
/// the operators above read.
fn projected(
    exec: GpuGroupTopKExec,
    projection: &ProjectionExec,
) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
    match exec.with_projection(projection) {
        Ok(exec) => Ok(Arc::new(exec)),
        Err(e) => because(format!("per-group top-k: {e}")),
    }
}

/// DataFusion's own per-group plan (`datafusion.optimizer.enable_window_topn`): a
/// `ROW_NUMBER()` or `RANK()` window over a `PartitionedTopKExec`, which keeps `fetch` rows a
/// group (with the ties of the last under `RANK()`). The operator takes the place of both; a
/// filter DataFusion kept above stays.
fn match_partitioned_topk(
    node: &Arc<dyn ExecutionPlan>,
    config: &GpuTopKConfig,
) -> std::result::Result<GpuGroupTopKExec, Declined> {
    let Some((exprs, below)) = window_parts(node) else {
        return Err(Declined::NotTopK);
    };
    let Some(topk) = below.downcast_ref::<PartitionedTopKExec>() else {
        return Err(Declined::NotTopK);
    };
    let [expr] = exprs else {
        return because("per-group top-k: several window functions over PartitionedTopKExec");
    };
    let wanted = match topk.fn_kind() {
        WindowFnKind::RowNumber => RankFunction::RowNumber,
        WindowFnKind::Rank => RankFunction::Rank,
    };
    let function = rank_function(expr.as_ref()).filter(|f| *f == wanted);
    let Some(function) = function else {
        return because(format!(
            "per-group top-k: {} over a PartitionedTopKExec of another function",
            expr.name()
        ));
    };
    let input = Arc::clone(topk.input());
    if input.boundedness().is_unbounded() {
        return because("per-group top-k: the input is unbounded");
    }
    let (ordering, groups, k) = (
        topk.expr().clone(),
        topk.partition_prefix_len(),
        topk.fetch(),
    );
    group_exec(input, function, ordering, groups, k, node, config)
}

/// A window node's expressions and its input.
type WindowParts<'a> = (&'a [Arc<dyn WindowExpr>], &'a Arc<dyn ExecutionPlan>);

/// [`WindowParts`] of a window node.
fn window_parts(node: &Arc<dyn ExecutionPlan>) -> Option<WindowParts<'_>> {
    if let Some(w) = node.downcast_ref::<BoundedWindowAggExec>() {
        Some((w.window_expr(), w.input()))
    } else {
        let w = node.downcast_ref::<WindowAggExec>()?;
        Some((w.window_expr(), w.input()))
    }
}

/// The operator in place of `window` over `input` sorted by `ordering` (its first `groups`
/// keys the groups), keeping `k` rows a group: on the GPU where the rule places it there,
/// else on the CPU path with the reason.
fn group_exec(
    input: Arc<dyn ExecutionPlan>,
    function: RankFunction,
    ordering: datafusion::physical_expr::LexOrdering,
    groups: usize,
    k: usize,
    window: &Arc<dyn ExecutionPlan>,
    config: &GpuTopKConfig,
) -> std::result::Result<GpuGroupTopKExec, Declined> {
    let mut estimate = None;
    let device = device::group_device(&input, &ordering, (groups, k), config, &mut estimate);
    let exec = GpuGroupTopKExec::try_new(input, function, ordering, groups, k, window.as_ref())
        .or_else(|e| because(format!("per-group top-k: {e}")))?
        .with_groups_estimate(estimate);
    Ok(match device {
        Ok(plan) => exec.with_device(plan),
        Err(cpu) => exec.with_cpu_plan(cpu),
    })
}

/// The operator's function for `expr`: `ROW_NUMBER()`, `RANK()` or `DENSE_RANK()`, `None`
/// for any other.
fn rank_function(expr: &dyn WindowExpr) -> Option<RankFunction> {
    let function = expr
        .as_any()
        .downcast_ref::<StandardWindowExpr>()?
        .get_standard_func_expr()
        .as_any()
        .downcast_ref::<WindowUDFExpr>()?
        .fun()
        .name()
        .to_string();
    match function.as_str() {
        "row_number" => Some(RankFunction::RowNumber),
        "rank" => Some(RankFunction::Rank),
        "dense_rank" => Some(RankFunction::DenseRank),
        _ => None,
    }
}

/// `conjunct` as a bound on the row number in column `row_number`, `rn op v` with `op` one
/// of `<=`, `<` and `=` (either side), else `None`.
fn row_number_bound(
    conjunct: &Arc<dyn PhysicalExpr>,
    row_number: usize,
) -> Option<(Operator, u64)> {
    let binary = conjunct.downcast_ref::<BinaryExpr>()?;
    let is_rn = |e: &Arc<dyn PhysicalExpr>| {
        e.downcast_ref::<Column>()
            .is_some_and(|c| c.index() == row_number)
    };
    let literal = |e: &Arc<dyn PhysicalExpr>| -> Option<u64> {
        match e.downcast_ref::<Literal>()?.value() {
            ScalarValue::UInt64(Some(v)) => Some(*v),
            ScalarValue::Int64(Some(v)) => u64::try_from(*v).ok(),
            _ => None,
        }
    };
    let (op, v) = if is_rn(binary.left()) {
        (*binary.op(), literal(binary.right())?)
    } else if is_rn(binary.right()) {
        let flipped = match binary.op() {
            Operator::GtEq => Operator::LtEq,
            Operator::Gt => Operator::Lt,
            Operator::Eq => Operator::Eq,
            _ => return None,
        };
        (flipped, literal(binary.left())?)
    } else {
        return None;
    };
    matches!(op, Operator::LtEq | Operator::Lt | Operator::Eq).then_some((op, v))
}

/// The rows a group keeps under `predicate` (a conjunction) on the row number in column
/// `row_number`: the smallest bound of its `rn <= K`, `rn < K`, `rn = K` conjuncts (either
/// side), `None` where it has none.
fn rows_kept(predicate: &Arc<dyn PhysicalExpr>, row_number: usize) -> Option<usize> {
    split_conjunction(predicate)
        .into_iter()
        .filter_map(|c| row_number_bound(c, row_number))
        .map(|(op, v)| match op {
            Operator::Lt => v.saturating_sub(1),
            _ => v,
        })
        .min()
        .map(|k| usize::try_from(k).unwrap_or(usize::MAX))
}

/// Whether every row the operator keeps at `k` rows a group passes `predicate`: each of its
/// conjuncts bounds the number (column `row_number`) at `k` or above, or is `= 1` with `k` at
/// most 1. A kept row's number is at most `k` under each function (`RANK()`'s ties at the
/// K-th share a number at most `k`).
fn passes_every_kept_row(predicate: &Arc<dyn PhysicalExpr>, row_number: usize, k: usize) -> bool {
    let k = k as u64;
    split_conjunction(predicate)
        .into_iter()
        .all(|c| match row_number_bound(c, row_number) {
            Some((Operator::LtEq, v)) => v >= k,
            Some((Operator::Lt, v)) => v > k,
            Some((Operator::Eq, 1)) => k <= 1,
            _ => false,
        })
}

/// Rows of an in-memory table [`estimate_groups`] reads, and the batches it reads them from.
const GROUPS_SAMPLE: usize = 1 << 14;
const GROUPS_SAMPLE_BATCHES: usize = 256;

/// How [`estimate_groups`] counts the groups its sample missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unseen {
    /// Chao's estimate, f1² / 2f2 from the groups seen once and twice: a lower bound, close
    /// where the sample meets most groups (the per-group top-k's choices are measured with it).
    Chao,
    /// The geometric mean of Chao's bound and Shlosser's estimate (the groups seen scaled by
    /// the sampling fraction, weighted by how often they were seen), which overshoots where
    /// Chao's falls short: keys of skewed sizes whose small sample is mostly groups seen once,
    /// as users by their tweets. A top-k over an aggregate sizes its hash table by it.
    Hybrid,
}

/// The number of distinct `group_exprs` among the rows of `memory` that pass `filter`,
/// estimated from a sample: every n-th row of every m-th batch, [`GROUPS_SAMPLE`] rows from
/// at most [`GROUPS_SAMPLE_BATCHES`] batches (few batch operations at planning). Exact where
/// the sample is the table; else the groups seen plus those unseen as `unseen` counts them,
/// at most one a passing row. `None` where an expression fails on the sample.
pub(super) fn estimate_groups(
    memory: &crate::input::memory::MemoryInput<'_>,
    filter: Option<&Arc<dyn PhysicalExpr>>,
    group_exprs: &[Arc<dyn PhysicalExpr>],
    unseen: Unseen,
) -> Option<usize> {
    use datafusion::arrow::array::{AsArray, UInt32Array};
    use datafusion::arrow::compute::{filter_record_batch, take_record_batch};
    use datafusion::arrow::row::{RowConverter, SortField};
    let batches: Vec<_> = memory.batches().filter(|b| b.num_rows() > 0).collect();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let batch_step = batches.len().div_ceil(GROUPS_SAMPLE_BATCHES).max(1);
    let read: usize = batches
        .iter()
        .step_by(batch_step)
        .map(|b| b.num_rows())
        .sum();
    let row_step = read.div_ceil(GROUPS_SAMPLE).max(1);
    let mut converter = None;
    let mut counts: HashMap<Vec<u8>, usize> = HashMap::new();
    let (mut sampled, mut passed) = (0, 0);
    for batch in batches.iter().step_by(batch_step) {
        let picked = (0..batch.num_rows()).step_by(row_step).map(|i| i as u32);
        let picked = UInt32Array::from_iter_values(picked);
        sampled += picked.len();
        let sample = take_record_batch(&memory.project(batch).ok()?, &picked).ok()?;
        let sample = match filter {
            Some(filter) => {
                let mask = filter.evaluate(&sample).ok()?;
                let mask = mask.into_array(sample.num_rows()).ok()?;
                filter_record_batch(&sample, mask.as_boolean_opt()?).ok()?
            }
            None => sample,
        };
        let columns = (group_exprs.iter())
            .map(|e| e.evaluate(&sample)?.into_array(sample.num_rows()))
            .collect::<datafusion::error::Result<Vec<_>>>()
            .ok()?;
        if converter.is_none() {
            let fields = columns
                .iter()
                .map(|c| SortField::new(c.data_type().clone()));
            converter = Some(RowConverter::new(fields.collect()).ok()?);
        }
        let keys = converter.as_ref()?.convert_columns(&columns).ok()?;
        passed += keys.num_rows();
        for key in keys.iter() {
            *counts.entry(key.as_ref().to_vec()).or_default() += 1;
        }
    }
    if group_exprs.is_empty() {
        return Some(usize::from(passed > 0));
    }
    let seen = counts.len();
    if batch_step == 1 && row_step == 1 {
        return Some(seen);
    }
    let once = counts.values().filter(|&&c| c == 1).count() as f64;
    let twice = counts.values().filter(|&&c| c == 2).count() as f64;
    // Each sampled row stands for this many of the table.
    let scale = rows as f64 / sampled.max(1) as f64;
    let most = (passed as f64 * scale).round() as usize;
    let chao = (seen + (once * once / (2.0 * twice.max(1.0))) as usize).min(most);
    match unseen {
        Unseen::Chao => Some(chao),
        Unseen::Hybrid => {
            let q = 1.0 / scale;
            let (mut spread, mut hit) = (0.0, 0.0);
            for &c in counts.values() {
                spread += (1.0 - q).powi(c as i32);
                hit += c as f64 * q * (1.0 - q).powi(c as i32 - 1);
            }
            let shlosser = seen as f64 + once * spread / hit.max(f64::MIN_POSITIVE);
            let shlosser = (shlosser.min(most as f64)).round() as usize;
            Some(((chao as f64 * shlosser as f64).sqrt().round() as usize).clamp(seen, most))
        }
    }
}

/// `plan` with every [`GpuGroupTopKExec`] whose hash partitioning no operator above needs
/// claiming none (see [`GpuGroupTopKExec::without_hash_partitioning`]). An operator needs its
/// child's partitioning where it requires a distribution of its input, or where it passes the
/// child's partitioning on (every operator but those that make their own: repartitions,
/// merges, unions) and its own is needed. The root's is not.
pub(super) fn drop_unneeded_hashing(
    plan: Arc<dyn ExecutionPlan>,
) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
    fn walk(
        plan: &Arc<dyn ExecutionPlan>,
        needed: bool,
    ) -> datafusion::error::Result<Option<Arc<dyn ExecutionPlan>>> {
        if let Some(group) = plan.downcast_ref::<GpuGroupTopKExec>() {
            return Ok(match needed {
                true => None,
                false => (group.without_hash_partitioning()).map(|g| Arc::new(g) as _),
            });
        }
        let own = plan.downcast_ref::<RepartitionExec>().is_some()
            || plan.downcast_ref::<CoalescePartitionsExec>().is_some()
            || plan.downcast_ref::<SortPreservingMergeExec>().is_some();
        let passes = needed && !own && plan.downcast_ref::<UnionExec>().is_none();
        if plan.downcast_ref::<InterleaveExec>().is_some() {
            // Its rows are grouped by its inputs' common hash partitioning.
            return Ok(None);
        }
        let required = plan.input_distribution_requirements();
        let children = plan.children();
        let mut changed = false;
        let mut new_children = Vec::with_capacity(children.len());
        for (i, child) in children.into_iter().enumerate() {
            let requires = required
                .child_distribution(i)
                .is_some_and(|d| !matches!(d, Distribution::UnspecifiedDistribution));
            match walk(child, requires || passes)? {
                Some(new) => {
                    changed = true;
                    new_children.push(new);
                }
                None => new_children.push(Arc::clone(child)),
            }
        }
        match changed {
            true => Arc::clone(plan)
                .replace_children(
                    new_children,
                    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
                )
                .map(Some),
            false => Ok(None),
        }
    }
    Ok(walk(&plan, false)?.unwrap_or(plan))
}
