//! The per-group top-k's decision (`GpuGroupTopKExec`): the CPU path's calibrated time
//! against the device's, this run's (the compile, the columns shipped) and a warm run's (columns resident, program compiled). Under `auto` the device runs where
//! it wins this run; where it wins only warm, the CPU path runs and the columns are loaded
//! into the column cache after it, for the next run of the shape; where it never wins, or the
//! CPU path ends before the device could start, the device is left alone.

use super::{
    DEVICE_START, Estimate, STAGED_TRANSFER, Settings, compile_seconds, forced_cpu, format_seconds,
};
use crate::config::Backend;
use crate::cost::calibration::cpu::CpuRates;
use crate::cost::facts::{DeviceFacts, GpuFacts, Needs, StartFacts};
use crate::cost::model::CostModel;
use crate::device::{DeviceAlgorithm, DeviceSlot, GROUP_SAMPLE, GroupAlgorithm};
use crate::keys::KeyLayout;
use crate::select::SelectionChoice;

use super::Prediction;

/// A per-group top-k placed on the GPU: how, on which device, why, and the model's
/// prediction.
#[derive(Debug)]
pub(crate) struct GroupChoice {
    pub algorithm: GroupAlgorithm,
    /// The algorithm its whole-table selector is built with ([`GROUP_SELECTOR`]).
    pub selector_algorithm: DeviceAlgorithm,
    /// The device weighed, which runs it.
    pub device: DeviceSlot,
    pub reason: String,
    pub prediction: Option<Box<Prediction>>,
    /// What was weighed, for EXPLAIN ([`Weighed::describe`]).
    pub weighed: Option<Weighed>,
}

/// A per-group top-k on the CPU path: why, what was weighed, and whether the table's columns
/// are loaded into the column cache of a device after the run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GroupCpu {
    pub reason: String,
    pub weighed: Option<Weighed>,
    /// The device whose column cache is loaded after the run (and the program compiled for
    /// it), where the device would win the next run once they are there.
    pub warm_up: Option<DeviceSlot>,
}

impl From<String> for GroupCpu {
    fn from(reason: String) -> Self {
        Self {
            reason,
            weighed: None,
            warm_up: None,
        }
    }
}

/// The predicted seconds a per-group decision weighed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Weighed {
    /// The CPU path, at the host's calibrated rate.
    pub cpu: f64,
    /// The device's run of this query (`None`: not weighed, the device not started).
    pub gpu: Option<f64>,
    /// The device's run with the columns resident and the program compiled.
    pub gpu_warm: Option<f64>,
}

impl Weighed {
    /// `predicted_cpu=…, predicted_gpu=…, predicted_gpu_warm=…`, as EXPLAIN
    /// shows it.
    pub fn describe(&self) -> String {
        let mut s = format!("predicted_cpu={}", format_seconds(self.cpu));
        if let Some(gpu) = self.gpu {
            s.push_str(&format!(", predicted_gpu={}", format_seconds(gpu)));
        }
        if let Some(warm) = self.gpu_warm {
            s.push_str(&format!(", predicted_gpu_warm={}", format_seconds(warm)));
        }
        s
    }
}

/// A per-group selection's whole-table selector: the fused selection's own, the sampled one
/// (its groups' step is the [`GroupAlgorithm`]).
const GROUP_SELECTOR: DeviceAlgorithm = DeviceAlgorithm::Sample;
/// `group-threshold` wins while its limits leave at most one pair in this many to sort.
const GROUP_THRESHOLD_SHARE: usize = 8;

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
        Some(groups)
            if groups.saturating_mul(k).saturating_mul(per_sampled)
                <= rows / GROUP_THRESHOLD_SHARE =>
        {
            let sorted = (groups * k * per_sampled).min(rows);
            (GroupAlgorithm::Threshold, sorted)
        }
        _ => (GroupAlgorithm::SegmentedSort, rows),
    }
}

/// The per-group top-k's decision before the device is touched: `Err` with the CPU path where
/// the settings force it or (under `auto`, the device not started) the CPU path at the host's
/// calibrated rate ends before the device could start, without starting it or loading
/// anything; else what [`DeviceFacts::gather`] must read for [`choose_groups`] (the
/// calibration and the CPU rates).
pub(crate) fn groups_before_device(
    settings: Settings<'_>,
    estimate: &Estimate,
    start: &StartFacts,
) -> std::result::Result<Needs, GroupCpu> {
    if forced_cpu(settings).is_some() {
        return Err(String::from("CPU path forced by settings").into());
    }
    let cpu_time = |rates: &CpuRates| estimate.rows.map(|rows| rates.group_time(rows));
    if let Some((reason, weighed)) = ends_before_start(settings, start, cpu_time) {
        return Err(GroupCpu {
            reason,
            weighed: Some(weighed),
            warm_up: None,
        });
    }
    Ok(Needs {
        calibration: true,
        cpu: true,
    })
}

