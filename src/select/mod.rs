//! Selection: the one boundary between *what* to select and *which device* selects it.
//!
//! *What*: among all rows offered, the `k` smallest by `(composite key, row id)`. The composite
//! key is the order-preserving unsigned encoding of the sort keys ([`crate::keys`]); the row id
//! is the row's global input position (partition, then row within the partition; see
//! [`row_id`]), so every pair is unique, ties are broken by input order, and the result is the
//! first `k` rows of a stable sort: deterministic, and exactly DataFusion's order.
//!
//! *Which*: [`create_selector`] is the single entry point. It builds the selector the cost
//! model chose (a [`SelectionChoice`]; the selectors decide nothing); every implementation of [`TopKSelector`] returns the
//! same thing, the winners' row ids in output order. [`resident`] runs a generated program's
//! selection on columns already in device memory (the fusion benchmark, tests).

pub mod cpu;
pub mod cuda;
pub(crate) mod fault;
pub mod resident;

use std::fmt::{self, Debug};
use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::metrics::{Count, Time};

use crate::config::FaultPoint;
use crate::device::watch::DeviceWatch;
use crate::device::{DeviceAlgorithm, KeyWidth};
use crate::fusion::FusedProgram;
use crate::keys::KeyLayout;

/// Marks errors raised by a device selector, so the operator can tell a GPU fault (which falls
/// back to the CPU path) from an error of the query itself.
pub(crate) const DEVICE_ERROR_TAG: &str = "[gpu-topk device]";

/// Bits of a row id that hold the row's position inside its input partition.
pub(crate) const ROW_BITS: u32 = 40;

/// The global row id of row `row` of input partition `partition`: sorting by it gives the input
/// order (partition index, then batch, then row).
pub fn row_id(partition: usize, row: u64) -> u64 {
    debug_assert!(row < (1 << ROW_BITS));
    ((partition as u64) << ROW_BITS) | row
}

/// Row ids of the rows of one [`SelectInput`].
#[derive(Debug, Clone, Copy)]
pub enum RowIds<'a> {
    /// Consecutive ids starting at the given one (no filter, or all rows passed).
    Range(u64),
    /// One id per row (the rows that passed a filter).
    Explicit(&'a [u64]),
}

impl RowIds<'_> {
    #[inline]
    pub fn get(&self, i: usize) -> u64 {
        match self {
            RowIds::Range(start) => start + i as u64,
            RowIds::Explicit(ids) => ids[i],
        }
    }
}

/// One batch offered to a selector: the evaluated sort-key columns (one per sort expression,
/// aligned) and the rows' ids.
#[derive(Debug, Clone, Copy)]
pub struct SelectInput<'a> {
    pub keys: &'a [ArrayRef],
    pub row_ids: RowIds<'a>,
}

impl SelectInput<'_> {
    pub(crate) fn num_rows(&self) -> usize {
        self.keys.first().map(|a| a.len()).unwrap_or(0)
    }
}

/// One batch of raw input columns for a selector running a generated program
/// ([`crate::fusion`]): one column per kernel input, in the program's order.
#[derive(Debug, Clone, Copy)]
pub struct ColumnsInput<'a> {
    /// Each input as consecutive chunks (e.g. the batches of one push), all inputs with the
    /// same number of rows.
    pub columns: &'a [Vec<ArrayRef>],
    /// Row id of the first row; the rows' ids are consecutive.
    pub first_id: u64,
}

/// What a program-evaluating push kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedAdmitted {
    /// Rows that passed the predicate.
    pub passed: usize,
    /// Positions (ascending) of the rows that may still be winners.
    pub rows: Vec<u32>,
}

/// Which rows of an input may still be among the winners (the caller keeps only those rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    /// Every row may be a winner (e.g. the device decides later).
    All,
    /// Only these row positions (indices into the input, ascending).
    Indices(Vec<u32>),
}

/// A top-k selection in progress. Partition tasks call [`push`](Self::push) concurrently.
pub trait TopKSelector: Send + Sync + Debug {
    /// Short description for EXPLAIN ANALYZE and the CLI, e.g. `cpu` or `cuda radix (sm_90)`.
    fn describe(&self) -> String;

