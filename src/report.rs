//! What an application tells its users about the operator: the GPU it found, and where the
//! top-k operators of a plan ran, or why DataFusion's TopK was kept (the CLI and the Python
//! package print these lines).

use std::any::Any;
use std::sync::Arc;

use datafusion::execution::SessionState;
use datafusion::physical_plan::ExecutionPlan;

use crate::cost::SelectionChoice;
use crate::device::{GpuStatus, gpu_status};
use crate::exec::{GpuAggregateTopKExec, GpuGroupTopKExec, GpuTopKExec};
use crate::rule::GpuTopKRule;

/// The GPU the operator uses (`NVIDIA H200, …`), or `none (why)`.
pub fn gpu_summary() -> String {
    match gpu_status() {
        GpuStatus::Available(device) => device.describe(),
        GpuStatus::Unavailable(why) => format!("none ({why})"),
    }
}

/// One line per top-k operator of `plan` (planned in `state`): its backend, algorithm and the
/// cost model's reason, with its metrics where the plan has run; or, where the plan has none,
/// why the rule kept DataFusion's TopK.
pub fn topk_report(state: &SessionState, plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut lines = Vec::new();
    visit(plan, &mut |node| {
        if let Some(exec) = node.downcast_ref::<GpuTopKExec>() {
            lines.push(describe(exec));
        } else if node.downcast_ref::<GpuAggregateTopKExec>().is_some() {
            lines.push(format!(
                "top-k over an aggregate: {}",
                datafusion::physical_plan::displayable(node.as_ref()).one_line()
            ));
        } else if node.downcast_ref::<GpuGroupTopKExec>().is_some() {
            lines.push(format!(
                "top-k per group: {}",
                datafusion::physical_plan::displayable(node.as_ref()).one_line()
            ));
        }
    });
    if lines.is_empty() {
        let reasons = (state.physical_optimizers().iter())
            .find_map(|rule| {
                (rule.as_ref() as &dyn Any)
                    .downcast_ref::<GpuTopKRule>()
                    .map(|r| r.last_decisions())
            })
            .unwrap_or_default();
        if reasons.is_empty() {
            lines.push(
                "top-k: no GpuTopKExec in this plan (not an ORDER BY ... LIMIT query)".into(),
            );
        }
        lines.extend(
            reasons
                .into_iter()
                .map(|r| format!("top-k: DataFusion's TopK kept: {r}")),
        );
    }
    lines
}

fn describe(exec: &GpuTopKExec) -> String {
    let spec = exec.spec();
    let metric = |name: &str| {
        exec.metrics()
            .and_then(|m| m.sum_by_name(name))
            .map(|v| v.as_usize())
    };
    let choice = spec.plan.choice();
    let eval = match choice {
        SelectionChoice::Cpu => String::new(),
        SelectionChoice::Cuda(_) => format!(", eval=[{}]", spec.fusion.describe(true)),
    };
    // The model's prediction beside the measured selection time, once the plan has run.
    let timing = match (&spec.prediction, metric("operator_time")) {
        (Some(p), Some(nanos)) => format!(
            ", {}, operator_time={}",
            p.describe(false),
            crate::cost::format_seconds(nanos as f64 / 1e9)
        ),
        (Some(p), None) => format!(", {}", p.describe(false)),
        _ => String::new(),
    };
    let fell_back = match metric("gpu_fallbacks") {
        Some(n) if n > 0 => ", GPU failed: fell back to the CPU path",
        _ => "",
    };
    let aggregate = match exec.aggregate_kept() {
        Some(why) => format!(", DataFusion's aggregation kept: {why}"),
        None => String::new(),
    };
    format!(
        "top-k: GpuTopKExec, backend={}, algorithm={}{eval}{timing} ({}){fell_back}{aggregate}",
        choice.backend(),
        choice.algorithm(),
        spec.reason,
    )
}

fn visit(plan: &Arc<dyn ExecutionPlan>, f: &mut dyn FnMut(&Arc<dyn ExecutionPlan>)) {
    f(plan);
    for child in plan.children() {
        visit(child, f);
    }
}
