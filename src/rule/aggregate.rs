//! The top-k over an aggregation: a TopK over the groups of DataFusion's `AggregateExec`,
//! replaced by [`GpuAggregateTopKExec`] (its plan is drawn in [`crate::exec`]'s
//! `aggregate_topk` module).
//!
//! ```text
//! [GlobalLimitExec skip]
//!   [SortPreservingMergeExec fetch]
//!     [ProjectionExec]
//!       SortExec TopK fetch                            ═▶   GpuAggregateTopKExec
//!         [ProjectionExec…] [FilterExec HAVING]                (the subtree, kept)
//!           AggregateExec Final | FinalPartitioned | Single
//!             [RepartitionExec hash | CoalescePartitionsExec]
//!               [AggregateExec Partial]
//!                 [AggregateExec …: COUNT(DISTINCT x) as DataFusion plans it]
//!                   [ProjectionExec of columns] [FilterExec WHERE] [RepartitionExec round-robin]
//!                     scan
//! ```
//!
//! Matching is on node types and expression structure: every expression is followed through
//! the projections and filters' column picks, down to the scan's columns (keys, aggregate
//! inputs, the filter) or to the aggregation's output (the order, `HAVING`, the output).
//! A subtree without an aggregation below the sort is not this rule's. One with an aggregation
//! that does not translate (another function, `FILTER (WHERE …)` or `ORDER BY` inside an
//! aggregate, grouping sets, a key or input type the operator does not take, an input that is
//! not a table scan) is declined with the reason: the TopK stays with the top-k rule, whose
//! operator then shows it in EXPLAIN.
//!
//! The groups of the keys are estimated from a sample of an in-memory table (as for a
//! per-group top-k, but past Chao's lower bound where the keys' sizes are skewed:
//! `group::Unseen::Hybrid`; unknown for files, which have no cheap sample), shown in EXPLAIN
//! and sizing the device's hash table. A translated query runs on the device where the device's
//! plan takes it (`AggregateDevicePlan`) and the setting allows: `cuda` always, `auto` where
//! the cost model (`cost::choose_aggregate`) predicts the device's run below DataFusion's
//! aggregation at the host's calibrated rate, both priced by the rows and the groups; `cpu`
//! never. Under `auto` planning starts the device only where DataFusion's aggregation would
//! outlast its start (`cost::aggregate_before_device`), as for a per-group top-k. Elsewhere
//! DataFusion's subtree runs, the reason in EXPLAIN, and where the device would win only with
//! the columns resident they are loaded into the column cache after the run.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::datasource::physical_plan::{CsvSource, FileScanConfig};
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};

use super::absorb::{substitute_columns, substitute_ordering};
use super::build::{ASSUMED_STRING_ROW_BYTES, cost_settings};
use super::{Declined, because};
use crate::config::GpuTopKConfig;
use crate::cost;
use crate::exec::{
    AggregateBackend, AggregateCosting, AggregateDevicePlan, AggregateItem, AggregateKind,
    AggregateTopKSpec, AggregateWarmUp, GpuAggregateTopKExec, GroupKey,
};
use crate::fusion::FusedProgram;

type Exprs = Vec<Arc<dyn PhysicalExpr>>;

/// The operator in place of `node`, where `node` is the top of a top-k over an aggregation
/// (see the module documentation).
pub(super) fn match_aggregate_top_k(
    node: &Arc<dyn ExecutionPlan>,
    config: &GpuTopKConfig,
) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
    let top = top_k_above(node)?;
    let Some(above) = above_aggregate(top.sort.input(), top.output, top.sort.expr())? else {
        return Err(Declined::NotTopK);
    };
    let k = top.k;
    if k > config.max_k {
        return because(format!(
            "aggregate: k = {k} exceeds gpu_topk.max_k = {}",
            config.max_k
        ));
    }
    let groups = translate_aggregation(above.aggregate)?;
    let spec = AggregateTopKSpec {
        table: groups.table,
        group_keys: groups.keys,
        aggregates: groups.aggregates,
        filter: groups.filter,
        having: above.having,
        order: above.order,
        output: (above.output.into_iter())
            .zip(node.schema().fields().iter())
            .map(|(e, f)| (e, f.name().clone()))
            .collect(),
        k,
        offset: top.skip,
    };
    let mut costing = AggregateCosting {
        groups: estimate_groups(&spec),
        ..AggregateCosting::default()
    };
    let backend = match backend_of(config, &spec, node, &mut costing) {
        Ok(plan) => AggregateBackend::Cuda(Arc::new(plan)),
        Err(reason) => AggregateBackend::Cpu(reason),
    };
    let exec = GpuAggregateTopKExec::new(Arc::clone(node), spec, backend);
    Ok(Arc::new(exec.with_costing(costing)))
}

