//! The operator a worker of a distributed engine plans from the expressions it decodes.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::config::GpuTopKConfig;

use super::Declined;
use super::absorb::{Absorbed, in_input_order};
use super::build::build_top_k;
use super::top_k::Shape;

/// A top-k's sort keys, fused predicate and output columns, over its input's schema.
pub(crate) type TopKExprs = (
    LexOrdering,
    Option<Arc<dyn PhysicalExpr>>,
    Vec<Arc<dyn PhysicalExpr>>,
);

/// The operator a worker decodes ([`crate::distributed`]): `GpuTopKExec` planned again on
/// this machine (its device, cache and calibration) from the expressions the coordinator's
/// rule absorbed, or, where this machine declines it (no GPU under `backend = auto`),
/// DataFusion's plan of the same rows: filter, sort with fetch, projection, offset.
pub(crate) fn decoded_top_k(
    input: Arc<dyn ExecutionPlan>,
    (sort_exprs, filter, output_exprs): TopKExprs,
    shape: Shape,
    config: &GpuTopKConfig,
    schema: datafusion::arrow::datatypes::SchemaRef,
    equivalences: datafusion::physical_expr::EquivalenceProperties,
) -> Result<Arc<dyn ExecutionPlan>> {
    let absorbed = Absorbed {
        input: Arc::clone(&input),
        sort_exprs: sort_exprs.clone(),
        filter: filter.clone(),
        output_exprs: output_exprs.clone(),
    };
    let planned = in_input_order(absorbed).and_then(|absorbed| {
        build_top_k(absorbed, shape, config, Arc::clone(&schema), equivalences)
    });
    let why = match planned {
        Ok(exec) => return Ok(Arc::new(exec)),
        Err(Declined::Because(why)) => why,
        Err(Declined::NotTopK) => "not a top-k".to_string(),
    };
    log::info!("gpu-topk: DataFusion's TopK runs this task: {why}");
    let mut plan = input;
    if let Some(predicate) = filter {
        plan = Arc::new(FilterExec::try_new(predicate, plan)?);
    }
    if plan.output_partitioning().partition_count() > 1 {
        plan = Arc::new(CoalescePartitionsExec::new(plan));
    }
    plan = Arc::new(SortExec::new(sort_exprs, plan).with_fetch(Some(shape.k)));
    let named = (output_exprs.into_iter().zip(schema.fields()))
        .map(|(expr, field)| (expr, field.name().clone()))
        .collect::<Vec<_>>();
    plan = Arc::new(ProjectionExec::try_new(named, plan)?);
    if shape.skip > 0 {
        let fetch = shape.k.saturating_sub(shape.skip);
        plan = Arc::new(GlobalLimitExec::new(plan, shape.skip, Some(fetch)));
    }
    Ok(plan)
}
