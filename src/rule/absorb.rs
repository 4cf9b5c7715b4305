//! The nodes below the sort that the operator absorbs, and the order it reads its input in.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, Partitioning};

use crate::fusion::cannot_fail;

use super::{Declined, because};

/// The operator's inputs once the nodes below the sort are absorbed; every expression is
/// rewritten against `input`'s schema.
#[derive(Clone)]
pub(super) struct Absorbed {
    pub(super) input: Arc<dyn ExecutionPlan>,
    pub(super) sort_exprs: LexOrdering,
    pub(super) filter: Option<Arc<dyn PhysicalExpr>>,
    /// One per column of the sort's input (the operator's output before any projection above).
    pub(super) output_exprs: Vec<Arc<dyn PhysicalExpr>>,
}

pub(super) fn absorb_below(
    sort_input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    above_sort: Option<&ProjectionExec>,
) -> std::result::Result<Absorbed, Declined> {
    let schema = sort_input.schema();
    let output_exprs = output_columns(above_sort, &schema);
    let mut absorbed = Absorbed {
        input: Arc::clone(sort_input),
        sort_exprs: ordering.clone(),
        filter: None,
        output_exprs,
    };
    loop {
        let node = Arc::clone(&absorbed.input);
        if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
            if !cannot_fail_projection(projection) {
                break;
            }
            let exprs: Vec<_> = projection
                .expr()
                .iter()
                .map(|p| Arc::clone(&p.expr))
                .collect();
            absorbed.substitute(&exprs)?;
            absorbed.input = Arc::clone(projection.input());
        } else if let Some(filter) = node.downcast_ref::<FilterExec>() {
            if absorbed.filter.is_some() {
                break; // one predicate: DataFusion evaluates stacked filters in sequence
            }
            if let Some(projection) = filter.projection() {
                let input_schema = filter.input().schema();
                let exprs: Vec<Arc<dyn PhysicalExpr>> = projection
                    .iter()
                    .map(|&i| {
                        Arc::new(Column::new(input_schema.field(i).name(), i))
                            as Arc<dyn PhysicalExpr>
                    })
                    .collect();
                absorbed.substitute(&exprs)?;
            }
            absorbed.filter = Some(Arc::clone(filter.predicate()));
            absorbed.input = Arc::clone(filter.input());
        } else if let Some(coalesce) = node.downcast_ref::<CoalescePartitionsExec>() {
            if coalesce.fetch().is_some() {
                break;
            }
            absorbed.input = Arc::clone(coalesce.input());
        } else if let Some(repartition) = node.downcast_ref::<RepartitionExec>() {
            if !matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_))
                || repartition.preserve_order()
            {
                break;
            }
            absorbed.input = Arc::clone(repartition.input());
        } else {
            break;
        }
    }
    Ok(absorbed)
}

impl Absorbed {
    /// Rewrites every expression through a projection: column `i` becomes `exprs[i]`.
    fn substitute(&mut self, exprs: &[Arc<dyn PhysicalExpr>]) -> std::result::Result<(), Declined> {
        let rewrite = |expr: &Arc<dyn PhysicalExpr>| substitute_columns(expr, exprs);
        self.sort_exprs = substitute_ordering(&self.sort_exprs, exprs)?;
        if let Some(filter) = &self.filter {
            self.filter = Some(rewrite(filter)?);
        }
        self.output_exprs = self
            .output_exprs
            .iter()
            .map(&rewrite)
            .collect::<std::result::Result<_, _>>()?;
        Ok(())
    }
}

/// `expr` with every column `i` replaced by `exprs[i]` (the expressions a projection computes).
pub(super) fn substitute_columns(
    expr: &Arc<dyn PhysicalExpr>,
    exprs: &[Arc<dyn PhysicalExpr>],
) -> std::result::Result<Arc<dyn PhysicalExpr>, Declined> {
    Arc::clone(expr)
        .transform_down(|e| match e.downcast_ref::<Column>() {
            Some(col) => match exprs.get(col.index()) {
                Some(replacement) => Ok(Transformed::new(
                    Arc::clone(replacement),
                    true,
                    datafusion::common::tree_node::TreeNodeRecursion::Jump,
                )),
                None => datafusion::common::internal_err!("column {col} out of range"),
            },
            None => Ok(Transformed::no(e)),
        })
        .data()
        .or_else(|e| because(format!("cannot rewrite expression: {e}")))
}