/// The groups of the spec's keys among the rows that pass its filter, estimated from a
/// sample of an in-memory table; `None` for files, or where the sample cannot say.
fn estimate_groups(spec: &AggregateTopKSpec) -> Option<usize> {
    let memory = crate::input::memory::memory_input(&spec.table)?;
    let keys: Exprs = (spec.group_keys.iter())
        .map(|key| Arc::clone(&key.expr))
        .collect();
    super::group::estimate_groups(
        &memory,
        spec.filter.as_ref(),
        &keys,
        super::group::Unseen::Hybrid,
    )
}

/// The device's plan of the operator, where the device path takes the spec and the cost
/// model places it there (see the module documentation); else why DataFusion's subtree runs.
/// `costing` gets what the model weighed and the warm-up after a CPU run.
fn backend_of(
    config: &GpuTopKConfig,
    spec: &AggregateTopKSpec,
    node: &Arc<dyn ExecutionPlan>,
    costing: &mut AggregateCosting,
) -> std::result::Result<AggregateDevicePlan, String> {
    if !config.column_cache {
        return Err("the device path reads the column cache: gpu_topk.column_cache = false".into());
    }
    if node.output_partitioning().partition_count() != 1 {
        return Err("the device path outputs one partition".to_string());
    }
    let mut plan = AggregateDevicePlan::of(spec)?;
    plan.memory_limit = config.device_memory_limit;
    plan.fault = config.inject_fault;
    plan.groups = costing.groups;
    let program = Arc::new(plan.program());
    let resident = crate::input::columns::plan_resident_share(&spec.table, &program, None);
    // String keys' codes the cache lacks are interned on the host first.
    let codes: Vec<_> = (program.inputs.iter())
        .filter(|i| matches!(i, crate::fusion::KernelInput::StringCodes(_)))
        .cloned()
        .collect();
    let interned_rows = match codes.len() {
        0 => 0,
        n => {
            let codes = FusedProgram {
                source: String::new(),
                inputs: codes,
                key_kind: program.key_kind,
                refines: false,
            };
            let share = crate::input::columns::plan_resident_share(&spec.table, &codes, None);
            (n as f64 * plan.rows as f64 * (1.0 - share.unwrap_or(0.0))) as usize
        }
    };
    let (keys, accumulators) = plan.table_words();
    let estimate = cost::AggregateEstimate {
        table: cost::Estimate {
            rows: Some(plan.rows),
            bytes_per_row: (program.inputs.iter())
                .map(|input| match input {
                    // A string column read whole ships its row ends and bytes.
                    crate::fusion::KernelInput::StringColumn(_) => ASSUMED_STRING_ROW_BYTES,
                    _ => 8,
                })
                .sum(),
            compile: (plan.pass.as_ref()).is_some_and(|p| {
                crate::device::started_gpu().is_none_or(|d| !d.has_generated_kernel(&p.source))
            }),
            resident: resident.unwrap_or(0.0),
            whole_table: resident.is_some(),
            decoded: false,
            pages: false,
        },
        groups: costing.groups,
        keys,
        accumulators,
        k: spec.k,
        interned_rows,
    };
    let settings = cost_settings(config);
    let start = cost::StartFacts::read(settings);
    let warm_up = |device| AggregateWarmUp {
        program: Arc::clone(&program),
        device,
    };
    let mut cpu = |c: cost::AggregateCpu| {
        costing.weighed = c.weighed.map(|w| w.describe());
        costing.warm_up = c.warm_up.filter(|_| config.load_after_cpu).map(warm_up);
        c.reason
    };
    let choice = cost::aggregate_before_device(settings, &estimate, &start)
        .and_then(|needs| {
            let pass = (plan.pass.as_ref())
                .map(|p| (p.source.as_str(), crate::device::AGG_FILTERED_ENTRY));
            let device = cost::DeviceFacts::gather(settings, needs, pass);
            let estimate = cost::AggregateEstimate {
                table: estimate.table.after_gather(pass),
                ..estimate
            };
            cost::choose_aggregate(settings, estimate, &device)
        })
        .map_err(&mut cpu)?;
    plan.selection = choice.selection;
    costing.weighed = choice.weighed.map(|w| w.describe());
    costing.reason = Some(choice.reason);
    Ok(plan)
}

