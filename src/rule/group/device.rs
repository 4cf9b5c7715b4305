//! The device's plan of a per-group top-k, or why the CPU path.

use std::sync::Arc;

use datafusion::arrow::array::AsArray;
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, Partitioning};

use crate::config::{Algorithm, Backend, GpuTopKConfig};
use crate::cost;
use crate::fusion;
use crate::keys::KeyLayout;

use crate::exec::{GroupCpuPlan, GroupDevicePlan, GroupWarmUp};
use crate::rule::Declined;
use crate::rule::absorb::absorb_below;
use crate::rule::build::{cost_settings, estimate, key_specs};

/// The GPU plan of a per-group top-k over `input` (what was below the window's sort, which
/// sorts by `ordering`, its first `group_keys` keys the groups), or why the CPU path: the
/// device selects over a whole in-memory table (below the hash repartition and the filters
/// and projections it absorbs), with every key exact in the composite and the predicate and
/// keys in its generated code.
///
/// Where the input is an in-memory table, `groups` gets the estimated number of groups among
/// the rows that pass, whichever path is chosen. The CPU path's plan says what the cost model
/// weighed, and whether the table's columns are loaded after the run
/// (`gpu_topk.load_after_cpu`).
pub(super) fn group_device(
    input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    (group_keys, k): (usize, usize),
    config: &GpuTopKConfig,
    groups: &mut Option<usize>,
) -> std::result::Result<GroupDevicePlan, GroupCpuPlan> {
    group_plan(input, ordering, (group_keys, k), config, groups).map_err(|cpu| GroupCpuPlan {
        warm_up: cpu.warm_up.filter(|_| config.load_after_cpu),
        ..cpu
    })
}

impl From<String> for GroupCpuPlan {
    fn from(reason: String) -> Self {
        Self {
            reason,
            ..Self::default()
        }
    }
}

impl From<&str> for GroupCpuPlan {
    fn from(reason: &str) -> Self {
        reason.to_string().into()
    }
}

/// [`group_device`]'s decision.
fn group_plan(
    input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    (group_keys, k): (usize, usize),
    config: &GpuTopKConfig,
    groups: &mut Option<usize>,
) -> std::result::Result<GroupDevicePlan, GroupCpuPlan> {
    // The rows as the hash repartition below the sort received them.
    let below = match input.downcast_ref::<RepartitionExec>() {
        Some(r) if matches!(r.partitioning(), Partitioning::Hash(..)) && !r.preserve_order() => {
            r.input()
        }
        _ => input,
    };
    let absorbed = match absorb_below(below, ordering, None) {
        Ok(absorbed) => absorbed,
        Err(Declined::Because(why)) => return Err(why.into()),
        Err(Declined::NotTopK) => return Err("the input cannot be absorbed".into()),
    };
    let Some(memory) = crate::input::memory::memory_input(&absorbed.input) else {
        return Err("the device selects per group over in-memory tables only".into());
    };
    let group_exprs: Vec<_> = (absorbed.sort_exprs[..group_keys].iter())
        .map(|sort| Arc::clone(&sort.expr))
        .collect();
    *groups = super::estimate_groups(
        &memory,
        absorbed.filter.as_ref(),
        &group_exprs,
        super::Unseen::Chao,
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
                )
                .into());
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
            )
            .into());
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
    let table = Arc::clone(&absorbed.input);
    let cpu = |c: cost::GroupCpu| GroupCpuPlan {
        reason: c.reason,
        weighed: c.weighed.map(|w| w.describe()),
        warm_up: (c.warm_up).map(|device| GroupWarmUp {
            table: Arc::clone(&table),
            program: Arc::clone(&program),
            device,
        }),
    };
    let needs = cost::groups_before_device(settings, &estimate, &start).map_err(cpu)?;
    let compile = Some((program.source.as_str(), crate::fusion::ENTRY));
    let device = cost::DeviceFacts::gather(settings, needs, compile);
    let estimate = estimate.after_gather(compile);
    let choice =
        cost::choose_groups(settings, &layout, estimate, *groups, k, &device).map_err(cpu)?;
    Ok(GroupDevicePlan {
        algorithm: choice.algorithm,
        selector_algorithm: choice.selector_algorithm,
        device: choice.device,
        reason: choice.reason,
        prediction: choice.prediction.map(|p| *p),
        weighed: choice.weighed.map(|w| w.describe()),
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
/// longest value where all are short enough to be exact in a composite (0 for no batches).
/// (Long values told apart by their prefix words are exact too, but finding that out hashes
/// every row: the column cache does it once per image, not each plan.)
fn short_column(memory: &crate::input::memory::MemoryInput<'_>, index: usize) -> Option<u32> {
    let column = *memory.columns.get(index)?;
    let chunks = (memory.batches())
        .map(|batch| batch.columns().get(column).cloned())
        .collect::<Option<Vec<_>>>()?;
    // An empty array's values are short (none); a dictionary's entries count even so.
    let chunks: Vec<_> = (chunks.into_iter())
        .filter(|c| !c.is_empty() || c.as_any_dictionary_opt().is_some())
        .collect();
    match chunks.is_empty() {
        true => Some(0),
        false => crate::input::strings::short_chunks(&chunks),
    }
}
