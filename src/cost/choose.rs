//! The one place a query's selection is decided: [`choose`] resolves the settings against
//! the machine and the model once per query into a [`SelectionPlan`] (where the selection
//! runs, with which algorithm, over which input form, and whether the column cache is warmed
//! up after it); [`device_algorithm`] resolves a forced algorithm; and the model answers an
//! `auto` selector's final selection ([`FinalChoice`]).

use std::path::Path;
use std::time::Duration;

use datafusion::error::{DataFusionError, Result};

use super::calibration;
use super::model::{Case, CostModel};
use crate::config::{Algorithm, Backend, FaultPoint};
use crate::device::plan::{self, reduction};
use crate::device::{
    DeviceAlgorithm, DeviceSlot, GROUP_SAMPLE, GpuDevice, GpuStatus, GroupAlgorithm, KeyWidth,
    gpu_status,
};
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
/// The CPU selector's rows per second per core before the calibration measured them: a low
/// figure, so that a query the CPU might not finish before the device starts starts it.
const ASSUMED_CPU_ROWS_PER_S: f64 = 100e6;

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

/// Resolves the settings against the machine and the model. `k` is fetch + offset. On the GPU
/// the kernels are loaded here (compiled by NVRTC on first use, cached in the kernel cache
/// directory), so a compile failure shows in EXPLAIN and the query runs on the CPU path; so is
/// the calibration (measured once per device, then read from the same directory).
pub(crate) fn choose(
    settings: Settings<'_>,
    layout: &KeyLayout,
    k: usize,
    estimate: Estimate,
) -> Placement {
    let Settings {
        backend,
        algorithm,
        kernel_cache_dir,
        recalibrate,
        fault,
    } = settings;
    if backend == Backend::Cpu || algorithm == Algorithm::Cpu {
        return Placement::Run {
            plan: SelectionPlan::CPU,
            reason: "CPU path forced by settings".into(),
            prediction: None,
        };
    }
    let cpu_or_decline = |why: String| match backend {
        Backend::Cuda => Placement::Run {
            plan: SelectionPlan::CPU,
            reason: format!("backend=cuda, but {why}: CPU path"),
            prediction: None,
        },
        _ => Placement::Decline(why),
    };
    if let Some(placement) = before_start(backend, &estimate) {
        return placement;
    }
    let input = input_form(k, &estimate, fault);
    let device = match gpu_status() {
        GpuStatus::Unavailable(why) => return cpu_or_decline(format!("no GPU found ({why})")),
        GpuStatus::Available(device) => device,
    };
    if let Err(e) = device.kernels_with_cache_dir(kernel_cache_dir) {
        return cpu_or_decline(format!("the GPU kernels are unusable ({e})"));
    }
    let gpu = format!("GPU {}", device.describe());
    if let Some(note) = layout.prefix_note()
        && input != InputForm::WholeTable
    {
        // The device selects a prefix layout over a whole table only (where it can read the
        // rows that tie the k-th composite again): a streamed one runs on the CPU path.
        let why = match backend {
            Backend::Cuda => {
                "backend=cuda, but the device selects string prefixes over whole tables only"
            }
            _ => "the device selects string prefixes over whole tables only",
        };
        return Placement::Run {
            plan: SelectionPlan::CPU,
            reason: format!("{gpu}; {note}; {why}: CPU path"),
            prediction: None,
        };
    }
    if let Some(note) = layout.prefix_note()
        && backend == Backend::Auto
        && estimate.resident < 1.0
    {
        // The host derives a string column's prefix words from every string before they can
        // be shipped: more than the CPU path's whole query. They are loaded after the run,
        // for the next query.
        return Placement::Run {
            plan: SelectionPlan::Cpu {
                warm_up: warm_up(backend, &estimate),
            },
            reason: format!(
                "{gpu}; {note}; the string prefixes are not resident: CPU path, then loaded"
            ),
            prediction: None,
        };
    }
    let calibration = calibration::calibration(device, kernel_cache_dir, recalibrate);
    let model = match &calibration {
        Ok(c) => Some(c.model),
        Err(e) => {
            log::warn!("the cost model's calibration failed ({e}); choosing without it");
            None
        }
    };
    let forced = algorithm != Algorithm::Auto;
    if forced || model.is_none() {
        // The setting (or, uncalibrated, the rule of thumb: bitonic up to its k limit, then
        // radix) names the algorithm; the model, if any, only predicts it.
        return match device_algorithm(device, layout, k, algorithm) {
            Ok(chosen) => {
                let choice = SelectionChoice::Cuda(chosen);
                let prediction = model.map(|m| -> Box<Prediction> {
                    let options = predict_options(&m, device, layout, k, &estimate, None);
                    let seconds = options
                        .iter()
                        .find(|(c, _)| *c == choice)
                        .map_or(f64::NAN, |(_, t)| *t);
                    Box::new(Prediction {
                        model: None,
                        ..prediction_of(options, seconds, &estimate)
                    })
                });
                let why = match &calibration {
                    Err(e) if !forced => format!("uncalibrated ({e}): rule of thumb"),
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
            Err(e) => cpu_or_decline(format!("the GPU cannot run this selection ({e})")),
        };
    }
    let model = model.expect("checked above");
    // Over a whole table the fused selection's own final step is the sampled one.
    let only = (input == InputForm::WholeTable).then_some(DeviceAlgorithm::Sample);
    let mut options = predict_options(&model, device, layout, k, &estimate, only);
    if backend == Backend::Auto {
        options.push((SelectionChoice::Cpu, model.cpu_time(estimate.rows())));
    }
    let fastest = options.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
    let (choice, seconds) = match cold_files(backend, &estimate, &options) {
        Some(cpu) => cpu,
        None => fastest.expect("the sampled selection is always an option"),
    };
    let plan = match choice {
        SelectionChoice::Cpu => SelectionPlan::Cpu {
            warm_up: warm_up(backend, &estimate),
        },
        SelectionChoice::Cuda(algorithm) => SelectionPlan::Cuda { algorithm, input },
    };
    let describe = calibration
        .as_ref()
        .map(|c| c.describe())
        .unwrap_or_default();
    Placement::Run {
        plan,
        reason: format!(
            "{gpu}; cost model ({describe}): {choice} fastest for k={k}, {}-bit keys",
            layout.total_bits()
        ),
        prediction: Some(Box::new(
            prediction_of(options, seconds, &estimate).with_model(model),
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

/// A per-group top-k placed on the GPU: how, on which device, why, and the model's
/// prediction.
pub(crate) struct GroupChoice {
    pub algorithm: GroupAlgorithm,
    /// The algorithm its whole-table selector is built with ([`GROUP_SELECTOR`]).
    pub selector_algorithm: DeviceAlgorithm,
    /// The device weighed, which runs it.
    pub device: DeviceSlot,
    pub reason: String,
    pub prediction: Option<Box<Prediction>>,
}

/// A per-group selection's whole-table selector: the fused selection's own, the sampled one
/// (its groups' step is the [`GroupAlgorithm`]).
const GROUP_SELECTOR: DeviceAlgorithm = DeviceAlgorithm::Sample;

/// The device's algorithm for `groups` groups (estimated; `None`: unknown) keeping `k` rows
/// each out of `rows`, and the pairs it sorts. At K = 1 `group-min` (about one pair a group);
/// else `group-threshold` where its limits leave at most an eighth of the pairs to sort (about
/// k sampled keys a group, each standing for rows / sample pairs), else `segmented-sort`.
pub(crate) fn group_algorithm(
    groups: Option<usize>,
    k: usize,
    rows: usize,
) -> (GroupAlgorithm, usize) {
    let per_sampled = rows.div_ceil(GROUP_SAMPLE).max(1);
    if k == 1 {
        return (GroupAlgorithm::Min, groups.unwrap_or(rows).min(rows));
    }
    match groups {
        Some(groups) if groups.saturating_mul(k).saturating_mul(per_sampled) <= rows / 8 => {
            let sorted = (groups * k * per_sampled).min(rows);
            (GroupAlgorithm::Threshold, sorted)
        }
        _ => (GroupAlgorithm::SegmentedSort, rows),
    }
}

/// How many times the top-k selector's time a row costs the per-group CPU path at least: each
/// row is converted to arrow's row format and its group looked up before any heap compares it.
const GROUP_CPU_FACTOR: f64 = 4.0;

/// Where a per-group top-k runs ([`crate::exec::GpuGroupTopKExec`]): `Ok` with the algorithm,
/// the reason and the model's prediction for the GPU, `Err` with why the CPU path. Under
/// `auto` the GPU runs where the model predicts its pass and sort (and the columns it ships)
/// below the CPU path's time: [`GROUP_CPU_FACTOR`] times the top-k selector's calibrated
/// rate, which the per-group heaps do not beat, so the comparison still leans to the CPU
/// path.
pub(crate) fn choose_groups(
    settings: Settings<'_>,
    layout: &KeyLayout,
    estimate: Estimate,
    groups: Option<usize>,
    k: usize,
) -> std::result::Result<GroupChoice, String> {
    let backend = settings.backend;
    if backend == Backend::Cpu || settings.algorithm == Algorithm::Cpu {
        return Err("CPU path forced by settings".into());
    }
    if let Some(Placement::Run { reason, .. }) = before_start(backend, &estimate) {
        return Err(reason);
    }
    let device = match gpu_status() {
        GpuStatus::Unavailable(why) => return Err(format!("no GPU found ({why}): CPU path")),
        GpuStatus::Available(device) => device,
    };
    if let Err(e) = device.kernels_with_cache_dir(settings.kernel_cache_dir) {
        return Err(format!("the GPU kernels are unusable ({e}): CPU path"));
    }
    let gpu = format!("GPU {}", device.describe());
    let kind = layout.width();
    let model = calibration::calibration(device, settings.kernel_cache_dir, settings.recalibrate)
        .map(|c| c.model);
    let (model, rows) = match model {
        Ok(model) => (model, estimate.rows()),
        Err(e) if backend == Backend::Cuda => {
            return Ok(GroupChoice {
                algorithm: group_algorithm(groups, k, estimate.rows()).0,
                selector_algorithm: GROUP_SELECTOR,
                device: device.slot,
                reason: format!("{gpu}; backend=cuda, uncalibrated ({e})"),
                prediction: None,
            });
        }
        Err(e) => return Err(format!("{gpu}; uncalibrated ({e}): CPU path")),
    };
    let shipped = (rows * estimate.bytes_per_row) as f64 * (1.0 - estimate.resident);
    let (algorithm, sorted) = group_algorithm(groups, k, rows);
    let limits = match algorithm {
        GroupAlgorithm::Threshold => model.filter_time(rows, sorted, kind),
        // A pass a key word, then the filter.
        GroupAlgorithm::Min => {
            (kind.key_words() + 1) as f64 * model.filter_time(rows, sorted, kind)
        }
        GroupAlgorithm::SegmentedSort => 0.0,
    };
    let seconds = compile_seconds(device, &estimate)
        + STAGED_TRANSFER * model.transfer_time(shipped as usize)
        + model.filter_time(rows, rows, kind)
        + limits
        + model.sort_time(sorted, kind, rows, 0);
    let cpu = GROUP_CPU_FACTOR * model.cpu_time(rows);
    let prediction = Box::new(Prediction {
        rows,
        rows_known: estimate.rows.is_some(),
        seconds,
        alternatives: vec![(SelectionChoice::Cpu, cpu)],
        model: None,
        resident: estimate.resident,
    });
    let versus = format!(
        "{} {} against the CPU path's {} or more",
        algorithm.name(),
        format_seconds(seconds),
        format_seconds(cpu)
    );
    let chosen = |reason| GroupChoice {
        algorithm,
        selector_algorithm: GROUP_SELECTOR,
        device: device.slot,
        reason,
        prediction: Some(prediction),
    };
    match backend {
        Backend::Cuda => Ok(chosen(format!("{gpu}; backend=cuda; {versus}"))),
        _ if seconds < cpu => Ok(chosen(format!("{gpu}; {versus}"))),
        _ => Err(format!("{gpu}; {versus}: CPU path")),
    }
}

/// Under `auto`, before the device is started: the CPU path where the statistics show it
/// finishes before the device could start (a small file's query then spends nothing on CUDA).
/// A whole table is still loaded after the run ([`warm_up`]), which starts the device in the
/// background for the next query.
fn before_start(backend: Backend, estimate: &Estimate) -> Option<Placement> {
    if backend != Backend::Auto
        || crate::device::probed_status().is_some()
        || !crate::device::probe_is_slow()
    {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpu_before_start(backend, estimate, cores)
}

/// [`before_start`]'s choice on `cores` cores, once it knows the device is not started.
fn cpu_before_start(backend: Backend, estimate: &Estimate, cores: usize) -> Option<Placement> {
    let cpu = estimate.rows? as f64 / (ASSUMED_CPU_ROWS_PER_S * cores.max(1) as f64);
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
    device: &GpuDevice,
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
                compile_seconds(device, estimate),
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
fn compile_seconds(device: &GpuDevice, estimate: &Estimate) -> f64 {
    if estimate.compile {
        device
            .last_compile_time()
            .unwrap_or(COMPILE_ESTIMATE)
            .as_secs_f64()
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
    let bitonic = plan::bitonic_takes(k, device.max_shared_per_block, layout.width());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::model::h100_like;

    /// Few large groups drop pairs by their limits (30 languages, 3 each); many small groups
    /// (a user's tweets), a K as large as the groups, and an unknown count sort them all.
    #[test]
    fn the_group_algorithm_follows_groups_and_k() {
        let rows = 20_000_000;
        let (algorithm, sorted) = group_algorithm(Some(30), 3, rows);
        assert_eq!(algorithm, GroupAlgorithm::Threshold);
        assert_eq!(sorted, 30 * 3 * rows.div_ceil(GROUP_SAMPLE));
        assert_eq!(
            group_algorithm(Some(4_500_000), 10, rows),
            (GroupAlgorithm::SegmentedSort, rows)
        );
        assert_eq!(
            group_algorithm(Some(30), 100_000, rows).0,
            GroupAlgorithm::SegmentedSort
        );
        assert_eq!(
            group_algorithm(None, 2, rows).0,
            GroupAlgorithm::SegmentedSort
        );
        assert_eq!(
            group_algorithm(Some(4_500_000), 1, rows),
            (GroupAlgorithm::Min, 4_500_000)
        );
        assert_eq!(group_algorithm(Some(30), 1, rows).0, GroupAlgorithm::Min);
        assert_eq!(group_algorithm(None, 1, rows), (GroupAlgorithm::Min, rows));
        assert_eq!(
            group_algorithm(Some(1), 2, 0).0,
            GroupAlgorithm::SegmentedSort
        );
        assert_eq!(
            group_algorithm(Some(40), 3, 20_000).0,
            GroupAlgorithm::Threshold
        );
    }

    /// Before the device is started, `auto` keeps a query the CPU path ends first off the
    /// device (and still loads a whole table for the next query); a larger or unknown input
    /// starts it; other backends never ask.
    #[test]
    fn the_cpu_path_runs_while_starting_the_device_would_take_longer() {
        let estimate = |rows: Option<usize>, whole_table: bool| Estimate {
            rows,
            bytes_per_row: 8,
            compile: false,
            resident: 0.0,
            whole_table,
            decoded: false,
            pages: false,
        };
        let small = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), true), 16);
        match small {
            Some(Placement::Run {
                plan: SelectionPlan::Cpu { warm_up: true },
                reason,
                prediction: None,
            }) => assert!(reason.contains("GPU is not started"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let streamed = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), false), 16);
        assert!(matches!(
            streamed,
            Some(Placement::Run {
                plan: SelectionPlan::Cpu { warm_up: false },
                ..
            })
        ));
        assert_eq!(
            cpu_before_start(Backend::Auto, &estimate(Some(1_000_000_000), true), 16),
            None
        );
        assert_eq!(
            cpu_before_start(Backend::Auto, &estimate(None, true), 16),
            None
        );
        assert_eq!(
            before_start(Backend::Cuda, &estimate(Some(1_000), true)),
            None
        );
    }

    /// The whole-table path ships only the columns not resident, and a resident table costs
    /// a pass at device bandwidth: far below the CPU path, and below streaming the input.
    #[test]
    fn a_whole_table_costs_its_missing_columns_and_one_pass() {
        let m = h100_like();
        let (n, k, kind) = (250_000_000, 50, KeyWidth::W32);
        let estimate = |resident: f64, whole_table: bool| Estimate {
            rows: Some(n),
            bytes_per_row: 12,
            compile: false,
            resident,
            whole_table,
            decoded: false,
            pages: false,
        };
        let time = |e: &Estimate| {
            operator_seconds(&m, 0.0, DeviceAlgorithm::Sample, n, k, kind, e).unwrap()
        };
        let cold = time(&estimate(0.0, true));
        let half = time(&estimate(0.5, true));
        let warm = time(&estimate(1.0, true));
        let shipped = STAGED_TRANSFER * m.transfer_time(n * 12);
        assert!(
            cold > shipped && cold < 1.2 * shipped,
            "{cold} vs {shipped}"
        );
        assert!(warm < half && half < cold, "{warm} {half} {cold}");
        // Files loaded as their pages: the host reads them before they are staged.
        let pages = time(&Estimate {
            pages: true,
            ..estimate(0.0, true)
        });
        let read = PAGES_TRANSFER * m.transfer_time(n * 12);
        assert!(pages > read && pages < cold + read, "{pages} vs {read}");
        assert!(warm < 0.05 * m.cpu_time(n), "{warm} vs {}", m.cpu_time(n));
        assert!(
            warm < time(&estimate(1.0, false)),
            "streaming reduces in pushes"
        );
    }

    /// Files not yet resident run on the CPU path under `auto` (and load in the background);
    /// resident ones, in-memory tables and a forced backend are the model's to choose.
    #[test]
    fn cold_files_under_auto_take_the_cpu_path() {
        let options = [
            (SelectionChoice::Cuda(DeviceAlgorithm::Sample), 0.01),
            (SelectionChoice::Cpu, 0.2),
        ];
        let files = |resident: f64, decoded: bool| Estimate {
            rows: Some(1 << 20),
            bytes_per_row: 12,
            compile: false,
            resident,
            whole_table: true,
            decoded,
            pages: false,
        };
        let cpu = Some((SelectionChoice::Cpu, 0.2));
        assert_eq!(cold_files(Backend::Auto, &files(0.0, true), &options), cpu);
        assert_eq!(cold_files(Backend::Auto, &files(0.5, true), &options), cpu);
        assert_eq!(cold_files(Backend::Auto, &files(1.0, true), &options), None);
        assert_eq!(
            cold_files(Backend::Auto, &files(0.0, false), &options),
            None
        );
        assert_eq!(cold_files(Backend::Cuda, &files(0.0, true), &options), None);
    }

    fn table(whole_table: bool, resident: f64) -> Estimate {
        Estimate {
            rows: Some(1 << 20),
            bytes_per_row: 8,
            compile: false,
            resident,
            whole_table,
            decoded: false,
            pages: false,
        }
    }

    /// The device reads a whole table at once wherever the input can be read so; it streams
    /// where there is nothing to select, and where a selector-level fault tests the streaming
    /// selector's fallback (device-operation faults are injected on either form).
    #[test]
    fn the_input_is_read_as_a_whole_table_where_it_can_be() {
        use crate::config::DeviceOp;
        let whole = |k, estimate: &Estimate, fault| input_form(k, estimate, fault);
        assert_eq!(
            whole(10, &table(true, 0.0), FaultPoint::None),
            InputForm::WholeTable
        );
        assert_eq!(
            whole(
                10,
                &table(true, 1.0),
                FaultPoint::Device(DeviceOp::Alloc, 1)
            ),
            InputForm::WholeTable
        );
        assert_eq!(
            whole(10, &table(false, 0.0), FaultPoint::None),
            InputForm::Streamed
        );
        assert_eq!(
            whole(0, &table(true, 1.0), FaultPoint::None),
            InputForm::Streamed
        );
        for fault in [FaultPoint::Create, FaultPoint::Push(1), FaultPoint::Finish] {
            assert_eq!(whole(10, &table(true, 1.0), fault), InputForm::Streamed);
        }
    }

    /// A run on the CPU path is followed by loading the columns only under `auto`, over a
    /// whole table whose columns are not all resident.
    #[test]
    fn a_cpu_run_warms_the_cache_under_auto_over_a_table_not_resident() {
        assert!(warm_up(Backend::Auto, &table(true, 0.0)));
        assert!(warm_up(Backend::Auto, &table(true, 0.5)));
        assert!(!warm_up(Backend::Auto, &table(true, 1.0)));
        assert!(!warm_up(Backend::Auto, &table(false, 0.0)));
        assert!(!warm_up(Backend::Cuda, &table(true, 0.0)));
        assert!(!warm_up(Backend::Cpu, &table(true, 0.0)));
    }

    /// The bitonic top-k's k limit is one rule with one message, which the planner and the
    /// device both give.
    #[test]
    fn the_bitonic_limit_is_one_rule() {
        let limit = plan::bitonic_max_k(227 * 1024, KeyWidth::W64);
        assert!(plan::bitonic_takes(limit, 227 * 1024, KeyWidth::W64).is_ok());
        let why = plan::bitonic_takes(limit + 1, 227 * 1024, KeyWidth::W64).unwrap_err();
        assert!(why.contains(&format!("up to {limit}")), "{why}");
    }
}
