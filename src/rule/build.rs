//! The operator planned for this machine: its keys, fusion plan and placement.

use datafusion::arrow::row::RowConverter;
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::config::GpuTopKConfig;
use crate::cost::{self, Placement};
use crate::exec::{GpuTopKExec, TopKSpec};
use crate::fusion;
use crate::keys::{KeyLayout, KeySpec};
use crate::select::{InputForm, SelectionPlan};

use super::absorb::Absorbed;
use super::top_k::Shape;
use super::{Declined, because};

/// The operator over `absorbed` (the input and expressions below the replaced nodes), planned
/// for this machine, with the replaced nodes' `schema` and `equivalences`; or why DataFusion's
/// plan stays.
pub(super) fn build_top_k(
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
    let cached = config.column_cache && crate::input::is_whole_table(&absorbed.input);
    let layout = match cached {
        true => crate::input::columns::resident_layout(
            &absorbed.input,
            &absorbed.sort_exprs,
            specs,
            device,
        ),
        false => KeyLayout::with_prefixes(specs),
    }
    .or_else(because)?;
    if !layout.exact() && !RowConverter::supports_fields(&layout.sort_fields()) {
        return because("the sort keys have no row format to compare them in full");
    }

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
        let program = (fusion.program.as_ref()).map(|p| (p.source.as_str(), fusion::ENTRY));
        let placement = place_top_k(settings, &layout, k, estimate, program);
        (fusion, placement)
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

/// The top-k's placement: the cost model's decision before the device, then, where that
/// does not settle it, the device's facts gathered (the device started, its kernels loaded,
/// `program` compiling, its calibration read) and the decision over them.
fn place_top_k(
    settings: cost::Settings<'_>,
    layout: &KeyLayout,
    k: usize,
    estimate: cost::Estimate,
    program: Option<(&str, &str)>,
) -> Placement {
    let start = cost::StartFacts::read(settings);
    match cost::before_device(settings, layout, k, &estimate, &start) {
        cost::Stage::Decided(placement) => placement,
        cost::Stage::Gather(needs) => {
            let device = cost::DeviceFacts::gather(settings, needs, program);
            cost::choose(settings, layout, k, estimate.after_gather(program), &device)
        }
    }
}

/// What the cost model reads of the session's settings.
pub(super) fn cost_settings(config: &GpuTopKConfig) -> cost::Settings<'_> {
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
pub(super) fn key_specs(
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

/// Device bytes assumed for a row of a string column read whole: its end offset and a
/// string of average length.
pub(super) const ASSUMED_STRING_ROW_BYTES: usize = 8 + 32;

/// What the cost model is told of the input: its rows (from the statistics, when they say),
/// the bytes per row the operator moves to the device (the key columns' width, plus 8 for the
/// filter's columns and the bytes of each string column read whole), and whether a generated
/// program still has to be compiled (it is neither loaded nor in the disk cache).
pub(super) fn estimate(
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
