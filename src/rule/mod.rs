//! [`GpuTopKRule`]: the physical-optimizer rule that puts [`GpuTopKExec`] into plans.
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
//! A shape or type the operator cannot take leaves the plan untouched (the rule never errors);
//! the reason is logged and kept in [`GpuTopKRule::last_decisions`].

use std::sync::{Arc, Mutex};

use datafusion::arrow::array::AsArray;
use datafusion::arrow::row::RowConverter;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};

mod group;

use crate::config::{Algorithm, Backend, GpuTopKConfig};
use crate::cost::{self, Placement};
use crate::device::DeviceSlot;
use crate::exec::{GpuTopKExec, TopKSpec};
use crate::fusion;
use crate::fusion::cannot_fail;
use crate::keys::{KeyLayout, KeySpec};
use crate::select::{InputForm, SelectionPlan};

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
        let distributed = distributed_planning(options);
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
        let plan = rewrite(plan, &mut decisions, "TopK", |node| {
            match_top_k(node, config, distributed)
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
    plan.transform_down(|node| match replace(&node) {
        Ok(exec) => Ok(Transformed::yes(exec)),
        Err(Declined::NotTopK) => Ok(Transformed::no(node)),
        Err(Declined::Because(why)) => {
            log::info!("gpu-topk: DataFusion's {kept} kept: {why}");
            decisions.push(why);
            Ok(Transformed::no(node))
        }
    })
    .data()
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

/// `expr` with every column `i` replaced by `exprs[i]` (the expressions a projection computes).
fn substitute_columns(
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
fn substitute_ordering(
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

/// Recognises a top-k subtree rooted at `node` and builds its replacement.
///
/// Under a distributed planner (`distributed`), a merge over per-partition sorts becomes two
/// operators: one per task over its share of the input (marked per-task), and one that merges
/// the tasks' rows, with a coalesce between them where the engine cuts the stages (see
/// [`crate::distributed`]).
fn match_top_k(
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

/// A top-k over several partitions (a merge over per-partition sorts) run as parts, each over
/// a contiguous run of the input's partitions, and one operator that merges their rows on
/// the CPU path, reading the parts in order: ties go to the first part, whose rows come first
/// in input order, as in one operator.
struct Split<'a> {
    /// The per-partition sort, whose output each part yields (and `order` is over).
    sort_node: &'a Arc<dyn ExecutionPlan>,
    order: &'a LexOrdering,
    /// A column projection between the merge and the sort, which the merge applies.
    above_sort: Option<&'a ProjectionExec>,
    k: usize,
    skip: usize,
}

impl Split<'_> {
    /// What is below the sort, absorbed, read in input order.
    fn absorbed(&self) -> std::result::Result<Absorbed, Declined> {
        let sort = self.sort_node.downcast_ref::<SortExec>().expect("a sort");
        in_input_order(absorb_below(sort.input(), self.order, None)?)
    }

    /// A part: the operator over `absorbed` (or a share of its input).
    fn part(
        &self,
        absorbed: Absorbed,
        (per_task, device): (bool, Option<DeviceSlot>),
        config: &GpuTopKConfig,
    ) -> std::result::Result<GpuTopKExec, Declined> {
        let shape = Shape {
            k: self.k,
            skip: 0,
            per_task,
            device,
        };
        let schema = self.sort_node.schema();
        let equivalences = self.sort_node.equivalence_properties().clone();
        build_top_k(absorbed, shape, config, schema, equivalences)
    }

    /// The merge of the parts' rows (`parts`: their output partitions, in order), with the
    /// replaced `node`'s offset, columns and schema.
    fn merge(
        &self,
        parts: Arc<dyn ExecutionPlan>,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
    ) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
        let schema = parts.schema();
        let output_exprs = output_columns(self.above_sort, &schema);
        let merge = Absorbed {
            input: parts,
            sort_exprs: self.order.clone(),
            filter: None,
            output_exprs,
        };
        // The merge never runs on a device: no device fault is injected into it.
        let mut merge_config = config.clone();
        merge_config.backend = Backend::Cpu;
        merge_config.inject_fault = crate::config::FaultPoint::None;
        let shape = Shape {
            k: self.k,
            skip: self.skip,
            per_task: false,
            device: None,
        };
        let equivalences = node.equivalence_properties().clone();
        let exec = build_top_k(merge, shape, &merge_config, node.schema(), equivalences)?;
        Ok(Arc::new(exec))
    }

    /// Under a distributed engine: one part per task (marked per-task), which the engine
    /// cuts from the merge at the coalesce between them (the merge reads through it).
    fn between_tasks(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
    ) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
        let tasks = self.part(self.absorbed()?, (true, None), config)?;
        let tasks = Arc::new(CoalescePartitionsExec::new(Arc::new(tasks)));
        self.merge(tasks, node, config)
    }

    /// With several devices: a part per device over its share of a file or in-memory scan's
    /// partitions, each with its own device's column cache. `None` (one operator) where the
    /// input is not such a scan, has fewer partitions than two, or a part is declined.
    fn between_devices(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
        devices: &[DeviceSlot],
    ) -> std::result::Result<Option<Arc<dyn ExecutionPlan>>, Declined> {
        let absorbed = self.absorbed()?;
        let Some(slices) = scan_slices(&absorbed.input, devices.len()) else {
            return Ok(None);
        };
        let parts = (slices.into_iter().zip(devices))
            .map(|(slice, &device)| {
                let share = Absorbed {
                    input: slice,
                    ..absorbed.clone()
                };
                self.part(share, (false, Some(device)), config).ok()
            })
            .collect::<Option<Vec<_>>>();
        let Some(parts) = parts else {
            return Ok(None);
        };
        // The best k-th key of any device prunes every device's scans.
        let parts = (GpuTopKExec::share_threshold(parts).into_iter())
            .map(|part| Arc::new(part) as Arc<dyn ExecutionPlan>)
            .collect();
        let parts = UnionExec::try_new(parts)
            .or_else(|e| because(format!("cannot join the devices' parts: {e}")))?;
        self.merge(parts, node, config).map(Some)
    }
}

/// `input`, a file or in-memory scan of at least two partitions, as at most `parts` scans of
/// contiguous runs of its partitions, in order.
fn scan_slices(
    input: &Arc<dyn ExecutionPlan>,
    parts: usize,
) -> Option<Vec<Arc<dyn ExecutionPlan>>> {
    let scan = input.downcast_ref::<DataSourceExec>()?;
    let partitions = input.output_partitioning().partition_count();
    if partitions < 2 {
        return None;
    }
    let parts = parts.min(partitions);
    let range = |part: usize| part * partitions / parts..(part + 1) * partitions / parts;
    let source = scan.data_source();
    if let Some(files) =
        source.downcast_ref::<datafusion::datasource::physical_plan::FileScanConfig>()
    {
        return Some(
            (0..parts)
                .map(|part| {
                    let mut slice = files.clone();
                    slice.file_groups = files.file_groups[range(part)].to_vec();
                    DataSourceExec::from_data_source(slice) as Arc<dyn ExecutionPlan>
                })
                .collect(),
        );
    }
    let memory = source.downcast_ref::<datafusion::datasource::memory::MemorySourceConfig>()?;
    if datafusion::datasource::source::DataSource::fetch(memory).is_some()
        || !memory.sort_information().is_empty()
    {
        return None;
    }
    (0..parts)
        .map(|part| {
            let slice = datafusion::datasource::memory::MemorySourceConfig::try_new_exec(
                &memory.partitions()[range(part)],
                memory.original_schema(),
                memory.projection().clone(),
            )
            .ok()?;
            Some(slice as Arc<dyn ExecutionPlan>)
        })
        .collect()
}

/// The devices `gpu_topk.devices` names: `all` is every GPU the driver reports once the
/// process's device is started (before, the one device planning may assume), a list their
/// ordinals (one named twice is two logical devices, each with its own cache).
fn resolve_devices(config: &GpuTopKConfig) -> std::result::Result<Vec<DeviceSlot>, String> {
    match crate::config::device_ordinals(&config.devices)? {
        Some(ordinals) => Ok(crate::device::slots(&ordinals)),
        None => {
            let count = crate::device::started_device_count().unwrap_or(1);
            Ok(crate::device::slots(&(0..count).collect::<Vec<_>>()))
        }
    }
}

/// Whether the session plans for a distributed engine (datafusion-distributed's planner is
/// installed), whose stages are cut at coalesces: a top-k is then split into per-task parts
/// and their merge ([`Split::between_tasks`]).
#[cfg(feature = "cluster")]
fn distributed_planning(options: &ConfigOptions) -> bool {
    (options.extensions)
        .get::<datafusion_distributed::DistributedConfig>()
        .is_some()
}

/// Without the `cluster` feature the operator has no codec for a distributed engine's workers:
/// every session plans for one process.
#[cfg(not(feature = "cluster"))]
fn distributed_planning(_: &ConfigOptions) -> bool {
    false
}

/// `absorbed` reading its input in a fixed order: without round-robin repartitioning or
/// coalescing left above it, its file scans reading their files in order.
fn in_input_order(mut absorbed: Absorbed) -> std::result::Result<Absorbed, Declined> {
    absorbed.input = without_round_robin(Arc::clone(&absorbed.input))
        .and_then(scans_in_order)
        .or_else(|e| because(format!("cannot fix the input's order: {e}")))?;
    Ok(absorbed)
}

/// The operator over `absorbed` (the input and expressions below the replaced nodes), planned
/// for this machine, with the replaced nodes' `schema` and `equivalences`; or why DataFusion's
/// plan stays.
fn build_top_k(
    absorbed: Absorbed,
    Shape {
        k,
        skip,
        per_task,
        device,
    }: Shape,
    config: &GpuTopKConfig,
    schema: datafusion::arrow::datatypes::SchemaRef,
    equivalences: datafusion::physical_expr::EquivalenceProperties,
) -> std::result::Result<GpuTopKExec, Declined> {
    if absorbed.input.boundedness().is_unbounded() {
        // A top-k emits only at the end of its input: DataFusion's sanity check decides.
        return because("the input is unbounded");
    }
    let input_schema = absorbed.input.schema();
    let specs = key_specs(&absorbed.sort_exprs, &input_schema).or_else(because)?;
    let layout = KeyLayout::with_prefixes(specs).or_else(because)?;
    if !layout.exact() && !RowConverter::supports_fields(&layout.sort_fields()) {
        return because("the sort keys have no row format to compare them in full");
    }

    let cached = config.column_cache && crate::input::is_whole_table(&absorbed.input);
    let settings = cost_settings(config);
    // The fusion plan and the placement; `strings`: the program may read string columns
    // whole, which only a selection over the whole table can give it.
    let place = |strings: bool| {
        let fusion = if config.fuse_expressions {
            fusion::plan(
                absorbed.filter.as_ref(),
                &absorbed.sort_exprs,
                &layout,
                &input_schema,
                strings,
            )
        } else {
            fusion::FusionPlan::host(
                "gpu_topk.fuse_expressions = false",
                absorbed.filter.is_some(),
            )
        };
        let mut estimate = estimate(
            absorbed.input.as_ref(),
            &layout,
            &fusion,
            absorbed.filter.is_some(),
        );
        if cached
            && let Some(program) = &fusion.program
            && let Some(resident) =
                crate::input::columns::plan_resident_share(&absorbed.input, program, device)
        {
            estimate.resident = resident;
            estimate.whole_table = true;
            if let Some(files) = crate::input::parquet::parquet_input(&absorbed.input) {
                // Files whose columns the device decodes from their pages need the host only
                // to read them; the others are decoded on the host first. A dictionary
                // column's codes are decoded on the host, but only its keys are renumbered:
                // it costs about what reading pages does.
                let pages = config.decode_parquet_on_device
                    && (program.inputs.iter()).all(|input| match input {
                        fusion::KernelInput::Column(c) => files.may_read_pages(*c),
                        fusion::KernelInput::DictionaryCodes(_)
                        | fusion::KernelInput::DictionaryMatch { .. } => true,
                        _ => false,
                    });
                estimate.decoded = !pages;
                estimate.pages = pages;
            }
        }
        (fusion, place_top_k(settings, &layout, k, estimate))
    };
    let (mut fusion, mut placement) = place(cached);
    let streamed = matches!(
        &placement,
        Placement::Run {
            plan: SelectionPlan::Cuda {
                input: InputForm::Streamed,
                ..
            },
            ..
        }
    );
    if streamed && fusion.program.as_ref().is_some_and(|p| p.reads_strings()) {
        (fusion, placement) = place(false);
    }
    let (mut plan, reason, prediction) = match placement {
        Placement::Run {
            plan,
            reason,
            prediction,
        } => (plan, reason, prediction.map(|p| *p)),
        Placement::Decline(why) => return because(why),
    };
    plan = cost::policy::with_load_after_cpu(plan, config.load_after_cpu);
    let spec = TopKSpec {
        fusion,
        sort_exprs: absorbed.sort_exprs,
        filter: absorbed.filter,
        output_exprs: absorbed.output_exprs,
        k,
        skip,
        layout,
        plan,
        reason,
        prediction,
        fault: config.inject_fault,
        device_memory_limit: config.device_memory_limit,
        per_task,
        settings: config.clone(),
        device,
    };
    GpuTopKExec::with_properties(absorbed.input, spec, schema, equivalences)
        .or_else(|e| because(format!("cannot build the operator: {e}")))
}

/// A top-k's sort keys, fused predicate and output columns, over its input's schema.
#[cfg(feature = "cluster")]
pub(crate) type TopKExprs = (
    LexOrdering,
    Option<Arc<dyn PhysicalExpr>>,
    Vec<Arc<dyn PhysicalExpr>>,
);

/// The operator a worker decodes ([`crate::distributed`]): `GpuTopKExec` planned again on
/// this machine (its device, cache and calibration) from the expressions the coordinator's
/// rule absorbed, or, where this machine declines it (no GPU under `backend = auto`),
/// DataFusion's plan of the same rows: filter, sort with fetch, projection, offset.
#[cfg(feature = "cluster")]
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

/// The top-k's placement: the cost model's decision before the device, then, where that
/// does not settle it, the device's facts gathered (the device started, its kernels loaded,
/// its calibration read) and the decision over them.
fn place_top_k(
    settings: cost::Settings<'_>,
    layout: &KeyLayout,
    k: usize,
    estimate: cost::Estimate,
) -> Placement {
    let start = cost::StartFacts::read(settings);
    match cost::before_device(settings, layout, k, &estimate, &start) {
        cost::Stage::Decided(placement) => placement,
        cost::Stage::Gather(needs) => {
            let device = cost::DeviceFacts::gather(settings, needs);
            cost::choose(settings, layout, k, estimate, &device)
        }
    }
}

/// What the cost model reads of the session's settings.
fn cost_settings(config: &GpuTopKConfig) -> cost::Settings<'_> {
    cost::Settings {
        backend: config.backend,
        algorithm: config.algorithm,
        kernel_cache_dir: (!config.kernel_cache_dir.is_empty())
            .then(|| std::path::Path::new(config.kernel_cache_dir.as_str())),
        recalibrate: config.recalibrate,
        fault: config.inject_fault,
    }
}

