//! The one place a query's selection is decided, as pure functions of the settings, the
//! statistics and the machine's facts ([`super::facts`]): [`before_device`] settles what the
//! settings and the device's start decide, and [`choose`] resolves the rest against the
//! device and the model once per query into a [`SelectionPlan`] (where the selection runs,
//! with which algorithm, over which input form, and whether the column cache is warmed up
//! after it); [`groups_before_device`] and [`choose_groups`] do the same for a per-group
//! top-k, [`aggregate_before_device`] and [`choose_aggregate`] for a top-k over an aggregate;
//! [`device_algorithm`] resolves a forced algorithm; and the model answers an `auto`
//! selector's final selection ([`FinalChoice`]).

use std::path::Path;
use std::time::Duration;

use datafusion::error::{DataFusionError, Result};

use super::calibration::Calibration;
use super::calibration::cpu::CpuRates;
use super::facts::{DeviceFacts, GpuFacts, Needs, StartFacts};
use super::model::{Case, CostModel};
use crate::config::{Algorithm, Backend, FaultPoint};
use crate::device::plan::{self, reduction};
use crate::device::{DeviceAlgorithm, GpuDevice, KeyWidth};
use crate::keys::KeyLayout;
use crate::select::cuda::MIN_CAPACITY;
use crate::select::{FinalChoice, InputForm, SelectionChoice, SelectionPlan};

/// What the planner knows of the input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    /// Input rows (before the filter), when the statistics say.
    pub rows: Option<usize>,
    /// Bytes per row the operator moves to the device (the columns it reads).
    pub bytes_per_row: usize,
    /// Whether a generated program must be compiled (neither loaded in this process nor in
    /// the disk cache).
    pub compile: bool,
    /// The share of those bytes already in the device's column cache (0 to 1): they cross no
    /// PCIe link.
    pub resident: f64,
    /// Whether the input can be read as a whole table (an in-memory table or a scan of
    /// Parquet files that the session lets use the column cache, and a generated program
    /// that reads only its columns): the device then selects over it at once, one pass and
    /// no streaming reductions.
    pub whole_table: bool,
    /// Whether that whole table is files whose missing columns must be decoded first.
    pub decoded: bool,
    /// Whether it is files whose missing columns the device decodes from their pages, which
    /// the host reads first.
    pub pages: bool,
}

impl Estimate {
    /// The estimate once the device's facts are gathered: a program that compiled meanwhile
    /// (while the device calibrated, [`super::DeviceFacts::gather`]) costs no compile.
    pub(crate) fn after_gather(mut self, program: Option<(&str, &str)>) -> Self {
        if self.compile
            && let Some((source, _)) = program
            && crate::device::started_gpu().is_some_and(|d| d.compiled(source))
        {
            self.compile = false;
        }
        self
    }
}

/// How much longer an upload from pageable host memory takes than one from pinned memory: the
/// host copies into pinned staging first, overlapped with the transfer.
const STAGED_TRANSFER: f64 = 1.1;

/// How much longer loading Parquet columns as their pages takes than uploading their decoded
/// values from pinned memory: the host reads the column chunks first, then the pages are
/// staged and decoded on the device.
const PAGES_TRANSFER: f64 = 3.7;

/// Rows assumed when the statistics do not say.
pub(crate) const ASSUMED_ROWS: usize = 1 << 24;
/// A generated program's NVRTC compile, when this process has not timed one yet.
const COMPILE_ESTIMATE: Duration = Duration::from_millis(200);

/// Starting the device (its context, the kernels, the calibration from disk), charged to the
/// first query that needs it.
const DEVICE_START: Duration = Duration::from_millis(250);

