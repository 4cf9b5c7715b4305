//! The selection over a whole table ([`TableSelector`]): the query's generated program
//! ([`crate::fusion`]) runs once over every row of an in-memory table or of a scan of Parquet
//! files, its input columns read from the device column cache (uploaded into it on a miss),
//! as an engine whose table lives in GPU memory runs it. The fused selection evaluates
//! predicate and keys inside the first pass of a sampled selection
//! ([`TopKEngine::fused_select`]); one read-back brings the winners' positions.
//!
//! A string sort key's column is held as its prefix words (each value's first 16 bytes,
//! `keys::prefix_words`, derived by the host's cores on a miss), which a prefix layout's
//! program packs into its composite. That composite is monotone, not exact: after the
//! selection one more pass of the program returns every row whose composite is at most the
//! k-th's ([`TopKEngine::fused_ties`]), and the caller ranks those by their whole keys
//! ([`TableSelection::refine`]); where they are more than the caller can rank at less cost
//! than another path, the pass only counts them ([`TableSelection::unranked`]).

use std::sync::Arc;

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;

use super::cuda::{ColumnBuffers, exec_error, gpu_error, program_error};
use super::{SelectionSpec, TransferMetrics};
use crate::device::column_cache::{CacheKey, CacheUse, NewEntry};
use crate::device::watch::{self, DeviceWatch};
use crate::device::{
    DeviceAlgorithm, FUSED_SAMPLE_ROWS, FusedReport, GatherColumn, GpuDevice, GpuError, GpuResult,
    GroupSpec, KeptPiece, KeptRows, PooledBuffer, TopKEngine, contain_panics,
};
use crate::fusion::{self, FusedProgram};
use crate::input::columns::{Reserved, TableColumn};
use crate::input::{ColumnImage, TableInput};

/// What [`TableSelector::select`] found.
#[derive(Debug)]
pub struct TableSelection {
    /// The winners' positions in the table (all batches back to back), in output order; with
    /// `refine`, the candidates (in no order) that hold them, to be ranked by their whole keys.
    pub positions: Vec<u64>,
    /// Whether `positions` are a prefix layout's candidates: every row whose composite is at
    /// most the k-th's (all passing rows where fewer than k passed).
    pub refine: bool,
    /// Candidates besides the k-th whose composite equals its: the ties the whole keys settle.
    pub tied: usize,
    /// Whether a prefix layout's candidates were more than the caller's limit
    /// ([`TableSelector::select`]): none are read back (`positions` is empty), and the caller
    /// ranks the table another way.
    pub unranked: bool,
    /// A per-group selection's pairs sorted (all that passed, or fewer:
    /// [`crate::device::GroupAlgorithm`]).
    pub sorted: usize,
    /// A per-group selection's device phases in ms ([`crate::device::FusedReport`]).
    pub group_phases_ms: [f32; 3],
    /// Rows that passed the predicate.
    pub passed: usize,
    /// Time spent compiling or loading the generated program.
    pub compile_time: std::time::Duration,
    /// A per-group selection's: each position's rank in its group (empty for a top-k).
    pub ranks: Vec<u64>,
    /// A per-group selection's rows kept.
    pub kept: usize,
}

/// Where a per-group selection sends its kept rows' columns: the program inputs (indices
/// into its inputs: per-row columns of fixed-width values) whose values the kept rows take on
/// the device, and the consumer of each piece read back, in the kept rows' order.
pub struct GroupRows<'s> {
    pub inputs: Vec<usize>,
    /// Whether the kept rows' ranks come back too.
    pub ranks: bool,
    /// Most bytes of read-back pieces the sink may keep as they are ([`KeptPiece::buffer`]).
    pub lend: usize,
    pub sink: &'s mut dyn FnMut(KeptPiece<'_>) -> Result<()>,
}

/// What a selection over a whole table computes after the generated program's pass.
#[derive(Debug, Clone, Copy)]
enum TableStep {
    /// The k best rows, by this algorithm, of the first `within` rows (all where `None`):
    /// the caller knows that no row after them passes the filter.
    TopK {
        algorithm: DeviceAlgorithm,
        within: Option<usize>,
        max_candidates: usize,
    },
    /// The k best rows of every group, the group keys from composite bit `lo` up.
    Groups(GroupSpec),
}

