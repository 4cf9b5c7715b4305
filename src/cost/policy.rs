//! The choices the operator makes while it runs, as pure functions of what it found: whether
//! a first run over Parquet files reads only their first rows, whether a whole table's
//! columns go through the column cache or the input streams, where Parquet pages are
//! decoded, and which plan a run streams with where its whole table was not selected. The
//! operator (`exec/`) gathers the facts and carries the choice out; it does not choose.

use super::model::CostModel;
use crate::select::SelectionPlan;

/// A first Parquet run reads only the rows that may pass up to this share of the table.
const PREFIX_SHARE: f64 = 0.5;

/// Whether a first run over Parquet files reads only the first `passing` of the table's
/// `rows` (the rest ruled out by the row groups' statistics), for itself alone, leaving the
/// whole columns to a load after it: past [`PREFIX_SHARE`], reading the first rows twice
/// costs more than the rows it saves. Only where some of its columns are `missing` from the
/// column cache: resident ones are read whole at no cost.
pub fn reads_first_rows(passing: usize, rows: usize, missing: bool) -> bool {
    missing && (passing as f64) <= PREFIX_SHARE * rows as f64
}

/// Whether the columns a whole-table run still has to load (`missing_bytes`) go through the
/// column cache (`budget` bytes): they do where they fit it; else the input streams.
pub fn table_fits_cache(missing_bytes: usize, budget: usize) -> bool {
    missing_bytes <= budget
}

/// Whether a Parquet column is loaded as its pages, decoded on the device: where the session
/// lets the device decode (`gpu_topk.decode_parquet_on_device`) and the column is cached as
/// its values (`values`), not as dictionary codes (`codes`), which the host renumbers into one
/// dictionary. Elsewhere the host decodes it.
pub fn decode_pages_on_device(setting: bool, values: bool, codes: bool) -> bool {
    values && !codes && setting
}

/// The plan a run continues with after a device error: the CPU path, which never fails like
/// a device.
pub fn after_device_error() -> SelectionPlan {
    SelectionPlan::CPU
}

/// The plan a run streams its input with where its whole table could not be read as one (or
/// did not fit the cache): the same selection over the streamed input, except for a selection
/// the device runs over whole tables only (`whole_tables_only`: a prefix layout's, or a
/// program that reads whole string columns), which takes the CPU path.
pub fn streamed_after_table(plan: SelectionPlan, whole_tables_only: bool) -> SelectionPlan {
    if whole_tables_only {
        SelectionPlan::CPU
    } else {
        plan.on_streamed_input()
    }
}

/// Host seconds a prefix layout's candidate costs to rank in full: its key columns gathered
/// from an in-memory table, encoded in arrow's row format, and its share of the sort.
const RANK_SECONDS: f64 = 0.5e-6;
/// The same for a candidate read back from Parquet files: its pages are decoded to reach it.
const RANK_FROM_FILES_SECONDS: f64 = 2e-6;
/// The CPU selector's rows per second per core where the model has no calibration: a high
/// figure, so that only a tie the host could not rank in the CPU path's time leaves the device.
const CPU_ROWS_PER_S: f64 = 50e6;
/// Cores assumed without a calibration.
const CPU_CORES: f64 = 4.0;

/// The most candidates of a prefix layout's selection over a whole table of `rows` rows
/// (every row whose composite is at most the k-th's) that the host ranks in full after the
/// device's selection; past it the run takes the CPU path instead, which ranks only the rows
/// whose first key can still win. The device's pass is spent either way: ranking `n`
/// candidates is priced at [`RANK_SECONDS`] each (`from_files`: [`RANK_FROM_FILES_SECONDS`])
/// against the model's CPU path over the table, and a few times k are always ranked (the
/// winners themselves are k of them).
pub fn host_ranked_candidates(
    k: usize,
    rows: usize,
    model: Option<&CostModel>,
    from_files: bool,
) -> usize {
    let cpu_seconds = match model {
        Some(model) => model.cpu_time(rows),
        None => rows as f64 / (CPU_ROWS_PER_S * CPU_CORES),
    };
    let per_candidate = if from_files {
        RANK_FROM_FILES_SECONDS
    } else {
        RANK_SECONDS
    };
    let priced = (cpu_seconds / per_candidate) as usize;
    priced.max(k.saturating_mul(4).saturating_add(1 << 12))
}