/// The model's prediction for the chosen plan and its alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Rows the prediction is for, and whether the statistics gave them.
    pub rows: usize,
    pub rows_known: bool,
    /// Predicted seconds of the chosen plan.
    pub seconds: f64,
    /// Every alternative's prediction (`cuda sample`, `cpu select-nth`, ...), for EXPLAIN
    /// VERBOSE.
    pub alternatives: Vec<(SelectionChoice, f64)>,
    /// The model, for an `auto` selector's run-time choice of the final selection.
    pub model: Option<CostModel>,
    /// The share of the input bytes the device's column cache held ([`Estimate::resident`]).
    pub resident: f64,
}

impl Prediction {
    /// `predicted=1.23ms (n=16777216)`, with the alternatives when `verbose`.
    pub fn describe(&self, verbose: bool) -> String {
        let mut s = format!(
            "predicted={} (n{}{})",
            format_seconds(self.seconds),
            if self.rows_known { "=" } else { "≈" },
            self.rows
        );
        if self.resident > 0.0 {
            s.push_str(&format!(", resident={:.0}%", 100.0 * self.resident));
        }
        if verbose && !self.alternatives.is_empty() {
            let all: Vec<String> = self
                .alternatives
                .iter()
                .map(|(c, t)| format!("{c} {}", format_seconds(*t)))
                .collect();
            s.push_str(&format!(", alternatives=[{}]", all.join(", ")));
        }
        s
    }
}

/// Seconds as `12.3µs`, `4.56ms` or `1.23s`.
pub fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1}µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2}ms", s * 1e3)
    } else {
        format!("{s:.2}s")
    }
}

/// What [`choose`] decided for a query.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Placement {
    /// Run our operator with this plan.
    Run {
        plan: SelectionPlan,
        /// Why (shown in EXPLAIN VERBOSE), e.g. "CPU path forced by settings".
        reason: String,
        /// The model's prediction, where the GPU's calibration is at hand.
        prediction: Option<Box<Prediction>>,
    },
    /// Leave DataFusion's own TopK in place, and why.
    Decline(String),
}

/// The settings [`choose`] resolves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings<'a> {
    pub backend: Backend,
    pub algorithm: Algorithm,
    pub kernel_cache_dir: Option<&'a Path>,
    pub recalibrate: bool,
    /// A failure injected for tests (`gpu_topk.inject_fault`).
    pub fault: FaultPoint,
}

/// What [`before_device`] settled, or what the device must give [`choose`] to settle it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Stage {
    /// Decided without the device.
    Decided(Placement),
    /// Decided by [`choose`] over [`DeviceFacts`] gathered with these needs.
    Gather(Needs),
}

/// The decision before the device is touched. `k` is fetch + offset. The CPU path where the
/// settings force it, or (under `auto`, the device not started) where the statistics show it
/// ends before the device could start; else what [`DeviceFacts::gather`] must read for
/// [`choose`]: the calibration, except where the key layout's string prefixes settle the
/// query on the CPU path whatever the model says.
pub(crate) fn before_device(
    settings: Settings<'_>,
    layout: &KeyLayout,
    k: usize,
    estimate: &Estimate,
    start: &StartFacts,
) -> Stage {
    if let Some(placement) = forced_cpu(settings) {
        return Stage::Decided(placement);
    }
    if let Some(placement) = before_start(settings.backend, estimate, start) {
        return Stage::Decided(placement);
    }
    let input = input_form(k, estimate, settings.fault);
    Stage::Gather(Needs {
        calibration: prefix_route(settings.backend, layout, input, estimate).is_none(),
        cpu: false,
    })
}

/// The CPU path where the settings force it.
fn forced_cpu(settings: Settings<'_>) -> Option<Placement> {
    (settings.backend == Backend::Cpu || settings.algorithm == Algorithm::Cpu).then(|| {
        Placement::Run {
            plan: SelectionPlan::CPU,
            reason: "CPU path forced by settings".into(),
            prediction: None,
        }
    })
}

