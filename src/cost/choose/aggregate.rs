//! The top-k over an aggregate's decision (`GpuAggregateTopKExec`): DataFusion's hash
//! aggregation at the host's calibrated rate against the device's hash aggregation, this
//! run's (the columns shipped where the column cache lacks them) and a warm run's (every
//! column resident). Both are priced by the table's rows and the groups estimated from a
//! sample of it. Under `auto` the device runs where it wins this run; where it wins only warm,
//! the CPU path runs and the columns are loaded into the column cache after it; where the CPU
//! path ends before an unstarted device could start, the device is left alone. `cuda` takes
//! the device whatever the times (a run without one falls back to DataFusion's plan), `cpu`
//! never does. A generated pass (a filter, computed keys or inputs) that is not compiled yet
//! adds its compile to this run's device time, not to a warm one's, and so does interning
//! string keys whose codes are not resident.

use super::groups::{Weighed, ends_before_start};
use super::{Estimate, STAGED_TRANSFER, Settings, compile_seconds, forced_cpu, format_seconds};
use crate::config::Backend;
use crate::cost::calibration::cpu::CpuRates;
use crate::cost::facts::{DeviceFacts, Needs, StartFacts};
use crate::cost::model::{Case, CostModel};
use crate::device::{DeviceAlgorithm, DeviceSlot, KeyWidth, agg_slot_width};

/// What the planner knows of a top-k over an aggregate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AggregateEstimate {
    /// The table: its rows, the bytes a row ships (the columns the device reads) and the
    /// share of them resident.
    pub table: Estimate,
    /// The groups of the keys among the rows, estimated from a sample; `None`: unknown, priced
    /// as one a row (the most there can be).
    pub groups: Option<usize>,
    /// The key columns and the accumulators: a slot of the device's table holds a word of
    /// each and a state word.
    pub keys: usize,
    pub accumulators: usize,
    /// Groups selected (fetch + offset).
    pub k: usize,
    /// Rows of string key columns whose codes the column cache lacks: the host interns them
    /// before they ship (`input::codes`), a hash of every row as DataFusion's aggregation
    /// makes, so priced at its rate.
    pub interned_rows: usize,
}

impl AggregateEstimate {
    fn rows(&self) -> usize {
        self.table.rows()
    }

    /// The groups priced: the estimate, or one a row where it is unknown.
    fn groups(&self) -> usize {
        let rows = self.rows();
        self.groups.unwrap_or(rows).min(rows)
    }

    /// The ranking composites' width: the keys' words and the ranking value's, each with a
    /// NULL bit.
    fn width(&self) -> KeyWidth {
        KeyWidth::for_total_bits(65 * (self.keys as u32 + 1))
    }
}

/// The selection among the groups where no model chose one.
const UNWEIGHED_SELECTION: DeviceAlgorithm = DeviceAlgorithm::Radix;

/// A top-k over an aggregate placed on the device: the selection among the groups' ranking
/// pairs, why, and what was weighed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AggregateChoice {
    pub selection: DeviceAlgorithm,
    pub reason: String,
    pub weighed: Option<Weighed>,
}

/// A top-k over an aggregate on the CPU path (DataFusion's plan): why, what was weighed, and
/// the device whose column cache is loaded with the table's columns after the run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AggregateCpu {
    pub reason: String,
    pub weighed: Option<Weighed>,
    pub warm_up: Option<DeviceSlot>,
}

impl From<String> for AggregateCpu {
    fn from(reason: String) -> Self {
        Self {
            reason,
            weighed: None,
            warm_up: None,
        }
    }
}