/// The plan a run continues with where its prefix layout's candidates were more than
/// [`host_ranked_candidates`]: the CPU path, whose prefix selector filters by the first key.
pub fn after_unranked_ties() -> SelectionPlan {
    SelectionPlan::CPU
}

/// A plan as the session lets it run: a CPU run's load of the column cache after it
/// ([`SelectionPlan::warm_up`]) only where `gpu_topk.load_after_cpu` is on (`load_after_cpu`).
pub fn with_load_after_cpu(plan: SelectionPlan, load_after_cpu: bool) -> SelectionPlan {
    if !load_after_cpu && plan.warm_up() {
        SelectionPlan::CPU
    } else {
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceAlgorithm;
    use crate::select::InputForm;

    /// A first run reads its first rows alone up to half the table, and only where a column
    /// is missing from the cache.
    #[test]
    fn a_first_run_reads_its_first_rows_up_to_half_the_table() {
        assert!(reads_first_rows(10, 100, true));
        assert!(reads_first_rows(50, 100, true));
        assert!(!reads_first_rows(51, 100, true));
        assert!(!reads_first_rows(10, 100, false));
    }

    /// An unreadable table streams the same selection, unless the device selects it over
    /// whole tables only; a device error leaves the CPU path.
    #[test]
    fn a_table_not_selected_streams_or_takes_the_cpu_path() {
        let table = SelectionPlan::Cuda {
            algorithm: DeviceAlgorithm::Sample,
            input: InputForm::WholeTable,
        };
        let streamed = SelectionPlan::streamed(DeviceAlgorithm::Sample);
        assert_eq!(streamed_after_table(table, false), streamed);
        assert_eq!(streamed_after_table(table, true), SelectionPlan::CPU);
        assert_eq!(after_device_error(), SelectionPlan::CPU);
        let warm = SelectionPlan::Cpu { warm_up: true };
        assert_eq!(with_load_after_cpu(warm, true), warm);
        assert_eq!(with_load_after_cpu(warm, false), SelectionPlan::CPU);
        assert_eq!(with_load_after_cpu(table, false), table);
    }

    /// The host ranks a few times k candidates whatever the table, more the longer the CPU
    /// path would take, fewer where they are read back from files; past that the CPU path
    /// ranks them.
    #[test]
    fn the_host_ranks_the_ties_the_cpu_path_would_take_longer_for() {
        let floor = host_ranked_candidates(100, 1000, None, false);
        assert!(floor >= 400);
        assert_eq!(floor, host_ranked_candidates(100, 0, None, false));
        let big = 60_000_000;
        let memory = host_ranked_candidates(100, big, None, false);
        let files = host_ranked_candidates(100, big, None, true);
        assert!(memory > files && files > floor);
        // A quarter of a large table tying the k-th's prefix is past either limit.
        assert!(big / 4 > memory);
        assert_eq!(after_unranked_ties(), SelectionPlan::CPU);
    }

    /// Pages are decoded on the device for a values image under the setting only.
    #[test]
    fn pages_are_decoded_on_the_device_for_values_under_the_setting() {
        assert!(decode_pages_on_device(true, true, false));
        assert!(!decode_pages_on_device(false, true, false));
        assert!(!decode_pages_on_device(true, false, false));
        assert!(!decode_pages_on_device(true, true, true));
        assert!(table_fits_cache(10, 10));
        assert!(!table_fits_cache(11, 10));
    }
}