/// Where a key layout with string prefixes keeps a query off the device whatever the model
/// predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefixRoute {
    /// The device selects a prefix layout over a whole table only (where it can read the rows
    /// that tie the k-th composite again): a streamed one runs on the CPU path.
    Streamed,
    /// Under `auto`, the host derives a string column's prefix words from every string before
    /// they can be shipped: more than the CPU path's whole query. They are loaded after the
    /// run, for the next query.
    NotResident,
}

fn prefix_route(
    backend: Backend,
    layout: &KeyLayout,
    input: InputForm,
    estimate: &Estimate,
) -> Option<PrefixRoute> {
    layout.prefix_note()?;
    if input != InputForm::WholeTable {
        Some(PrefixRoute::Streamed)
    } else if backend == Backend::Auto && estimate.resident < 1.0 {
        Some(PrefixRoute::NotResident)
    } else {
        None
    }
}

/// Resolves the settings against the device's facts and the model, where [`before_device`]
/// asked for them (`device` gathered with its [`Needs`]). A device without kernels (a compile
/// failure) shows in EXPLAIN, and the query runs on the CPU path.
pub(crate) fn choose(
    settings: Settings<'_>,
    layout: &KeyLayout,
    k: usize,
    estimate: Estimate,
    device: &DeviceFacts,
) -> Placement {
    let Settings {
        backend,
        algorithm,
        fault,
        ..
    } = settings;
    let input = input_form(k, &estimate, fault);
    let device = match device {
        DeviceFacts::NoGpu(why) => {
            return cpu_or_decline(backend, format!("no GPU found ({why})"));
        }
        DeviceFacts::NoKernels(e) => {
            return cpu_or_decline(backend, format!("the GPU kernels are unusable ({e})"));
        }
        DeviceFacts::Ready(device) => device,
    };
    let gpu = format!("GPU {}", device.describe);
    if let Some(route) = prefix_route(backend, layout, input, &estimate) {
        let note = layout
            .prefix_note()
            .expect("a prefix route has a prefix layout");
        return match route {
            PrefixRoute::Streamed => {
                let why = match backend {
                    Backend::Cuda => {
                        "backend=cuda, but the device selects string prefixes over whole tables only"
                    }
                    _ => "the device selects string prefixes over whole tables only",
                };
                Placement::Run {
                    plan: SelectionPlan::CPU,
                    reason: format!("{gpu}; {note}; {why}: CPU path"),
                    prediction: None,
                }
            }
            PrefixRoute::NotResident => Placement::Run {
                plan: SelectionPlan::Cpu {
                    warm_up: warm_up(backend, &estimate),
                },
                reason: format!(
                    "{gpu}; {note}; the string prefixes are not resident: CPU path, then loaded"
                ),
                prediction: None,
            },
        };
    }
    let calibration = (device.calibration.as_ref())
        .expect("before_device asks for the calibration where no prefix route settles the query");
    let model = match calibration {
        Ok(c) => Some(c.model),
        Err(e) => {
            log::warn!("the cost model's calibration failed ({e}); choosing without it");
            None
        }
    };
    let on_device = OnDevice {
        gpu: &gpu,
        device,
        layout,
        k,
        estimate: &estimate,
    };
    match calibration {
        Ok(calibration) if algorithm == Algorithm::Auto => {
            fastest(backend, &on_device, input, calibration)
        }
        _ => named_algorithm(settings, &on_device, input, model),
    }
}

/// The CPU path under `backend = cuda`, which the query asked of this operator; else the
/// operator declines, and DataFusion's TopK runs the query.
fn cpu_or_decline(backend: Backend, why: String) -> Placement {
    match backend {
        Backend::Cuda => Placement::Run {
            plan: SelectionPlan::CPU,
            reason: format!("backend=cuda, but {why}: CPU path"),
            prediction: None,
        },
        _ => Placement::Decline(why),
    }
}

/// The query over a device with its kernels loaded, as the choices after the prefix routes
/// read it.
struct OnDevice<'a> {
    /// `GPU <name> (...)`, as the reason names it.
    gpu: &'a str,
    device: &'a GpuFacts,
    layout: &'a KeyLayout,
    k: usize,
    estimate: &'a Estimate,
}