/// The TopK at the top of the subtree: its sort, the rows it selects, and its output columns
/// as expressions over the sort's input.
struct TopK<'a> {
    sort: &'a SortExec,
    k: usize,
    skip: usize,
    output: Exprs,
}

/// [`TopK`] of `node`: `[GlobalLimitExec] [SortPreservingMergeExec [ProjectionExec]] SortExec`
/// with a fetch, one output partition.
fn top_k_above(node: &Arc<dyn ExecutionPlan>) -> std::result::Result<TopK<'_>, Declined> {
    let (skip, limit_fetch, below_limit) = match node.downcast_ref::<GlobalLimitExec>() {
        Some(limit) => (limit.skip(), limit.fetch(), limit.input()),
        None => (0, None, node),
    };
    if below_limit.output_partitioning().partition_count() != 1 {
        return Err(Declined::NotTopK);
    }
    let mut projection = None;
    let (sort, fetch) = if let Some(merge) = below_limit.downcast_ref::<SortPreservingMergeExec>() {
        let mut below = merge.input();
        if let Some(p) = below.downcast_ref::<ProjectionExec>() {
            projection = Some(p);
            below = p.input();
        }
        let Some(sort) = below.downcast_ref::<SortExec>() else {
            return Err(Declined::NotTopK);
        };
        let (Some(merge_fetch), Some(sort_fetch)) = (merge.fetch(), sort.fetch()) else {
            return Err(Declined::NotTopK);
        };
        if merge.expr().len() > sort.expr().len() {
            // The sorts' order was shortened by the filter's equalities; the merge's is the
            // query's.
            return Err(Declined::NotTopK);
        }
        (sort, merge_fetch.min(sort_fetch))
    } else if let Some(sort) = below_limit.downcast_ref::<SortExec>() {
        let Some(fetch) = sort.fetch() else {
            return Err(Declined::NotTopK);
        };
        if sort.preserve_partitioning() && sort.input().output_partitioning().partition_count() > 1
        {
            return Err(Declined::NotTopK);
        }
        (sort, fetch)
    } else {
        return Err(Declined::NotTopK);
    };
    let k = match limit_fetch {
        Some(f) => fetch.min(skip.saturating_add(f)),
        None => fetch,
    };
    let output = match projection {
        Some(p) => p.expr().iter().map(|e| Arc::clone(&e.expr)).collect(),
        None => columns_of(&sort.schema()),
    };
    Ok(TopK {
        sort,
        k,
        skip,
        output,
    })
}

/// What lies between the sort and the aggregation, as expressions over the aggregation's
/// output.
struct AboveAggregate<'a> {
    aggregate: &'a AggregateExec,
    output: Exprs,
    order: LexOrdering,
    having: Option<Arc<dyn PhysicalExpr>>,
}