/// The decision before the device is touched: `Err` with the CPU path where the settings
/// force it or (under `auto`, the device not started) DataFusion's aggregation at the host's
/// calibrated rate ends before the device could start, without starting it; else what
/// [`DeviceFacts::gather`] must read for [`choose_aggregate`] (the calibration and the CPU
/// rates).
pub(crate) fn aggregate_before_device(
    settings: Settings<'_>,
    estimate: &AggregateEstimate,
    start: &StartFacts,
) -> std::result::Result<Needs, AggregateCpu> {
    if forced_cpu(settings).is_some() {
        return Err(String::from("CPU path forced by settings").into());
    }
    let cpu_time =
        |rates: &CpuRates| Some(rates.aggregate_time(estimate.rows(), estimate.groups()));
    if let Some((reason, weighed)) = ends_before_start(settings, start, cpu_time) {
        return Err(AggregateCpu {
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

/// Where a top-k over an aggregate runs, over the device's facts that
/// [`aggregate_before_device`] asked for: `Ok` with the selection, the reason and what was
/// weighed, `Err` with the CPU path (see the module documentation).
pub(crate) fn choose_aggregate(
    settings: Settings<'_>,
    estimate: AggregateEstimate,
    device: &DeviceFacts,
) -> std::result::Result<AggregateChoice, AggregateCpu> {
    let forced = settings.backend == Backend::Cuda;
    let unweighed = |reason: String| AggregateChoice {
        selection: UNWEIGHED_SELECTION,
        reason,
        weighed: None,
    };
    let device = match device {
        DeviceFacts::NoGpu(why) if forced => {
            return Ok(unweighed(format!("backend=cuda, but no GPU found ({why})")));
        }
        DeviceFacts::NoGpu(why) => return Err(format!("no GPU found ({why}): CPU path").into()),
        DeviceFacts::NoKernels(e) if forced => {
            return Ok(unweighed(format!(
                "backend=cuda, but the GPU kernels are unusable ({e})"
            )));
        }
        DeviceFacts::NoKernels(e) => {
            return Err(format!("the GPU kernels are unusable ({e}): CPU path").into());
        }
        DeviceFacts::Ready(device) => device,
    };
    let gpu = format!("GPU {}", device.describe);
    let calibration =
        (device.calibration.as_ref()).expect("aggregate_before_device asks for the calibration");
    let model = match calibration {
        Ok(calibration) => calibration.model,
        Err(e) if forced => {
            return Ok(unweighed(format!(
                "{gpu}; backend=cuda, uncalibrated ({e})"
            )));
        }
        Err(e) => return Err(format!("{gpu}; uncalibrated ({e}): CPU path").into()),
    };
    let rates = device
        .cpu
        .expect("aggregate_before_device asks for the CPU rates");
    let (selection, seconds) = device_seconds(&model, &estimate);
    // A generated pass not compiled yet is compiled by this run, not by a warm one; string
    // keys not resident are interned by this run.
    let interning = match estimate.interned_rows {
        0 => 0.0,
        rows => rates.aggregate_time(rows, estimate.groups()),
    };
    let seconds = seconds + compile_seconds(device.last_compile, &estimate.table) + interning;
    let warm = AggregateEstimate {
        table: Estimate {
            resident: 1.0,
            compile: false,
            ..estimate.table
        },
        interned_rows: 0,
        ..estimate
    };
    let (_, warm) = device_seconds(&model, &warm);
    let weighed = Weighed {
        cpu: rates.aggregate_time(estimate.rows(), estimate.groups()),
        gpu: Some(seconds),
        gpu_warm: Some(warm),
    };
    let versus = format!(
        "hash and {} {} ({} warm) against the CPU path's {}",
        selection.name(),
        format_seconds(seconds),
        format_seconds(warm),
        format_seconds(weighed.cpu)
    );
    let chosen = |reason| AggregateChoice {
        selection,
        reason,
        weighed: Some(weighed),
    };
    let cpu = |reason: String, warm_up: bool| AggregateCpu {
        reason,
        weighed: Some(weighed),
        warm_up: warm_up.then_some(device.slot),
    };
    let cold = estimate.table.whole_table && estimate.table.resident < 1.0;
    match settings.backend {
        Backend::Cuda => Ok(chosen(format!("{gpu}; backend=cuda; {versus}"))),
        _ if seconds < weighed.cpu => Ok(chosen(format!("{gpu}; {versus}"))),
        _ if warm < weighed.cpu && cold => {
            Err(cpu(format!("{gpu}; {versus}: CPU path, then loaded"), true))
        }
        _ => Err(cpu(format!("{gpu}; {versus}: CPU path"), false)),
    }
}

/// The device's predicted run and the selection it takes among the groups: the columns not
/// resident staged over PCIe, the hash aggregation into a table of four times the groups (the
/// device's first table), and the fastest selection of k among the groups' ranking pairs.
/// (The device's start is not in it: gathering the facts started the device.)
fn device_seconds(model: &CostModel, estimate: &AggregateEstimate) -> (DeviceAlgorithm, f64) {
    let rows = estimate.rows();
    let groups = estimate.groups();
    let kind = estimate.width();
    let row_bytes = estimate.table.bytes_per_row;
    let shipped = (rows * row_bytes) as f64 * (1.0 - estimate.table.resident);
    let slots = (4 * groups.max(1)).next_power_of_two();
    let slot_bytes = 8 * agg_slot_width(estimate.keys, estimate.accumulators);
    let aggregate = model.aggregate_time((rows, row_bytes), (slots, slot_bytes), groups, kind);
    let k = estimate.k.min(groups);
    let (selection, select) = match k {
        0 => (UNWEIGHED_SELECTION, 0.0),
        k => model.best_device(&Case::pairs(groups, k, kind, slots)),
    };
    let transfer = STAGED_TRANSFER * model.transfer_time(shipped as usize);
    (selection, transfer + aggregate + select)
}

#[cfg(test)]
mod tests;