/// A forced algorithm, or, uncalibrated, the rule of thumb (bitonic up to its k limit, then
/// radix): the setting names the algorithm, and the model, if any, only predicts it.
fn named_algorithm(
    settings: Settings<'_>,
    on_device: &OnDevice<'_>,
    input: InputForm,
    model: Option<CostModel>,
) -> Placement {
    let Settings {
        backend, algorithm, ..
    } = settings;
    let &OnDevice {
        gpu,
        device,
        layout,
        k,
        estimate,
    } = on_device;
    let forced = algorithm != Algorithm::Auto;
    let chosen = match algorithm_for(device.max_shared_per_block, layout, k, algorithm) {
        Ok(chosen) => chosen,
        Err(e) => {
            return cpu_or_decline(backend, format!("the GPU cannot run this selection ({e})"));
        }
    };
    let choice = SelectionChoice::Cuda(chosen);
    let prediction = model.map(|m| -> Box<Prediction> {
        let options = predict_options(&m, device.last_compile, layout, k, estimate, None);
        let seconds = options
            .iter()
            .find(|(c, _)| *c == choice)
            .map_or(f64::NAN, |(_, t)| *t);
        Box::new(Prediction {
            model: None,
            ..prediction_of(options, seconds, estimate)
        })
    });
    let why = match &device.calibration {
        Some(Err(e)) if !forced => format!("uncalibrated ({e}): rule of thumb"),
        _ => format!("algorithm={algorithm}"),
    };
    Placement::Run {
        plan: SelectionPlan::Cuda {
            algorithm: chosen,
            input,
        },
        reason: format!("{gpu}; {why}, k={k}, {}-bit keys", layout.total_bits()),
        prediction,
    }
}

/// Under `algorithm = 'auto'` with a calibrated model: the fastest predicted device
/// algorithm, or the CPU path where the backend is `auto` and it predicts faster (or where
/// [`cold_files`] sends the query there).
fn fastest(
    backend: Backend,
    on_device: &OnDevice<'_>,
    input: InputForm,
    calibration: &Calibration,
) -> Placement {
    let model = calibration.model;
    let &OnDevice {
        gpu,
        device,
        layout,
        k,
        estimate,
    } = on_device;
    // Over a whole table the fused selection's own final step is the sampled one.
    let only = (input == InputForm::WholeTable).then_some(DeviceAlgorithm::Sample);
    let mut options = predict_options(&model, device.last_compile, layout, k, estimate, only);
    if backend == Backend::Auto {
        options.push((SelectionChoice::Cpu, model.cpu_time(estimate.rows())));
    }
    let best = options.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
    let (choice, seconds) = match cold_files(backend, estimate, &options) {
        Some(cpu) => cpu,
        None => best.expect("the sampled selection is always an option"),
    };
    let plan = match choice {
        SelectionChoice::Cpu => SelectionPlan::Cpu {
            warm_up: warm_up(backend, estimate),
        },
        SelectionChoice::Cuda(algorithm) => SelectionPlan::Cuda { algorithm, input },
    };
    let describe = calibration.describe();
    Placement::Run {
        plan,
        reason: format!(
            "{gpu}; cost model ({describe}): {choice} fastest for k={k}, {}-bit keys",
            layout.total_bits()
        ),
        prediction: Some(Box::new(
            prediction_of(options, seconds, estimate).with_model(model),
        )),
    }
}

/// Over which input form the device selects: the whole table where the input can be read as
/// one and there is something to select. A fault injected at a selector's step (`create`,
/// `push`, `finish`) tests the streaming selector's fallback, so its input streams.
fn input_form(k: usize, estimate: &Estimate, fault: FaultPoint) -> InputForm {
    let selector_fault = !matches!(fault, FaultPoint::None | FaultPoint::Device(..));
    if estimate.whole_table && k > 0 && !selector_fault {
        InputForm::WholeTable
    } else {
        InputForm::Streamed
    }
}

