//! The operator's metrics, shown by `EXPLAIN ANALYZE`.

use std::sync::Arc;

use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, Time,
};

use crate::config::FaultPoint;
use crate::device::watch::DeviceWatch;
use crate::select::TransferMetrics;

/// Metrics shown by `EXPLAIN ANALYZE`.
#[derive(Debug, Clone)]
pub(super) struct TopKMetrics {
    pub(super) rows_in: Count,
    pub(super) rows_passed_filter: Count,
    pub(super) output_rows: Count,
    pub(super) gpu_fallbacks: Count,
    /// Rows whose key prefix tied the k-th candidate's and were compared in full.
    pub(super) rows_refined: Count,
    /// Runs whose device selection found more rows tying the k-th's key prefix than the host
    /// ranks for less than the CPU path costs, and which took the CPU path.
    pub(super) tie_fallbacks: Count,
    /// Chunks of a whole table not read: their zones showed no row could pass the filter.
    pub(super) chunks_skipped: Count,
    /// Device and pinned host bytes the selection holds now (zero once a run is over) and
    /// the most device bytes it held at once.
    pub(super) device_bytes_held: Gauge,
    pub(super) pinned_bytes_held: Gauge,
    pub(super) device_peak_bytes: Gauge,
    pub(super) filter_time: Time,
    pub(super) key_eval_time: Time,
    pub(super) select_time: Time,
    pub(super) retain_time: Time,
    pub(super) gather_time: Time,
    /// Time spent reading a Parquet input's columns for the column cache before the selection:
    /// decoding them on the host (columns decoded on the device are read while they are
    /// shipped, within `select_time`, or here where the runtime has one thread).
    pub(super) read_time: Time,
    /// A Parquet input's columns shipped as pages and decoded on the device.
    pub(super) device_decoded_columns: Count,
    /// Time this execution spent compiling (NVRTC) or loading its generated kernel: zero when
    /// the kernel was already in memory, as on a query's second run.
    pub(super) compile_time: Time,
    /// The cost model's prediction of the operator's time (EXPLAIN ANALYZE shows it beside
    /// `operator_time`).
    pub(super) predicted_time: Time,
    /// Wall time from the operator's start to its output: the selection of every partition's
    /// rows (and the wait for them), the final selection and the gather.
    pub(super) operator_time: Time,
    /// The device selection's input: pushes served by the column cache or shipped, and bytes.
    pub(super) transfers: TransferMetrics,
}

impl TopKMetrics {
    pub(super) fn new(set: &ExecutionPlanMetricsSet) -> Self {
        let time = |name: &'static str| MetricBuilder::new(set).subset_time(name, 0);
        Self {
            rows_in: MetricBuilder::new(set).counter("rows_in", 0),
            rows_passed_filter: MetricBuilder::new(set).counter("rows_passed_filter", 0),
            output_rows: MetricBuilder::new(set).output_rows(0),
            gpu_fallbacks: MetricBuilder::new(set).counter("gpu_fallbacks", 0),
            rows_refined: MetricBuilder::new(set).counter("rows_refined", 0),
            tie_fallbacks: MetricBuilder::new(set).counter("tie_fallbacks", 0),
            chunks_skipped: MetricBuilder::new(set).counter("chunks_skipped", 0),
            device_bytes_held: MetricBuilder::new(set).gauge("device_bytes_held", 0),
            pinned_bytes_held: MetricBuilder::new(set).gauge("pinned_bytes_held", 0),
            device_peak_bytes: MetricBuilder::new(set).gauge("device_peak_bytes", 0),
            filter_time: time("filter_time"),
            key_eval_time: time("key_eval_time"),
            select_time: time("select_time"),
            retain_time: time("retain_time"),
            gather_time: time("gather_time"),
            read_time: time("read_time"),
            device_decoded_columns: MetricBuilder::new(set).counter("device_decoded_columns", 0),
            compile_time: time("compile_time"),
            predicted_time: time("predicted_time"),
            operator_time: time("operator_time"),
            transfers: TransferMetrics {
                cache_hits: MetricBuilder::new(set).counter("cache_hits", 0),
                cache_misses: MetricBuilder::new(set).counter("cache_misses", 0),
                resident_bytes: MetricBuilder::new(set).counter("resident_bytes", 0),
                uploaded_bytes: MetricBuilder::new(set).counter("uploaded_bytes", 0),
                upload_time: time("upload_time"),
            },
        }
    }
}

/// An operator's device accounting for one query ([`DeviceWatch`]): at most `limit` device
/// bytes (0: no limit), the device operation `fault` names failing (faults at a selector's
/// steps are the selector's), and the bytes held reported into the operator's gauges.
pub(super) fn device_watch(
    limit: usize,
    fault: FaultPoint,
    device_bytes_held: &Gauge,
    device_peak_bytes: &Gauge,
    pinned_bytes_held: &Gauge,
) -> Arc<DeviceWatch> {
    let device_fault = match fault {
        FaultPoint::Device(op, n) => Some((op, n)),
        _ => None,
    };
    Arc::new(DeviceWatch::new(
        limit,
        device_fault,
        device_bytes_held.clone(),
        device_peak_bytes.clone(),
        pinned_bytes_held.clone(),
    ))
}