/// [`substitute_columns`] over an ordering.
pub(super) fn substitute_ordering(
    ordering: &LexOrdering,
    exprs: &[Arc<dyn PhysicalExpr>],
) -> std::result::Result<LexOrdering, Declined> {
    let mut sort_exprs = Vec::with_capacity(ordering.len());
    for s in ordering.iter() {
        sort_exprs.push(PhysicalSortExpr::new(
            substitute_columns(&s.expr, exprs)?,
            s.options,
        ));
    }
    LexOrdering::new(sort_exprs).ok_or_else(|| Declined::Because("empty ordering".into()))
}

/// The columns a top-k outputs: the expressions of the projection above its sort, or else
/// every column of `schema` (the sort's input) as it is.
pub(super) fn output_columns(
    above_sort: Option<&ProjectionExec>,
    schema: &datafusion::arrow::datatypes::Schema,
) -> Vec<Arc<dyn PhysicalExpr>> {
    match above_sort {
        Some(projection) => (projection.expr().iter())
            .map(|p| Arc::clone(&p.expr))
            .collect(),
        None => (0..schema.fields().len())
            .map(|i| Arc::new(Column::new(schema.field(i).name(), i)) as Arc<dyn PhysicalExpr>)
            .collect(),
    }
}

/// `absorbed` reading its input in a fixed order: without round-robin repartitioning or
/// coalescing left above it, its file scans reading their files in order.
pub(super) fn in_input_order(mut absorbed: Absorbed) -> std::result::Result<Absorbed, Declined> {
    absorbed.input = without_round_robin(Arc::clone(&absorbed.input))
        .and_then(scans_in_order)
        .or_else(|e| because(format!("cannot fix the input's order: {e}")))?;
    Ok(absorbed)
}

/// The input without the round-robin repartitioning (or partition coalescing) that row-wise
/// nodes left above it (a computed projection, a second filter) read from: which partition a
/// batch goes to there depends on timing.
fn without_round_robin(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    if let Some(repartition) = plan.downcast_ref::<RepartitionExec>()
        && matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_))
        && !repartition.preserve_order()
    {
        return without_round_robin(Arc::clone(repartition.input()));
    }
    if let Some(coalesce) = plan.downcast_ref::<CoalescePartitionsExec>()
        && coalesce.fetch().is_none()
    {
        return without_round_robin(Arc::clone(coalesce.input()));
    }
    let row_wise = plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<FilterExec>().is_some();
    if !row_wise {
        return Ok(plan);
    }
    let child = Arc::clone(plan.children()[0]);
    let new_child = without_round_robin(Arc::clone(&child))?;
    if Arc::ptr_eq(&child, &new_child) {
        return Ok(plan);
    }
    plan.replace_children(
        vec![new_child],
        ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
    )
}

/// The input with every file scan reading its own file groups in order. By default a scan's
/// partitions steal unread files from each other at run time, so which partition (and thus
/// which input position) a row has depends on timing; ties are broken by input position, which
/// must not.
fn scans_in_order(input: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    input
        .transform_up(|node| {
            if node.downcast_ref::<DataSourceExec>().is_none() {
                return Ok(Transformed::no(node));
            }
            Ok(match node.with_preserve_order(true) {
                Some(ordered) => Transformed::yes(ordered),
                None => Transformed::no(node),
            })
        })
        .data()
}

/// A projection below the sort whose every expression cannot fail ([`cannot_fail::arithmetic`]): the operator may then
/// evaluate it on the rows it needs only (the sort keys on every row, in its generated code,
/// the output columns on the winners). Another computed column must be evaluated on every row,
/// as DataFusion does (its errors included), so such a projection is not absorbed.
fn cannot_fail_projection(projection: &ProjectionExec) -> bool {
    let schema = projection.input().schema();
    projection
        .expr()
        .iter()
        .all(|p| cannot_fail::arithmetic(&p.expr, &schema))
}

/// Columns and literals only: a computed column must be evaluated on every row, as DataFusion
/// does (its errors included), so such a projection is not absorbed.
pub(super) fn is_column_projection(projection: &ProjectionExec) -> bool {
    projection
        .expr()
        .iter()
        .all(|p| p.expr.is::<Column>() || p.expr.is::<Literal>())
}