/// Under `auto`, before the device is started: the CPU path where the statistics show it
/// finishes before the device could start (a small file's query then spends nothing on CUDA).
/// A whole table is still loaded after the run ([`warm_up`]), which starts the device in the
/// background for the next query.
fn before_start(backend: Backend, estimate: &Estimate, start: &StartFacts) -> Option<Placement> {
    if backend != Backend::Auto || start.started || !start.slow_start {
        return None;
    }
    cpu_before_start(backend, estimate, start.cpu.as_ref()?)
}

/// [`before_start`]'s choice at the host's calibrated `rates`, once it knows the device is not
/// started.
fn cpu_before_start(backend: Backend, estimate: &Estimate, rates: &CpuRates) -> Option<Placement> {
    let cpu = rates.topk_time(estimate.rows?);
    (cpu < DEVICE_START.as_secs_f64()).then(|| Placement::Run {
        plan: SelectionPlan::Cpu {
            warm_up: warm_up(backend, estimate),
        },
        reason: format!(
            "the GPU is not started, and the CPU path (about {}) ends before it could: CPU path",
            format_seconds(cpu)
        ),
        prediction: None,
    })
}

/// Whether a run on the CPU path is followed by loading the input's columns into the column
/// cache: under `auto`, over a whole table whose columns are not all resident (the GPU would
/// have had to ship them first), so that the next query finds them there.
fn warm_up(backend: Backend, estimate: &Estimate) -> bool {
    backend == Backend::Auto && estimate.whole_table && estimate.resident < 1.0
}

/// Under `auto`, files whose columns are not resident and would be decoded on the host run on
/// the CPU path: the GPU's first run would decode every row group of those columns before its
/// pass, where the scan decodes while the selection runs (and skips row groups the threshold
/// rules out); the columns are loaded into the cache after the run ([`warm_up`]), for the next
/// query. Columns the device decodes from their pages are the model's to weigh.
fn cold_files(
    backend: Backend,
    estimate: &Estimate,
    options: &[(SelectionChoice, f64)],
) -> Option<(SelectionChoice, f64)> {
    let cold = estimate.whole_table && estimate.decoded && estimate.resident < 1.0;
    if backend != Backend::Auto || !cold {
        return None;
    }
    options
        .iter()
        .copied()
        .find(|(c, _)| *c == SelectionChoice::Cpu)
}

impl Prediction {
    fn with_model(mut self, model: CostModel) -> Self {
        self.model = Some(model);
        self
    }
}

impl Estimate {
    /// The input rows, or [`ASSUMED_ROWS`] where the statistics do not say.
    fn rows(&self) -> usize {
        self.rows.unwrap_or(ASSUMED_ROWS)
    }
}

fn prediction_of(
    alternatives: Vec<(SelectionChoice, f64)>,
    seconds: f64,
    estimate: &Estimate,
) -> Prediction {
    Prediction {
        rows: estimate.rows(),
        rows_known: estimate.rows.is_some(),
        seconds,
        alternatives,
        model: None,
        resident: estimate.resident,
    }
}

/// The predicted operator time of every device algorithm that takes this k (or of `only`).
fn predict_options(
    model: &CostModel,
    last_compile: Option<Duration>,
    layout: &KeyLayout,
    k: usize,
    estimate: &Estimate,
    only: Option<DeviceAlgorithm>,
) -> Vec<(SelectionChoice, f64)> {
    let n = estimate.rows();
    let kind = layout.width();
    DeviceAlgorithm::ALL
        .iter()
        .filter(|&&a| only.is_none_or(|only| a == only))
        .filter_map(|&a| {
            operator_seconds(
                model,
                compile_seconds(last_compile, estimate),
                a,
                n,
                k,
                kind,
                estimate,
            )
            .map(|t| (SelectionChoice::Cuda(a), t))
        })
        .collect()
}

