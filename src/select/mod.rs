//! Selection: the one boundary between *what* to select and *which device* selects it.
//!
//! *What*: among all rows offered, the `k` smallest by `(composite key, row id)`. The composite
//! key is the order-preserving unsigned encoding of the sort keys ([`crate::keys`]); the row id
//! is the row's global input position (partition, then row within the partition; see
//! [`row_id`]), so every pair is unique, ties are broken by input order, and the result is the
//! first `k` rows of a stable sort: deterministic, and exactly DataFusion's order.
//!
//! *Which*: [`create_selector`] is the single entry point. It builds the selector of the plan
//! the cost model made (a [`SelectionPlan`]; the selectors decide nothing): a streaming
//! selector ([`TopKSelector`]: [`cpu`], [`cuda`], and [`prefix`] for keys the composite holds
//! only a prefix of) that takes the input batch by batch, or,
//! over a whole table whose columns the device column cache holds, a [`TableSelector`]
//! ([`table`]) that runs the query's generated program once over every row. Both return the
//! same thing, the winners' row ids (table positions) in output order.
//!
//! A failure of the device path is a [`DeviceError`]: the operator finishes the query on the
//! CPU path on it, and fails it on any other error.

pub mod cpu;
pub mod cuda;
pub(crate) mod fault;
pub mod groups;
pub mod prefix;
pub mod resident;
pub mod table;

use std::fmt::{self, Debug};
use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::error::Result;
use datafusion::physical_plan::metrics::{Count, Time};

use crate::config::FaultPoint;
pub use crate::device::error::DeviceError;
use crate::device::watch::DeviceWatch;
use crate::device::{DeviceAlgorithm, KeyWidth};
use crate::fusion::FusedProgram;
use crate::keys::KeyLayout;
pub use resident::ResidentColumns;
pub use table::TableSelector;

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

/// How a device selection reads its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputForm {
    /// The input's batches, pushed to a [`TopKSelector`] as the partitions stream them.
    Streamed,
    /// The whole table at once ([`TableSelector`]): the generated program runs over every row
    /// of an in-memory table or of a scan of Parquet files, its columns read from the device
    /// column cache (loaded into it on a miss), and only the winners are read from the host.
    WholeTable,
}

/// What the cost model decided for one query (its `choose`): where the selection
/// runs, with which algorithm, over which input form, and what follows it. The operator and
/// the selectors execute it; none of them chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionPlan {
    /// The CPU selector over the streamed input. `warm_up`: the input's columns are not all
    /// resident, so the run is followed by loading them into the column cache in the
    /// background, for the next query to run on the GPU.
    Cpu { warm_up: bool },
    /// The device, with `algorithm`, over the input in `input` form.
    Cuda {
        algorithm: DeviceAlgorithm,
        input: InputForm,
    },
}

impl SelectionPlan {
    /// The CPU path, where a device error leaves a query.
    pub const CPU: SelectionPlan = SelectionPlan::Cpu { warm_up: false };

    /// The device with `algorithm` over the streamed input.
    pub fn streamed(algorithm: DeviceAlgorithm) -> Self {
        SelectionPlan::Cuda {
            algorithm,
            input: InputForm::Streamed,
        }
    }

    /// Where and with which algorithm.
    pub fn choice(&self) -> SelectionChoice {
        match *self {
            SelectionPlan::Cpu { .. } => SelectionChoice::Cpu,
            SelectionPlan::Cuda { algorithm, .. } => SelectionChoice::Cuda(algorithm),
        }
    }

    pub fn input(&self) -> InputForm {
        match *self {
            SelectionPlan::Cpu { .. } => InputForm::Streamed,
            SelectionPlan::Cuda { input, .. } => input,
        }
    }

    /// Whether the column cache is loaded after the run (see [`SelectionPlan::Cpu`]).
    pub fn warm_up(&self) -> bool {
        matches!(self, SelectionPlan::Cpu { warm_up: true })
    }

    /// The same selection over the streamed input: where a whole table's columns turn out
    /// not to fit the column cache, or not to be readable as a table.
    pub fn on_streamed_input(self) -> Self {
        match self {
            SelectionPlan::Cuda { algorithm, .. } => SelectionPlan::streamed(algorithm),
            cpu => cpu,
        }
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
    /// Rows whose key prefix tied the k-th candidate's, compared in full ([`prefix`]).
    pub refined_rows: Count,
    /// The device a device selection runs on.
    pub device: crate::device::DeviceSlot,
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
            refined_rows: Count::new(),
            device: crate::device::DeviceSlot::default(),
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

/// A selector built for a [`SelectionPlan`].
#[derive(Debug)]
pub enum Selector {
    /// Takes the input batch by batch.
    Streamed(Arc<dyn TopKSelector>),
    /// Selects over a whole table at once.
    WholeTable(Box<TableSelector>),
}

/// The single entry point: builds the selector of the plan the cost model made (a streaming
/// one wrapped to fail at `spec.fault` when a fault is injected; a whole-table one, which
/// selects in one step, fails as it is built). A device plan without a usable GPU is a
/// [`DeviceError`].
pub(crate) fn create_selector(spec: &SelectionSpec, plan: &SelectionPlan) -> Result<Selector> {
    if spec.fault == FaultPoint::Create {
        return Err(fault::injected(spec.fault));
    }
    let selector = match *plan {
        SelectionPlan::Cpu { .. } if spec.layout.exact() => cpu::new_selector(spec),
        SelectionPlan::Cpu { .. } => prefix::new_selector(spec)?,
        SelectionPlan::Cuda {
            input: InputForm::Streamed,
            ..
        } if !spec.layout.exact() => {
            return datafusion::common::internal_err!(
                "the device selects a prefix layout over a whole table only"
            );
        }
        SelectionPlan::Cuda { algorithm, input } => {
            let device = crate::device::gpu_on(spec.device).ok_or_else(|| {
                DeviceError(format!("GPU {} unavailable", spec.device)).into_error()
            })?;
            match input {
                InputForm::Streamed => cuda::new_cuda_selector(spec, device, algorithm)?,
                InputForm::WholeTable => {
                    // A whole-table selection is one step, its only push and its finish: a
                    // fault injected at either fails it before any device work.
                    if matches!(spec.fault, FaultPoint::Push(_) | FaultPoint::Finish) {
                        return Err(fault::injected(spec.fault));
                    }
                    let table = TableSelector::new(spec, device, algorithm)?;
                    return Ok(Selector::WholeTable(Box::new(table)));
                }
            }
        }
    };
    Ok(Selector::Streamed(match spec.fault {
        FaultPoint::None | FaultPoint::Device(..) => selector,
        point => Arc::new(fault::FaultInjector::new(selector, point)),
    }))
}