/// [`AboveAggregate`] below the sort (whose input is `below_sort`, its output `output` and
/// order `order`): projections and at most one filter (`HAVING`) over an aggregation. `None`
/// where there is no aggregation there.
fn above_aggregate<'a>(
    below_sort: &'a Arc<dyn ExecutionPlan>,
    mut output: Exprs,
    order: &LexOrdering,
) -> std::result::Result<Option<AboveAggregate<'a>>, Declined> {
    let mut order = order.clone();
    let mut having: Option<Arc<dyn PhysicalExpr>> = None;
    let mut node = below_sort;
    loop {
        // Expressions over `node`'s output become expressions over its input's.
        let exprs: Exprs = if let Some(aggregate) = node.downcast_ref::<AggregateExec>() {
            return Ok(Some(AboveAggregate {
                aggregate,
                output,
                order,
                having,
            }));
        } else if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
            let exprs = projection.expr().iter().map(|e| Arc::clone(&e.expr));
            exprs.collect()
        } else if let Some(filter) = node.downcast_ref::<FilterExec>() {
            if !reaches_aggregate(filter.input()) {
                return Ok(None);
            }
            if having.is_some() || filter.fetch().is_some() {
                return because("aggregate: more than one filter above the aggregation");
            }
            having = Some(Arc::clone(filter.predicate()));
            let input = filter.input().schema();
            match filter.projection() {
                Some(picks) => picks.iter().map(|&i| column(&input, i)).collect(),
                None => columns_of(&input),
            }
        } else {
            return Ok(None);
        };
        let rewrite = |e: &Arc<dyn PhysicalExpr>| substitute_columns(e, &exprs);
        output = output.iter().map(rewrite).collect::<Result<_, _>>()?;
        order = substitute_ordering(&order, &exprs)?;
        if node.downcast_ref::<FilterExec>().is_none() {
            having = having.as_ref().map(rewrite).transpose()?;
        }
        node = node.children()[0];
    }
}

/// Whether an aggregation lies below `node` through projections and filters.
fn reaches_aggregate(node: &Arc<dyn ExecutionPlan>) -> bool {
    if node.downcast_ref::<AggregateExec>().is_some() {
        return true;
    }
    let passes = node.downcast_ref::<ProjectionExec>().is_some()
        || node.downcast_ref::<FilterExec>().is_some();
    passes && reaches_aggregate(node.children()[0])
}

/// The aggregation translated to the table below it: its keys, aggregates and fused filter.
struct Groups {
    table: Arc<dyn ExecutionPlan>,
    keys: Vec<GroupKey>,
    aggregates: Vec<AggregateItem>,
    filter: Option<Arc<dyn PhysicalExpr>>,
}

/// [`Groups`] of `top`, the aggregation whose output the sort reads.
fn translate_aggregation(top: &AggregateExec) -> std::result::Result<Groups, Declined> {
    let raw = raw_input_aggregate(top)?;
    check_aggregation(top, raw)?;
    let output = top.schema();
    let key_count = raw.group_expr().expr().len();
    let mut key_exprs: Exprs = (raw.group_expr().expr().iter())
        .map(|(e, _)| Arc::clone(e))
        .collect();
    let mut items = Vec::with_capacity(raw.aggr_expr().len());
    for (i, aggregate) in raw.aggr_expr().iter().enumerate() {
        let kind = aggregate_kind(aggregate.fun().name(), aggregate.is_distinct())?;
        let args = aggregate.expressions();
        let input = match (kind, args.as_slice()) {
            (AggregateKind::Count, [arg]) if is_non_null_literal(arg) => None,
            (_, [arg]) => Some(Arc::clone(arg)),
            _ => {
                return because(format!(
                    "aggregate: {} takes other arguments",
                    aggregate.name()
                ));
            }
        };
        items.push((
            match input {
                None => AggregateKind::CountStar,
                Some(_) => kind,
            },
            input,
            output.field(key_count + i).clone(),
        ));
    }
    let mut arg_exprs: Vec<Option<Arc<dyn PhysicalExpr>>> =
        items.iter().map(|(_, e, _)| e.clone()).collect();
    let mut below = Arc::clone(raw.input());
    // COUNT(DISTINCT x): DataFusion groups by the keys and `x` first, then counts `x`.
    if let Some(inner) = below.downcast_ref::<AggregateExec>() {
        let inner_raw = raw_input_aggregate(inner)?;
        check_aggregation(inner, inner_raw)?;
        let kinds: Vec<&mut AggregateKind> = items.iter_mut().map(|(k, _, _)| k).collect();
        let inner_keys = counted_distinct(inner_raw, &key_exprs, kinds, &arg_exprs)?;
        key_exprs = substitute_all(&key_exprs, &inner_keys)?;
        arg_exprs = substitute_some(&arg_exprs, &inner_keys)?;
        below = Arc::clone(inner_raw.input());
    }
    let TableBelow {
        table,
        filter,
        columns,
    } = table_below(&below)?;
    let key_exprs = substitute_all(&key_exprs, &columns)?;
    let arg_exprs = substitute_some(&arg_exprs, &columns)?;
    let schema = table.schema();
    let keys = (key_exprs.into_iter().enumerate())
        .map(|(i, expr)| {
            let data_type = expr
                .data_type(&schema)
                .or_else(|e| because(e.to_string()))?;
            if !key_type_taken(&data_type) {
                return because(format!("aggregate: a group key of type {data_type}"));
            }
            let name = output.field(i).name().clone();
            Ok(GroupKey {
                expr,
                name,
                data_type,
            })
        })
        .collect::<Result<Vec<_>, Declined>>()?;
    let aggregates = (items.into_iter().zip(arg_exprs))
        .map(|((kind, _, field), input)| aggregate_item(kind, input, &field, &schema))
        .collect::<Result<Vec<_>, Declined>>()?;
    Ok(Groups {
        table,
        keys,
        aggregates,
        filter,
    })
}