/// The key specs of `sort_exprs` over `schema`, or why they cannot be typed.
fn key_specs(
    sort_exprs: &LexOrdering,
    schema: &datafusion::arrow::datatypes::Schema,
) -> std::result::Result<Vec<KeySpec>, String> {
    (sort_exprs.iter())
        .map(|sort_expr| {
            let typed =
                |e: datafusion::error::DataFusionError| format!("cannot type sort key: {e}");
            Ok(KeySpec {
                data_type: sort_expr.expr.data_type(schema).map_err(typed)?,
                descending: sort_expr.options.descending,
                nulls_first: sort_expr.options.nulls_first,
                nullable: sort_expr.expr.nullable(schema).map_err(typed)?,
            })
        })
        .collect()
}

/// The GPU plan of a per-group top-k over `input` (what was below the window's sort, which
/// sorts by `ordering`, its first `group_keys` keys the groups), or why the CPU path: the
/// device selects over a whole in-memory table (below the hash repartition and the filters
/// and projections it absorbs), with every key exact in the composite and the predicate and
/// keys in its generated code.
///
/// Where the input is an in-memory table, `groups` gets the estimated number of groups among
/// the rows that pass, whichever path is chosen.
pub(super) fn group_device(
    input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    (group_keys, k): (usize, usize),
    config: &GpuTopKConfig,
    groups: &mut Option<usize>,
) -> std::result::Result<crate::exec::GroupDevicePlan, String> {
    // The rows as the hash repartition below the sort received them.
    let below = match input.downcast_ref::<RepartitionExec>() {
        Some(r) if matches!(r.partitioning(), Partitioning::Hash(..)) && !r.preserve_order() => {
            r.input()
        }
        _ => input,
    };
    let absorbed = match absorb_below(below, ordering, None) {
        Ok(absorbed) => absorbed,
        Err(Declined::Because(why)) => return Err(why),
        Err(Declined::NotTopK) => return Err("the input cannot be absorbed".into()),
    };
    let Some(memory) = crate::input::memory::memory_input(&absorbed.input) else {
        return Err("the device selects per group over in-memory tables only".into());
    };
    *groups = group::estimate_groups(
        &memory,
        absorbed.filter.as_ref(),
        &absorbed.sort_exprs[..group_keys],
    );
    if config.backend == Backend::Cpu || config.algorithm == Algorithm::Cpu {
        return Err("CPU path forced by settings".into());
    }
    if !config.column_cache {
        return Err("gpu_topk.column_cache = false: the device reads cached tables only".into());
    }
    let schema = absorbed.input.schema();
    let specs = key_specs(&absorbed.sort_exprs, &schema)?;
    let short: Vec<Option<u32>> = (absorbed.sort_exprs.iter().zip(&specs))
        .map(|(sort, spec)| {
            let column = sort.expr.downcast_ref::<Column>()?;
            spec.by_bytes()
                .then(|| short_column(&memory, column.index()))
                .flatten()
        })
        .collect();
    let layout = match KeyLayout::with_short_bytes(specs.clone(), &short) {
        Some(layout) => layout,
        None => {
            let layout = KeyLayout::with_prefixes(specs)?;
            if !layout.exact() {
                return Err(format!(
                    "{}: the device selects per group over exact keys only (strings of at \
                     most 16 bytes, none ending in a zero byte, are exact)",
                    layout.prefix_note().unwrap_or_default()
                ));
            }
            layout
        }
    };
    let lo = match group_keys {
        0 => layout.total_bits(),
        g => layout.field_shift(g - 1),
    };
    let fusion = match config.fuse_expressions {
        true => fusion::plan(
            absorbed.filter.as_ref(),
            &absorbed.sort_exprs,
            &layout,
            &schema,
            true,
        ),
        false => return Err("gpu_topk.fuse_expressions = false".into()),
    };
    let on_device = fusion.keys == fusion::Part::Gpu
        && fusion
            .filter
            .as_ref()
            .is_none_or(|f| *f == fusion::Part::Gpu);
    let program = match &fusion.program {
        Some(p) if on_device && !p.refines && !p.host_predicate() => Arc::clone(p),
        _ => {
            return Err(format!(
                "the device runs only programs of the whole query ({})",
                fusion.describe(true)
            ));
        }
    };
    let mut estimate = estimate(
        absorbed.input.as_ref(),
        &layout,
        &fusion,
        absorbed.filter.is_some(),
    );
    if let Some(resident) =
        crate::input::columns::plan_resident_share(&absorbed.input, &program, None)
    {
        estimate.resident = resident;
        estimate.whole_table = true;
    }
    let settings = cost_settings(config);
    let start = cost::StartFacts::read(settings);
    let needs = cost::groups_before_device(settings, &estimate, &start)?;
    let device = cost::DeviceFacts::gather(settings, needs);
    let choice = cost::choose_groups(settings, &layout, estimate, *groups, k, &device)?;
    Ok(crate::exec::GroupDevicePlan {
        algorithm: choice.algorithm,
        selector_algorithm: choice.selector_algorithm,
        device: choice.device,
        reason: choice.reason,
        prediction: choice.prediction.map(|p| *p),
        table: absorbed.input,
        program,
        layout,
        lo,
        output_exprs: absorbed.output_exprs,
        fault: config.inject_fault,
        device_memory_limit: config.device_memory_limit,
        pinned_output_bytes: config.pinned_output_bytes,
    })
}