/// The selection over a whole table (see the module documentation), built by
/// [`super::create_selector`] for a plan over a whole table.
#[derive(Debug)]
pub struct TableSelector {
    spec: SelectionSpec,
    device: Arc<GpuDevice>,
    algorithm: DeviceAlgorithm,
}

impl TableSelector {
    pub(crate) fn new(
        spec: &SelectionSpec,
        device: Arc<GpuDevice>,
        algorithm: DeviceAlgorithm,
    ) -> Result<Self> {
        if spec.program.is_none() {
            return datafusion::common::internal_err!(
                "a selection over a whole table needs a generated program"
            );
        }
        Ok(Self {
            spec: spec.clone(),
            device,
            algorithm,
        })
    }

    /// Holds the cache's entries of `keys` (`None` where it has none) until the returned
    /// uses are dropped: a column found now stays until the selection has read it.
    pub(crate) fn hold(&self, keys: &[CacheKey]) -> Vec<Option<CacheUse>> {
        let cache = &self.device.column_cache;
        keys.iter().map(|key| cache.acquire(key)).collect()
    }

    /// The bytes of columns not yet resident the cache may load: its budget.
    pub fn cache_budget(&self) -> usize {
        self.device.column_cache.budget()
    }

    /// Top-k of the program over the whole table whose columns `inputs` are: the per-row
    /// ones read from the column cache, or uploaded into it on a miss (one entry per column,
    /// the table's batches back to back; an entry keyed by buffers keeps them, so a changed
    /// table misses). One fused selection over all rows, one read-back of the winners'
    /// positions.
    ///
    /// `Ok(None)`: the missing columns do not fit the cache's budget; the caller streams the
    /// table instead. Device failures are [`super::DeviceError`]s (the caller falls back).
    ///
    /// With `within`, only the table's first `within` rows are read: the caller knows that no
    /// later row passes the filter (the chunks' zones say so). A prefix layout's candidates
    /// are read back only up to `max_candidates` of them ([`TableSelection::unranked`]).
    pub fn select(
        &self,
        inputs: &[TableInput<'_>],
        within: Option<usize>,
        max_candidates: usize,
    ) -> Result<Option<TableSelection>> {
        let step = TableStep::TopK {
            algorithm: self.algorithm,
            within,
            max_candidates,
        };
        select_table(&self.spec, &self.device, step, inputs, None)
    }

    /// As [`select`](Self::select), the k best rows of every group instead: the program's
    /// composite holds the group keys from bit `lo` up; the positions come in (group, order
    /// keys, position) order with their ranks ([`TableSelection::ranks`]).
    ///
    /// With `rows_out`, the kept rows' columns are gathered on the device and handed to its
    /// sink in pieces instead (the selection's positions and ranks are then empty).
    pub fn select_groups(
        &self,
        inputs: &[TableInput<'_>],
        groups: GroupSpec,
        rows_out: Option<GroupRows<'_>>,
    ) -> Result<Option<TableSelection>> {
        let step = TableStep::Groups(groups);
        select_table(&self.spec, &self.device, step, inputs, rows_out)
    }
}

/// [`TableSelector::select`].
fn select_table(
    spec: &SelectionSpec,
    device: &Arc<GpuDevice>,
    step: TableStep,
    inputs: &[TableInput<'_>],
    rows_out: Option<GroupRows<'_>>,
) -> Result<Option<TableSelection>> {
    let Some(program) = &spec.program else {
        return datafusion::common::internal_err!("a table selection needs a generated program");
    };
    if inputs.len() != program.inputs.len() {
        return Err(exec_error(format!(
            "the program takes {} inputs, got {}",
            program.inputs.len(),
            inputs.len()
        )));
    }
    let _entered = spec.watch.as_ref().map(DeviceWatch::enter);
    let mut columns = Vec::new();
    let mut lookups = Vec::new();
    for input in inputs.iter().filter(|i| i.lookup.is_none()) {
        let column = TableColumn::new(input)?;
        lookups.push(device.column_cache.acquire(&column.key));
        columns.push(column);
    }
    // Columns given in part hold at least the rows the selection reads.
    let within = match step {
        TableStep::TopK { within, .. } => within,
        TableStep::Groups(_) => None,
    };
    let rows = columns.first().map_or(0, |c| c.rows);
    let short = |c: &TableColumn<'_, '_>| match within {
        Some(within) => c.rows < within,
        None => c.rows != rows,
    };
    if let Some(c) = columns.iter().find(|&c| short(c)) {
        return Err(exec_error(format!(
            "the program's inputs have {rows} and {} rows",
            c.rows
        )));
    }
    // Room for the missing columns, or stream.
    let missing: usize = (columns.iter().zip(&lookups))
        .filter(|(_, hit)| hit.is_none())
        .map(|(c, _)| c.layout().0)
        .sum();
    if missing > 0 && !device.column_cache.reserve(missing) {
        return Ok(None);
    }
    let reserved = Reserved {
        device,
        bytes: missing,
    };
    let result = contain_panics(|| {
        run_table(
            spec, device, program, step, inputs, &columns, &lookups, rows_out,
        )
    })
    .unwrap_or_else(|panic| Err(GpuError(format!("the CUDA bindings panicked: {panic}"))))
    .map_err(gpu_error)?;
    let (positions, ranks, tied, report, compile_time, uploaded) = result;
    let kept = match step {
        TableStep::Groups(_) => report.kept,
        TableStep::TopK { .. } => positions.len(),
    };
    let hit_bytes: Vec<usize> = (lookups.iter())
        .map(|hit| hit.as_ref().map_or(0, |h| h.entry().bytes()))
        .collect();
    drop(lookups);
    cache_uploads(
        &spec.transfers,
        device,
        &columns,
        uploaded,
        hit_bytes,
        reserved,
    );
    program_error(report.error)?;
    let unranked = tied.is_none();
    let (tied, sorted) = match step {
        TableStep::Groups(_) => (0, tied.unwrap_or(0)),
        TableStep::TopK { .. } => (tied.unwrap_or(0), 0),
    };
    Ok(Some(TableSelection {
        positions,
        refine: program.refines,
        tied,
        unranked,
        sorted,
        group_phases_ms: report.group_phases_ms,
        passed: report.passed as usize,
        compile_time,
        ranks,
        kept,
    }))
}

/// Inserts the columns a selection uploaded into the column cache (but those read for it
/// alone), gives back the room none took, and counts the hits, misses and bytes.
pub(crate) fn cache_uploads(
    transfers_out: &TransferMetrics,
    device: &GpuDevice,
    columns: &[TableColumn<'_, '_>],
    uploaded: Vec<Option<(PooledBuffer, Vec<usize>)>>,
    hit_bytes: Vec<usize>,
    mut reserved: Reserved<'_>,
) {
    let mut transfers = (0, 0, 0, 0);
    for ((column, buffer), hit_bytes) in columns.iter().zip(uploaded).zip(hit_bytes) {
        let bytes = match (buffer.is_some(), &column.input.encoded) {
            (false, _) => hit_bytes,
            (true, Some(encoded)) => encoded.shipped_bytes(),
            (true, None) => column.values_bytes(),
        };
        match buffer {
            None => {
                transfers.0 += 1;
                transfers.2 += bytes;
            }
            Some(_) if column.transient() => {
                transfers.1 += 1;
                transfers.3 += bytes;
            }
            Some((buffer, offsets)) => {
                transfers.1 += 1;
                transfers.3 += bytes;
                let entry_bytes = column.layout().0;
                debug_assert_eq!(buffer.bytes(), entry_bytes);
                let entry = NewEntry {
                    buffer,
                    offsets,
                    owners: column.owners(),
                    column: column.input.name.clone(),
                    chunks: column.input.pieces(),
                    pinned: false,
                    short_bytes: column.short_bytes(),
                };
                device.column_cache.insert(column.key.clone(), entry);
                reserved.filled(entry_bytes);
            }
        }
    }
    drop(reserved);
    transfers_out.cache_hits.add(transfers.0);
    transfers_out.cache_misses.add(transfers.1);
    transfers_out.resident_bytes.add(transfers.2);
    transfers_out.uploaded_bytes.add(transfers.3);
}

/// The device work of [`select_table`]: the uploads of missing columns (their new buffers,
/// in column order, `None` where resident), the selection and the read-back. The ties' count
/// is `None` where a prefix layout's candidates were more than the step's limit.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn run_table(
    spec: &SelectionSpec,
    device: &Arc<GpuDevice>,
    program: &FusedProgram,
    step: TableStep,
    inputs: &[TableInput<'_>],
    columns: &[TableColumn<'_, '_>],
    lookups: &[Option<CacheUse>],
    rows_out: Option<GroupRows<'_>>,
) -> GpuResult<(
    Vec<u64>,
    Vec<u64>,
    Option<usize>,
    FusedReport,
    std::time::Duration,
    Vec<Option<(PooledBuffer, Vec<usize>)>>,
)> {
    let (kernel, compile_time) = device.generated_kernel(&program.source, fusion::ENTRY)?;
    // Engines outlive the query (they idle for the next): not its memory.
    let mut engine = watch::outside(|| device.engine(program.key_kind))?;
    let (uploaded, column_args) =
        upload_missing(&spec.transfers, device, &mut engine, columns, lookups)?;
    // Per-dictionary-entry inputs: small, shipped with every query.
    let (args, lookup_tables) = program_args(device, &mut engine, inputs, column_args)?;
    let mut rows = columns.first().map_or(0, |c| c.rows);
    let (algorithm, max_candidates) = match step {
        TableStep::TopK {
            algorithm,
            within,
            max_candidates,
        } => {
            // The first rows of every column: the program reads them as a shorter table.
            rows = within.map_or(rows, |w| w.min(rows));
            (algorithm, max_candidates)
        }
        TableStep::Groups(groups) => {
            let mut rows_out = rows_out;
            let mut forward;
            let kept_rows = match &mut rows_out {
                None => None,
                Some(out) => {
                    let columns = gather_columns(inputs, columns, &args, &out.inputs)?;
                    let sink = &mut out.sink;
                    forward = move |piece: KeptPiece<'_>| -> GpuResult<()> {
                        sink(piece).map_err(|e| GpuError(e.to_string()))
                    };
                    Some(KeptRows {
                        columns,
                        ranks: out.ranks,
                        lend: out.lend,
                        sink: &mut forward,
                    })
                }
            };
            let kept = engine.fused_groups(&kernel, &args, rows, groups, spec.k, kept_rows)?;
            drop(lookup_tables);
            engine.synchronize()?;
            device.idle_engine(engine);
            // A per-group selection has no ties to refine: the count is of its pairs sorted.
            let sorted = kept.sorted;
            return Ok((
                kept.ids,
                kept.ranks,
                Some(sorted),
                kept.report,
                compile_time,
                uploaded,
            ));
        }
    };
    let (sorted, m, report) =
        engine.fused_select(&kernel, &args, rows, spec.k, algorithm, FUSED_SAMPLE_ROWS)?;
    let (positions, tied) = if report.error != 0 {
        engine.synchronize()?;
        (Vec::new(), Some(0))
    } else if program.refines && m == spec.k && m > 0 {
        // A prefix layout's k-th composite may tie rows the selection left out.
        match engine.fused_ties(&kernel, &args, rows, &sorted, m - 1, max_candidates)? {
            Some((positions, tied)) => (positions, Some(tied)),
            None => (Vec::new(), None),
        }
    } else {
        (engine.download_ids(&sorted, m)?, Some(0))
    };
    drop((sorted, lookup_tables));
    engine.synchronize()?;
    device.idle_engine(engine);
    Ok((positions, Vec::new(), tied, report, compile_time, uploaded))
}

/// Uploads the columns the cache misses (into the cache's memory, not the query's): their new
/// buffers in column order (`None` where resident), and each column's four kernel arguments.
#[allow(clippy::type_complexity)]
pub(crate) fn upload_missing(
    transfers: &TransferMetrics,
    device: &Arc<GpuDevice>,
    engine: &mut TopKEngine,
    columns: &[TableColumn<'_, '_>],
    lookups: &[Option<CacheUse>],
) -> GpuResult<(Vec<Option<(PooledBuffer, Vec<usize>)>>, Vec<[u64; 4]>)> {
    let upload_started = std::time::Instant::now();
    let mut uploaded = Vec::with_capacity(columns.len());
    let mut column_args = Vec::with_capacity(columns.len());
    for (column, lookup) in columns.iter().zip(lookups) {
        match lookup {
            Some(hit) => {
                column_args.push(column.args(&hit.entry().addresses()));
                uploaded.push(None);
            }
            None if !column.input.given() => {
                return Err(GpuError(format!(
                    "column {} is neither cached nor given",
                    column.input.name
                )));
            }
            None => {
                let (bytes, offsets) = column.layout();
                let stream = Arc::clone(engine.stream());
                // The cache's memory, not the query's.
                let buffer = watch::outside(|| device.pool.alloc(bytes, &stream))?;
                column.upload(engine, buffer.ptr(), &offsets)?;
                let addresses: Vec<u64> =
                    offsets.iter().map(|&o| buffer.ptr() + o as u64).collect();
                column_args.push(column.args(&addresses));
                uploaded.push(Some((buffer, offsets)));
            }
        }
    }
    if uploaded.iter().any(Option::is_some) {
        engine.synchronize()?;
        (transfers.upload_time).add_duration(upload_started.elapsed());
    }
    Ok((uploaded, column_args))
}

/// The program's arguments in its inputs' order: the per-row columns' (`column_args`), and
/// each dictionary lookup table's, shipped with every query (small); the tables' buffers are
/// held as long as the program may read them.
pub(crate) fn program_args(
    device: &Arc<GpuDevice>,
    engine: &mut TopKEngine,
    inputs: &[TableInput<'_>],
    column_args: Vec<[u64; 4]>,
) -> GpuResult<(Vec<u64>, Vec<PooledBuffer>)> {
    let mut lookup_tables = Vec::new();
    let mut args = Vec::with_capacity(4 * inputs.len());
    let mut per_row = column_args.into_iter();
    for input in inputs {
        let Some(array) = &input.lookup else {
            args.extend(per_row.next().expect("one per per-row input"));
            continue;
        };
        let width = match array.data_type() {
            DataType::Boolean => None,
            t => t.primitive_width(),
        };
        let column =
            ColumnBuffers::of(array.as_ref(), width).map_err(|e| GpuError(e.to_string()))?;
        let mut parts = Vec::new();
        column.parts(&mut parts);
        let mut addresses = Vec::new();
        for group in &parts {
            let bytes: usize = group.iter().map(|p| p.len()).sum();
            let buffer = device.pool.alloc(bytes.max(1), engine.stream())?;
            let image: Vec<(usize, &[u8])> = group
                .iter()
                .scan(0, |at, p| {
                    let part = (*at, *p);
                    *at += p.len();
                    Some(part)
                })
                .collect();
            engine.upload_image(&image, bytes, buffer.ptr())?;
            addresses.push(buffer.ptr());
            lookup_tables.push(buffer);
        }
        args.extend(column.addresses(&mut addresses.into_iter()));
    }
    Ok((args, lookup_tables))
}

/// The device columns of program inputs `wanted` (indices into `inputs`, each a per-row
/// input of fixed-width values; `columns` are the per-row inputs' images, `args` the
/// program's arguments, four an input).
fn gather_columns(
    inputs: &[TableInput<'_>],
    columns: &[TableColumn<'_, '_>],
    args: &[u64],
    wanted: &[usize],
) -> GpuResult<Vec<GatherColumn>> {
    wanted
        .iter()
        .map(|&i| {
            let input = inputs
                .get(i)
                .ok_or_else(|| GpuError(format!("no program input {i} to gather")))?;
            let per_row = inputs[..i].iter().filter(|x| x.lookup.is_none()).count();
            let width = match (input.lookup.is_none(), input.image, columns.get(per_row)) {
                (true, ColumnImage::Values, Some(column)) => column.width,
                _ => None,
            };
            let Some(width) = width else {
                return Err(GpuError(format!(
                    "program input {} is no column of fixed-width values",
                    input.name
                )));
            };
            Ok(GatherColumn {
                values: args[4 * i],
                width,
                validity: args[4 * i + 2],
            })
        })
        .collect()
}