/// Where the aggregation's `keys` and `args` (aggregates of `kinds`) read `inner`, an
/// aggregation without aggregates (DISTINCT), whether they are `COUNT(DISTINCT x)` as
/// DataFusion plans it: the keys are columns of `inner`'s keys, every aggregate counts the
/// same other column `x`, and `inner` groups by nothing else. The counts become
/// [`AggregateKind::CountDistinct`]; `inner`'s keys are returned (what its columns are).
fn counted_distinct(
    inner: &AggregateExec,
    keys: &Exprs,
    kinds: Vec<&mut AggregateKind>,
    args: &[Option<Arc<dyn PhysicalExpr>>],
) -> std::result::Result<Exprs, Declined> {
    if !inner.aggr_expr().is_empty() {
        return because("aggregate: an aggregation over another aggregation");
    }
    let index = |e: &Arc<dyn PhysicalExpr>| e.downcast_ref::<Column>().map(Column::index);
    let Some(mut grouped) = keys.iter().map(index).collect::<Option<Vec<_>>>() else {
        return because("aggregate: a computed key over distinct values");
    };
    let mut counted = None;
    for (kind, arg) in kinds.into_iter().zip(args) {
        let column = arg.as_ref().and_then(index);
        if *kind != AggregateKind::Count
            || column.is_none()
            || (counted.is_some() && counted != column)
        {
            return because(format!("aggregate: {} over distinct values", kind.name()));
        }
        counted = column;
        *kind = AggregateKind::CountDistinct;
    }
    grouped.extend(counted);
    grouped.sort_unstable();
    grouped.dedup();
    let inner_keys: Exprs = (inner.group_expr().expr().iter())
        .map(|(e, _)| Arc::clone(e))
        .collect();
    let counted_is_a_key = counted.is_some_and(|c| keys.iter().any(|k| index(k) == Some(c)));
    if counted_is_a_key || grouped.len() != inner_keys.len() {
        return because("aggregate: a count over distinct rows of other columns");
    }
    Ok(inner_keys)
}

/// The aggregation of `top` that reads raw rows: `top` itself in a single step, else the
/// partial one below its hash repartition or coalesce.
fn raw_input_aggregate(top: &AggregateExec) -> std::result::Result<&AggregateExec, Declined> {
    match top.mode() {
        AggregateMode::Single | AggregateMode::SinglePartitioned => return Ok(top),
        AggregateMode::Final | AggregateMode::FinalPartitioned => {}
        mode => return because(format!("aggregate: an aggregation in mode {mode:?} on top")),
    }
    let mut below = top.input();
    if let Some(coalesce) = below.downcast_ref::<CoalescePartitionsExec>()
        && coalesce.fetch().is_none()
    {
        below = coalesce.input();
    } else if let Some(repartition) = below.downcast_ref::<RepartitionExec>()
        && matches!(repartition.partitioning(), Partitioning::Hash(..))
    {
        below = repartition.input();
    }
    match below.downcast_ref::<AggregateExec>() {
        Some(partial) if *partial.mode() == AggregateMode::Partial => Ok(partial),
        _ => because("aggregate: the final aggregation is not over a partial one"),
    }
}