/// Under `auto` with the device not started (and slow to start): the CPU path's reason and
/// time where it, priced by `cpu_time` at the host's calibrated rates, ends before the
/// device could start; `None` where the device is worth weighing.
pub(super) fn ends_before_start(
    settings: Settings<'_>,
    start: &StartFacts,
    cpu_time: impl FnOnce(&CpuRates) -> Option<f64>,
) -> Option<(String, Weighed)> {
    let unstarted = settings.backend == Backend::Auto && !start.started && start.slow_start;
    let cpu = cpu_time(start.cpu.as_ref().filter(|_| unstarted)?)?;
    (cpu < DEVICE_START.as_secs_f64()).then(|| {
        let reason = format!(
            "the GPU is not started, and the CPU path (about {}) ends before it could: CPU path",
            format_seconds(cpu)
        );
        let weighed = Weighed {
            cpu,
            gpu: None,
            gpu_warm: None,
        };
        (reason, weighed)
    })
}

/// Where a per-group top-k runs (the operator `GpuGroupTopKExec`), over the device's facts
/// that [`groups_before_device`] asked for: `Ok` with the algorithm, the reason and the
/// model's prediction for the GPU, `Err` with the CPU path. Under `auto` the GPU runs where
/// the model predicts this run (the compile, the columns shipped, its pass and sort) below the
/// CPU path's calibrated time; the CPU path runs and loads the columns after it where only a
/// warm run would be.
pub(crate) fn choose_groups(
    settings: Settings<'_>,
    layout: &KeyLayout,
    estimate: Estimate,
    groups: Option<usize>,
    k: usize,
    device: &DeviceFacts,
) -> std::result::Result<GroupChoice, GroupCpu> {
    let backend = settings.backend;
    let device = match device {
        DeviceFacts::NoGpu(why) => return Err(format!("no GPU found ({why}): CPU path").into()),
        DeviceFacts::NoKernels(e) => {
            return Err(format!("the GPU kernels are unusable ({e}): CPU path").into());
        }
        DeviceFacts::Ready(device) => device,
    };
    let gpu = format!("GPU {}", device.describe);
    let calibration =
        (device.calibration.as_ref()).expect("groups_before_device asks for the calibration");
    let model = match calibration {
        Ok(calibration) => calibration.model,
        Err(e) if backend == Backend::Cuda => {
            return Ok(GroupChoice {
                algorithm: group_algorithm(groups, k, estimate.rows()).0,
                selector_algorithm: GROUP_SELECTOR,
                device: device.slot,
                reason: format!("{gpu}; backend=cuda, uncalibrated ({e})"),
                prediction: None,
                weighed: None,
            });
        }
        Err(e) => return Err(format!("{gpu}; uncalibrated ({e}): CPU path").into()),
    };
    let rates = device
        .cpu
        .expect("groups_before_device asks for the CPU rates");
    let (algorithm, seconds) = device_seconds(&model, device, layout, &estimate, (groups, k));
    let warm = Estimate {
        compile: false,
        resident: 1.0,
        ..estimate
    };
    let (_, warm) = device_seconds(&model, device, layout, &warm, (groups, k));
    let weighed = weigh(&rates, &estimate, seconds, warm);
    let versus = format!(
        "{} {} ({} warm) against the CPU path's {}",
        algorithm.name(),
        format_seconds(seconds),
        format_seconds(warm),
        format_seconds(weighed.cpu)
    );
    let chosen = |reason| GroupChoice {
        algorithm,
        selector_algorithm: GROUP_SELECTOR,
        device: device.slot,
        reason,
        prediction: Some(Box::new(Prediction {
            rows: estimate.rows(),
            rows_known: estimate.rows.is_some(),
            seconds,
            alternatives: vec![(SelectionChoice::Cpu, weighed.cpu)],
            model: None,
            resident: estimate.resident,
        })),
        weighed: Some(weighed),
    };
    let cpu = |reason: String, warm_up: bool| GroupCpu {
        reason,
        weighed: Some(weighed),
        warm_up: warm_up.then_some(device.slot),
    };
    match backend {
        Backend::Cuda => Ok(chosen(format!("{gpu}; backend=cuda; {versus}"))),
        _ if seconds < weighed.cpu => Ok(chosen(format!("{gpu}; {versus}"))),
        _ if warm < weighed.cpu && estimate.whole_table => {
            Err(cpu(format!("{gpu}; {versus}: CPU path, then loaded"), true))
        }
        _ => Err(cpu(format!("{gpu}; {versus}: CPU path"), false)),
    }
}

/// What [`choose_groups`] weighed: the CPU path at `rates` beside the device's `gpu` and
/// `gpu_warm` seconds.
fn weigh(rates: &CpuRates, estimate: &Estimate, gpu: f64, gpu_warm: f64) -> Weighed {
    Weighed {
        cpu: rates.group_time(estimate.rows()),
        gpu: Some(gpu),
        gpu_warm: Some(gpu_warm),
    }
}

/// The device's algorithm for `groups` groups keeping `k` each, and its predicted run: the
/// compile the estimate says, the columns not resident, its pass, the groups' limits and the
/// sort. (The device's start is not in it: gathering the facts started the device.)
fn device_seconds(
    model: &CostModel,
    device: &GpuFacts,
    layout: &KeyLayout,
    estimate: &Estimate,
    (groups, k): (Option<usize>, usize),
) -> (GroupAlgorithm, f64) {
    let kind = layout.width();
    let rows = estimate.rows();
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
    let seconds = compile_seconds(device.last_compile, estimate)
        + STAGED_TRANSFER * model.transfer_time(shipped as usize)
        + model.filter_time(rows, rows, kind)
        + limits
        + model.sort_time(sorted, kind, rows, 0);
    (algorithm, seconds)
}