/// The operator's predicted time on the GPU with `algorithm` (see the module documentation).
pub(crate) fn operator_seconds(
    model: &CostModel,
    compile: f64,
    algorithm: DeviceAlgorithm,
    n: usize,
    k: usize,
    kind: KeyWidth,
    estimate: &Estimate,
) -> Option<f64> {
    if estimate.whole_table {
        // The missing columns staged from pageable memory, then one pass and the selection of
        // the few rows that beat its sampled threshold.
        let shipped = (n * estimate.bytes_per_row) as f64 * (1.0 - estimate.resident);
        let staged = match estimate.pages {
            true => PAGES_TRANSFER,
            false => STAGED_TRANSFER,
        };
        let candidates = n.min(2 * k.max(1));
        return Some(
            compile
                + staged * model.transfer_time(shipped as usize)
                + model.filter_time(n, candidates, kind)
                + model.predict(algorithm, &Case::pairs(candidates, k, kind, n))?,
        );
    }
    let capacity = (2 * k).max(MIN_CAPACITY);
    let candidates = n.min(capacity);
    let selection = model.predict(algorithm, &Case::pairs(candidates, k, kind, n))?;
    let reductions = if n > capacity && k < capacity {
        model.predict(reduction(algorithm), &Case::pairs(capacity, k, kind, n))?
    } else {
        0.0
    };
    Some(
        compile
            + model.transfer_time(n * estimate.bytes_per_row) * (1.0 - estimate.resident)
            + model.filter_time(n, candidates, kind)
            + reductions
            + selection,
    )
}

/// The generated program's compile, where the estimate says it has to be compiled.
pub(super) fn compile_seconds(last_compile: Option<Duration>, estimate: &Estimate) -> f64 {
    if estimate.compile {
        last_compile.unwrap_or(COMPILE_ESTIMATE).as_secs_f64()
    } else {
        0.0
    }
}

/// An `auto` selector's final selection of k among the candidates it holds: the device
/// algorithm the model predicts fastest for that many.
impl FinalChoice for CostModel {
    fn final_algorithm(&self, candidates: usize, k: usize, width: KeyWidth) -> DeviceAlgorithm {
        self.best_device(&Case::pairs(candidates, k, width, candidates))
            .0
    }
}

/// Resolves a device algorithm setting: `auto` without a model is the rule of thumb (bitonic
/// top-k up to its k limit, radix select beyond); a forced bitonic beyond its limit is an
/// error.
pub fn device_algorithm(
    device: &GpuDevice,
    layout: &KeyLayout,
    k: usize,
    algorithm: Algorithm,
) -> Result<DeviceAlgorithm> {
    algorithm_for(device.max_shared_per_block, layout, k, algorithm)
}

/// [`device_algorithm`] on a device whose blocks may use `max_shared_per_block` bytes of
/// shared memory.
fn algorithm_for(
    max_shared_per_block: usize,
    layout: &KeyLayout,
    k: usize,
    algorithm: Algorithm,
) -> Result<DeviceAlgorithm> {
    let bitonic = plan::bitonic_takes(k, max_shared_per_block, layout.width());
    match algorithm {
        Algorithm::Auto if bitonic.is_ok() => Ok(DeviceAlgorithm::Bitonic),
        Algorithm::Auto | Algorithm::Radix => Ok(DeviceAlgorithm::Radix),
        Algorithm::Bitonic => bitonic
            .map(|()| DeviceAlgorithm::Bitonic)
            .map_err(DataFusionError::Plan),
        Algorithm::Sample => Ok(DeviceAlgorithm::Sample),
        Algorithm::Delegate => Ok(DeviceAlgorithm::Delegate),
        Algorithm::Cpu => Err(DataFusionError::Plan(
            "algorithm 'cpu' does not run on the GPU".into(),
        )),
    }
}

mod aggregate;
mod groups;
pub(crate) use aggregate::*;
pub(crate) use groups::*;

#[cfg(test)]
mod tests;