    /// Offers one batch.
    fn push(&self, input: SelectInput<'_>) -> Result<Admitted>;

    /// Time spent compiling (NVRTC) or loading the generated program when this selector was
    /// built: zero when it was already in memory, and for selectors without one.
    fn compile_time(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// Offers raw input columns, evaluated by the selection's generated program (predicate,
    /// keys, selection in one pass). Only selectors built with a program support it.
    fn push_columns(&self, _input: ColumnsInput<'_>) -> Result<FusedAdmitted> {
        datafusion::common::internal_err!("{} does not run generated programs", self.describe())
    }

    /// Rows per push this selector works best with: the operator concatenates batches up to
    /// this size when the selector admits every row ([`Admitted::All`]); 0 pushes each batch.
    fn preferred_push_rows(&self) -> usize {
        0
    }

    /// Row id of the current k-th best candidate, once k rows have been seen. Nothing worse can
    /// win any more, which is what the dynamic filter publishes to the scans.
    fn threshold_row_id(&self) -> Option<u64>;

    /// Row ids of the current candidates, ascending, when known cheaply (used to drop rows the
    /// caller no longer needs to retain); `None` when that would cost a device round trip.
    fn live_row_ids(&self) -> Result<Option<Vec<u64>>>;

    /// Ends the selection: the winners' row ids in output order (at most `k`).
    fn finish(&self) -> Result<Vec<u64>>;
}

/// The resolved choice for one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionChoice {
    /// This crate's CPU selector.
    Cpu,
    /// The CUDA selector with this algorithm.
    Cuda(DeviceAlgorithm),
}

impl SelectionChoice {
    /// `cpu` or `cuda`.
    pub fn backend(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "cpu",
            SelectionChoice::Cuda(_) => "cuda",
        }
    }

    /// The selection algorithm, e.g. `select-nth` (the CPU's) or `radix`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            SelectionChoice::Cpu => "select-nth",
            SelectionChoice::Cuda(algorithm) => algorithm.name(),
        }
    }
}

impl fmt::Display for SelectionChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.backend(), self.algorithm())
    }
}

/// Picks the device algorithm of a selection's final step once its candidate count is known.
/// The cost model implements it (`gpu_topk.algorithm = 'auto'`): selectors never choose.
pub trait FinalChoice: Send + Sync + Debug {
    fn final_algorithm(&self, candidates: usize, k: usize, width: KeyWidth) -> DeviceAlgorithm;
}

/// What to select: the key layout and `k` (the query's fetch plus its offset), and the
/// generated program when the device evaluates the predicate and keys itself.
#[derive(Debug, Clone)]
pub struct SelectionSpec {
    pub layout: KeyLayout,
    pub k: usize,
    pub program: Option<Arc<FusedProgram>>,
    /// With `gpu_topk.algorithm = 'auto'`: the cost model, which picks the device algorithm of
    /// the final selection once the number of candidates is known.
    pub final_choice: Option<Arc<dyn FinalChoice>>,
    /// A selection failure to inject ([`fault`]); `FaultPoint::None` in normal use. Faults of
    /// single device operations are injected by `watch` instead.
    pub fault: FaultPoint,
    /// The query's device accounting (held bytes, memory limit, injected device faults),
    /// entered around the selector's device work.
    pub watch: Option<Arc<DeviceWatch>>,
    /// What a device selection moved or found resident, for EXPLAIN ANALYZE.
    pub transfers: TransferMetrics,
}

impl SelectionSpec {
    /// Selects `k` rows of `layout`, keys shipped by the host: no program, no model, no fault,
    /// no accounting (the fields callers set as they need).
    pub fn new(layout: KeyLayout, k: usize) -> Self {
        Self {
            layout,
            k,
            program: None,
            final_choice: None,
            fault: FaultPoint::None,
            watch: None,
            transfers: TransferMetrics::default(),
        }
    }
}

/// Counters of a device selection's input transfers.
#[derive(Debug, Clone, Default)]
pub struct TransferMetrics {
    /// Table columns read from the column cache, and columns uploaded into it.
    pub cache_hits: Count,
    pub cache_misses: Count,
    /// Input bytes read from the cache, and shipped to the device.
    pub resident_bytes: Count,
    pub uploaded_bytes: Count,
    /// Time spent shipping columns into the cache.
    pub upload_time: Time,
}

/// The single entry point: builds the selector the cost model chose (wrapped to fail at
/// `spec.fault` when a fault is injected).
pub(crate) fn create_selector(
    spec: &SelectionSpec,
    choice: &SelectionChoice,
) -> Result<Arc<dyn TopKSelector>> {
    if spec.fault == FaultPoint::Create {
        return Err(fault::injected(spec.fault));
    }
    let selector = match choice {
        SelectionChoice::Cpu => cpu::new_selector(spec),
        SelectionChoice::Cuda(algorithm) => match crate::device::gpu() {
            Some(device) => cuda::new_cuda_selector(spec, device, *algorithm)?,
            None => {
                return Err(DataFusionError::External(
                    format!("{DEVICE_ERROR_TAG} no GPU available").into(),
                ));
            }
        },
    };
    Ok(match spec.fault {
        FaultPoint::None | FaultPoint::Device(..) => selector,
        point => Arc::new(fault::FaultInjector::new(selector, point)),
    })
}