/// Declines what the operator does not compute: grouping sets, `FILTER (WHERE …)` or
/// `ORDER BY` inside an aggregate, final and partial steps that disagree.
fn check_aggregation(
    top: &AggregateExec,
    raw: &AggregateExec,
) -> std::result::Result<(), Declined> {
    if raw.group_expr().has_grouping_set() || top.group_expr().has_grouping_set() {
        return because("aggregate: GROUPING SETS, CUBE or ROLLUP");
    }
    if raw.group_expr().expr().is_empty() {
        return because("aggregate: no GROUP BY keys");
    }
    if raw.filter_expr().iter().any(Option::is_some) {
        return because("aggregate: FILTER (WHERE …) in an aggregate");
    }
    if let Some(a) = raw.aggr_expr().iter().find(|a| !a.order_bys().is_empty()) {
        return because(format!("aggregate: {} is ordered", a.name()));
    }
    let (keys, aggregates) = (raw.group_expr().expr().len(), raw.aggr_expr().len());
    if top.schema().fields().len() != keys + aggregates || top.aggr_expr().len() != aggregates {
        return because("aggregate: the final and partial aggregations differ");
    }
    if top.input().boundedness().is_unbounded() {
        return because("aggregate: the input is unbounded");
    }
    Ok(())
}

/// The operator's kind of the aggregate function `name` (distinct or not).
fn aggregate_kind(name: &str, distinct: bool) -> std::result::Result<AggregateKind, Declined> {
    let kind = match name {
        "count" if distinct => AggregateKind::CountDistinct,
        "count" => AggregateKind::Count,
        // The extremes of the distinct values are the extremes.
        "min" => AggregateKind::Min,
        "max" => AggregateKind::Max,
        "sum" if !distinct => AggregateKind::Sum,
        "avg" if !distinct => AggregateKind::Avg,
        _ => {
            let distinct = if distinct { " DISTINCT" } else { "" };
            return because(format!("aggregate: {name}{distinct} is not supported"));
        }
    };
    Ok(kind)
}

/// The spec's aggregate of `kind` over `input` (over `schema`), output as `field`.
fn aggregate_item(
    kind: AggregateKind,
    input: Option<Arc<dyn PhysicalExpr>>,
    field: &datafusion::arrow::datatypes::Field,
    schema: &Schema,
) -> std::result::Result<AggregateItem, Declined> {
    let input_type = match &input {
        Some(e) => Some(e.data_type(schema).or_else(|e| because(e.to_string()))?),
        None => None,
    };
    let taken = match (&kind, &input_type) {
        (AggregateKind::CountStar, _) => true,
        (AggregateKind::Count | AggregateKind::CountDistinct, Some(t)) => {
            key_type_taken(t) || t.is_floating()
        }
        (AggregateKind::Sum | AggregateKind::Avg, Some(t)) => {
            t.is_integer() || t.is_floating() || matches!(t, DataType::Decimal128(..))
        }
        (AggregateKind::Min | AggregateKind::Max, Some(t)) => {
            key_type_taken(t) || t.is_floating() || matches!(t, DataType::Decimal128(..))
        }
        _ => false,
    };
    if !taken {
        let over = input_type
            .as_ref()
            .map_or("*".to_string(), ToString::to_string);
        return because(format!("aggregate: {} over {over}", kind.name()));
    }
    Ok(AggregateItem {
        distinct: kind == AggregateKind::CountDistinct,
        kind,
        input,
        input_type,
        output_type: field.data_type().clone(),
        name: field.name().clone(),
    })
}

/// Whether the operator groups by a key of `data_type`: integers, dates, timestamps and
/// strings (plain or dictionary-encoded). Floats are not: their groups are by value, with
/// every NaN one group and 0.0 apart from -0.0, which a key encoding must reproduce.
fn key_type_taken(data_type: &DataType) -> bool {
    match data_type {
        DataType::Dictionary(index, value) => index.is_integer() && key_type_taken(value),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Date32 | DataType::Date64 | DataType::Timestamp(..) => true,
        t => t.is_integer(),
    }
}