/// [`crate::keys::short_bytes`] over every batch of an in-memory input's column `index`: the
/// longest value where all are short enough to be exact in a composite. Each dictionary's
/// entries are read once however many batches share them.
fn short_column(memory: &crate::input::memory::MemoryInput<'_>, index: usize) -> Option<u32> {
    let column = *memory.columns.get(index)?;
    let mut seen = std::collections::HashSet::new();
    let mut longest = 0;
    for batch in memory.batches() {
        let array = batch.columns().get(column)?;
        if let Some(dictionary) = array.as_any_dictionary_opt()
            && !seen.insert(Arc::as_ptr(dictionary.values()).cast::<()>())
        {
            continue;
        }
        longest = longest.max(crate::keys::short_bytes(array.as_ref())?);
    }
    Some(longest)
}

/// The columns a top-k outputs: the expressions of the projection above its sort, or else
/// every column of `schema` (the sort's input) as it is.
fn output_columns(
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

/// The operator's inputs once the nodes below the sort are absorbed; every expression is
/// rewritten against `input`'s schema.
#[derive(Clone)]
struct Absorbed {
    input: Arc<dyn ExecutionPlan>,
    sort_exprs: LexOrdering,
    filter: Option<Arc<dyn PhysicalExpr>>,
    /// One per column of the sort's input (the operator's output before any projection above).
    output_exprs: Vec<Arc<dyn PhysicalExpr>>,
}

fn absorb_below(
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
fn is_column_projection(projection: &ProjectionExec) -> bool {
    projection
        .expr()
        .iter()
        .all(|p| p.expr.is::<Column>() || p.expr.is::<Literal>())
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

/// Device bytes assumed for a row of a string column read whole: its end offset and a
/// string of average length.
const ASSUMED_STRING_ROW_BYTES: usize = 8 + 32;

/// What the cost model is told of the input: its rows (from the statistics, when they say),
/// the bytes per row the operator moves to the device (the key columns' width, plus 8 for the
/// filter's columns and the bytes of each string column read whole), and whether a generated
/// program still has to be compiled (it is neither loaded nor in the disk cache).
fn estimate(
    input: &dyn ExecutionPlan,
    layout: &KeyLayout,
    fusion: &fusion::FusionPlan,
    filtered: bool,
) -> cost::Estimate {
    use datafusion::physical_plan::{StatisticsArgs, StatisticsContext};
    let rows = StatisticsContext::default()
        .compute(input, &StatisticsArgs::new())
        .ok()
        .and_then(|s| s.num_rows.get_value().copied());
    let compile = fusion.program.as_ref().is_some_and(|p| {
        crate::device::started_gpu().is_none_or(|d| !d.has_generated_kernel(&p.source))
    });
    // A string column the program reads whole ships its row ends and bytes.
    let strings = (fusion.program.iter())
        .flat_map(|p| p.inputs.iter())
        .filter(|input| matches!(input, fusion::KernelInput::StringColumn(_)))
        .count();
    cost::Estimate {
        rows,
        bytes_per_row: (layout.total_bits() as usize).div_ceil(8)
            + if filtered { 8 } else { 0 }
            + strings * ASSUMED_STRING_ROW_BYTES,
        compile,
        resident: 0.0,
        whole_table: false,
        decoded: false,
        pages: false,
    }
}