/// The table scan below an aggregation, with what lies between.
struct TableBelow {
    table: Arc<dyn ExecutionPlan>,
    /// The one filter between, over the table's columns.
    filter: Option<Arc<dyn PhysicalExpr>>,
    /// The aggregation's input columns as expressions over the table's.
    columns: Exprs,
}

/// [`TableBelow`] the raw-row aggregation's input `below`, through column projections, one
/// filter (fused), round-robin repartitioning and coalescing.
fn table_below(below: &Arc<dyn ExecutionPlan>) -> std::result::Result<TableBelow, Declined> {
    let mut columns = columns_of(&below.schema());
    let mut filter: Option<Arc<dyn PhysicalExpr>> = None;
    let mut node = Arc::clone(below);
    loop {
        let exprs: Exprs = if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
            let of_columns = (projection.expr().iter()).all(|e| e.expr.is::<Column>());
            if !of_columns {
                return because("aggregate: a computed projection below the aggregation");
            }
            projection
                .expr()
                .iter()
                .map(|e| Arc::clone(&e.expr))
                .collect()
        } else if let Some(f) = node.downcast_ref::<FilterExec>() {
            if filter.is_some() || f.fetch().is_some() {
                return because("aggregate: more than one filter below the aggregation");
            }
            filter = Some(Arc::clone(f.predicate()));
            let input = f.input().schema();
            match f.projection() {
                Some(picks) => picks.iter().map(|&i| column(&input, i)).collect(),
                None => columns_of(&input),
            }
        } else if let Some(repartition) = node.downcast_ref::<RepartitionExec>()
            && matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_))
        {
            columns_of(&repartition.input().schema())
        } else if let Some(coalesce) = node.downcast_ref::<CoalescePartitionsExec>()
            && coalesce.fetch().is_none()
        {
            columns_of(&coalesce.input().schema())
        } else if is_table_scan(&node) {
            return Ok(TableBelow {
                table: node,
                filter,
                columns,
            });
        } else {
            return because(format!(
                "aggregate: the input {} is not a table scan",
                node.name()
            ));
        };
        columns = substitute_all(&columns, &exprs)?;
        if node.downcast_ref::<FilterExec>().is_none() {
            filter = filter.map(|f| substitute_columns(&f, &exprs)).transpose()?;
        }
        node = Arc::clone(node.children()[0]);
    }
}

/// Whether `node` scans a table the operator reads: an in-memory table or `GpuTable`,
/// Parquet files read as they are, or CSV files.
fn is_table_scan(node: &Arc<dyn ExecutionPlan>) -> bool {
    if crate::input::memory::memory_input(node).is_some()
        || crate::input::parquet::parquet_input(node).is_some()
    {
        return true;
    }
    let config = (node.downcast_ref::<DataSourceExec>())
        .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>());
    config
        .is_some_and(|c| c.limit.is_none() && c.file_source().downcast_ref::<CsvSource>().is_some())
}

/// `COUNT(*)`'s argument as DataFusion plans it: a literal that is not NULL.
fn is_non_null_literal(expr: &Arc<dyn PhysicalExpr>) -> bool {
    expr.downcast_ref::<Literal>()
        .is_some_and(|l| !l.value().is_null())
}

fn column(schema: &Schema, i: usize) -> Arc<dyn PhysicalExpr> {
    Arc::new(Column::new(schema.field(i).name(), i))
}

fn columns_of(schema: &Schema) -> Exprs {
    (0..schema.fields().len())
        .map(|i| column(schema, i))
        .collect()
}

fn substitute_all(exprs: &Exprs, by: &Exprs) -> std::result::Result<Exprs, Declined> {
    exprs.iter().map(|e| substitute_columns(e, by)).collect()
}

fn substitute_some(
    exprs: &[Option<Arc<dyn PhysicalExpr>>],
    by: &Exprs,
) -> std::result::Result<Vec<Option<Arc<dyn PhysicalExpr>>>, Declined> {
    (exprs.iter())
        .map(|e| e.as_ref().map(|e| substitute_columns(e, by)).transpose())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_integers_dates_timestamps_and_strings_are_taken() {
        let dictionary =
            |value: DataType| DataType::Dictionary(Box::new(DataType::Int32), Box::new(value));
        for taken in [
            DataType::Int8,
            DataType::UInt64,
            DataType::Date32,
            DataType::Timestamp(datafusion::arrow::datatypes::TimeUnit::Nanosecond, None),
            DataType::Utf8View,
            dictionary(DataType::Utf8),
        ] {
            assert!(key_type_taken(&taken), "{taken}");
        }
        for declined in [
            DataType::Float64,
            DataType::Boolean,
            DataType::Binary,
            dictionary(DataType::Float32),
        ] {
            assert!(!key_type_taken(&declined), "{declined}");
        }
    }

    /// Over keys whose groups' sizes are skewed (ranks of a Zipf law of exponent 0.7 over
    /// 0.266 of the rows, as users by their tweets), the sample meets few groups twice: Chao's
    /// bound falls far short and the hybrid comes within a factor of three; where every row is
    /// its own group both say so, and over few groups both are exact.
    #[test]
    fn groups_of_skewed_keys_are_estimated_within_a_factor_of_three() {
        use datafusion::arrow::array::Int64Array;
        use datafusion::arrow::datatypes::Field;
        use datafusion::arrow::record_batch::RecordBatch;
        use std::collections::HashSet;
        let rows = 4_000_000usize;
        let universe = (0.266 * rows as f64) as u64;
        let a = 0.3f64;
        let d = ((universe + 1) as f64).powf(a) - 1.0;
        // A fixed sequence of uniform draws (a 64-bit mix of the row number).
        let unit = |i: u64| {
            let mut x = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((x ^ (x >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        let skewed: Vec<i64> = (0..rows as u64)
            .map(|i| (((1.0 + unit(i) * d).powf(1.0 / a) - 1.0) as u64).min(universe - 1) as i64)
            .collect();
        let columns: [(&str, Vec<i64>); 3] = [
            ("skewed", skewed),
            (
                "unique",
                (0..rows as i64).map(|i| i * 7 % rows as i64).collect(),
            ),
            ("few", (0..rows as i64).map(|i| i * 13 % 40).collect()),
        ];
        for (name, values) in columns {
            let truth = values.iter().collect::<HashSet<_>>().len();
            let schema = Arc::new(Schema::new(vec![Field::new(name, DataType::Int64, false)]));
            let batches: Vec<RecordBatch> = (values.chunks(8192))
                .map(|chunk| {
                    let column = Arc::new(Int64Array::from(chunk.to_vec()));
                    RecordBatch::try_new(Arc::clone(&schema), vec![column]).unwrap()
                })
                .collect();
            let partitions = [batches];
            let memory = crate::input::memory::MemoryInput {
                partitions: &partitions,
                columns: vec![0],
                table: None,
            };
            let keys: Exprs = vec![Arc::new(Column::new(name, 0))];
            let estimate = |unseen| {
                let groups = super::super::group::estimate_groups(&memory, None, &keys, unseen);
                groups.unwrap() as f64 / truth as f64
            };
            let chao = estimate(super::super::group::Unseen::Chao);
            let hybrid = estimate(super::super::group::Unseen::Hybrid);
            match name {
                "skewed" => {
                    assert!(chao < 0.25, "{name}: Chao's {chao:.2} of {truth}");
                    assert!((1.0 / 3.0..3.0).contains(&hybrid), "{name}: {hybrid:.2}");
                }
                _ => {
                    assert!((0.9..1.1).contains(&chao), "{name}: Chao's {chao:.2}");
                    assert!((0.9..1.1).contains(&hybrid), "{name}: {hybrid:.2}");
                }
            }
        }
    }

    #[test]
    fn aggregate_functions_map_to_kinds() {
        let kind = |name, distinct| aggregate_kind(name, distinct).ok();
        assert_eq!(kind("count", true), Some(AggregateKind::CountDistinct));
        assert_eq!(kind("count", false), Some(AggregateKind::Count));
        assert_eq!(kind("max", true), Some(AggregateKind::Max));
        assert_eq!(kind("avg", false), Some(AggregateKind::Avg));
        assert_eq!(kind("sum", true), None);
        assert_eq!(kind("median", false), None);
    }
}
