//! Skipping the chunks of a whole table that cannot pass the filter: each cached column keeps
//! its chunks' least and greatest values and NULLs ([`ChunkZones`]), DataFusion's pruning
//! predicate tells from them which chunks may hold a passing row, and the pass
//! reads the table only up to the last such chunk. Data kept in the order of a column the
//! query filters on (events by time, as the tweets are) then costs what the matching rows
//! cost; a filter no chunk can pass costs no pass at all.
//!
//! Over Parquet files the zones are the row groups' statistics, known from the footers before
//! any column is read ([`skip_row_groups`]).
//!
//! Only a prefix of the table is skipped to: the program reads its columns from their first
//! row, so a chunk ahead of the last one that may pass is read even where it cannot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray};
use datafusion::arrow::datatypes::{SchemaRef, UInt64Type};
use datafusion::common::pruning::PruningStatistics;
use datafusion::common::{Column, ScalarValue};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_optimizer::pruning::PruningPredicateBuilder;

use crate::device::column_cache::ChunkZones;
use crate::fusion::cannot_fail;
use crate::input::parquet::{ParquetInput, RowGroupLayout};
use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;

use super::columns::TableColumn;
use super::{ColumnImage, TableInput};
use crate::device::GpuDevice;
use crate::fusion::{FusedProgram, KernelInput};

/// Where the pass over a table may stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Skip {
    /// Rows from the table's start that may hold a passing row (0: none may).
    pub within: usize,
    /// Chunks after them, not read.
    pub chunks: usize,
}

/// How far into the table the rows passing `filter` can lie, by the zones the column cache
/// keeps for the filter's columns; `None` where every chunk may hold one or the zones do not
/// tell (a column the cache does not hold, a type without zones, a filter that can fail on a
/// row, whose error the pass must meet).
pub(crate) fn skip(
    filter: &Arc<dyn PhysicalExpr>,
    schema: &SchemaRef,
    program: &FusedProgram,
    inputs: &[TableInput<'_>],
    slot: crate::device::DeviceSlot,
) -> Option<Skip> {
    if !cannot_fail::predicate(filter) {
        return None;
    }
    // The zones are the device's own (kept with its cached chunks).
    crate::device::started_gpu()?;
    let device = crate::device::gpu_on(slot)?;
    let mut zones = HashMap::new();
    for column in collect_columns(filter) {
        let at = (program.inputs.iter())
            .position(|p| matches!(p, KernelInput::Column(c) if *c == column.index()))?;
        zones.insert(
            column.name().to_string(),
            chunk_zones(&device, inputs.get(at)?)?,
        );
    }
    skip_by(filter, schema, zones)
}

/// [`skip`] over a scan of Parquet files, by its row groups' statistics
/// ([`ParquetInput::row_group_zones`]): known before any column is read, so a first run
/// reads only the row groups up to the last one that may pass. Columns without statistics
/// are unknown to the pruning predicate, which keeps every row group for them.
pub(crate) fn skip_row_groups(
    filter: &Arc<dyn PhysicalExpr>,
    schema: &SchemaRef,
    files: &ParquetInput,
    layout: &RowGroupLayout,
) -> Option<Skip> {
    if !cannot_fail::predicate(filter) {
        return None;
    }
    // A column without zones rules nothing out; the others may (`rid < X AND lang = 'en'`).
    let mut zones = HashMap::new();
    for column in collect_columns(filter) {
        if let Some(column_zones) = files.row_group_zones(layout, column.index()) {
            zones.insert(column.name().to_string(), Arc::new(column_zones));
        }
    }
    skip_by(filter, schema, zones)
}

/// [`skip`] given the zones of the filter's columns, by name.
fn skip_by(
    filter: &Arc<dyn PhysicalExpr>,
    schema: &SchemaRef,
    zones: HashMap<String, Arc<ChunkZones>>,
) -> Option<Skip> {
    let first = zones.values().next()?;
    let chunks = first.rows.len();
    if zones.values().any(|z| z.rows.len() != chunks) {
        return None;
    }
    let rows = Arc::clone(&first.rows);
    let predicate = PruningPredicateBuilder::new()
        .with_file_schema(Arc::clone(schema))
        .try_build(Arc::clone(filter))
        .ok()?;
    let keep = predicate
        .prune(&Zones {
            zones,
            rows: Arc::clone(&rows),
            chunks,
        })
        .ok()?;
    let last = keep.iter().rposition(|&k| k);
    let skipped = chunks - last.map_or(0, |j| j + 1);
    if skipped == 0 {
        return None;
    }
    let rows = rows.as_primitive::<UInt64Type>();
    let within = last.map_or(0, |j| rows.values()[..=j].iter().sum::<u64>() as usize);
    Some(Skip {
        within,
        chunks: skipped,
    })
}

/// The zones of the filter's columns, as DataFusion's pruning reads statistics: one
/// container a chunk.
struct Zones {
    zones: HashMap<String, Arc<ChunkZones>>,
    rows: ArrayRef,
    chunks: usize,
}

impl PruningStatistics for Zones {
    fn min_values(&self, column: &Column) -> Option<ArrayRef> {
        self.zones.get(column.name()).map(|z| Arc::clone(&z.mins))
    }

    fn max_values(&self, column: &Column) -> Option<ArrayRef> {
        self.zones.get(column.name()).map(|z| Arc::clone(&z.maxs))
    }

    fn num_containers(&self) -> usize {
        self.chunks
    }

    fn null_counts(&self, column: &Column) -> Option<ArrayRef> {
        self.zones.get(column.name()).map(|z| Arc::clone(&z.nulls))
    }

    fn row_counts(&self) -> Option<ArrayRef> {
        Some(Arc::clone(&self.rows))
    }

    #[allow(clippy::mutable_key_type)] // the trait's signature
    fn contained(&self, _: &Column, _: &HashSet<ScalarValue>) -> Option<BooleanArray> {
        None
    }
}

/// The chunk zones of a per-row input whose values the column cache holds: each chunk's least
/// and greatest value, NULLs and rows, kept with the entry. The first ask starts working them
/// out on one thread of its own (a pass over the column) and the query goes on without them.
/// `None` until then, where the cache does not hold the column, the input comes without its
/// chunks, or its type is not an integer, decimal or temporal one (floats' NaNs and signed
/// zeros are left to the pass).
pub fn chunk_zones(device: &GpuDevice, input: &TableInput<'_>) -> Option<Arc<ChunkZones>> {
    let first = input.chunks.first()?;
    if input.image != ColumnImage::Values || input.lookup.is_some() || !has_zones(first.data_type())
    {
        return None;
    }
    let key = TableColumn::new(input).ok()?.key;
    device.column_cache.zones(&key, |slot| {
        let chunks = input.chunks.to_vec();
        let spawned = std::thread::Builder::new()
            .name("gpu-topk-zones".into())
            .spawn(move || slot.fill(derive_zones(&chunks).ok()));
        if let Err(e) = spawned {
            log::warn!("cannot start working out chunk zones: {e}");
        }
    })
}

/// Whether columns of `data_type` have zones: integer, decimal and temporal ones, ordered as
/// their values (floats' NaNs and signed zeros are left to the pass).
pub(crate) fn has_zones(data_type: &DataType) -> bool {
    data_type.is_integer()
        || data_type.is_temporal()
        || matches!(
            data_type,
            DataType::Decimal32(..)
                | DataType::Decimal64(..)
                | DataType::Decimal128(..)
                | DataType::Decimal256(..)
        )
}

/// [`ChunkZones`] of `chunks`, on the calling thread: they are worked out in the background,
/// where all cores would slow the queries running meanwhile.
pub(crate) fn derive_zones(chunks: &[ArrayRef]) -> Result<ChunkZones> {
    use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
    use datafusion::logical_expr::Accumulator;
    let zone = |chunk: &ArrayRef| -> Result<_> {
        let mut min = MinAccumulator::try_new(chunk.data_type())?;
        let mut max = MaxAccumulator::try_new(chunk.data_type())?;
        min.update_batch(std::slice::from_ref(chunk))?;
        max.update_batch(std::slice::from_ref(chunk))?;
        Ok((min.evaluate()?, max.evaluate()?, chunk.null_count() as u64))
    };
    let (mut mins, mut maxs, mut nulls) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in chunks {
        let (min, max, null) = zone(chunk)?;
        mins.push(min);
        maxs.push(max);
        nulls.push(null);
    }
    let rows = chunks.iter().map(|c| c.len() as u64);
    Ok(ChunkZones {
        mins: datafusion::common::ScalarValue::iter_to_array(mins)?,
        maxs: datafusion::common::ScalarValue::iter_to_array(maxs)?,
        nulls: Arc::new(datafusion::arrow::array::UInt64Array::from(nulls)),
        rows: Arc::new(datafusion::arrow::array::UInt64Array::from_iter_values(
            rows,
        )),
    })
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::DFSchema;
    use datafusion::logical_expr::{col, lit};
    use datafusion::physical_expr::create_physical_expr;
    use datafusion::physical_expr::execution_props::ExecutionProps;

    use super::*;
    use crate::input::zones::derive_zones;

    /// Four chunks of `t`: 0..10, 10..20, 20..30 (every other row NULL), and all NULL; `u`
    /// descends.
    fn zones() -> (SchemaRef, HashMap<String, Arc<ChunkZones>>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("t", DataType::Int64, true),
            Field::new("u", DataType::Int64, true),
        ]));
        let t: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(0..10)),
            Arc::new(Int64Array::from_iter_values(10..20)),
            Arc::new(Int64Array::from_iter(
                (20..30).map(|v| (v % 2 == 0).then_some(v)),
            )),
            Arc::new(Int64Array::from(vec![None::<i64>; 10])),
        ];
        let u: Vec<ArrayRef> = (0..4)
            .map(|c| {
                Arc::new(Int64Array::from_iter_values(
                    (0..10).map(|r| 100 - c * 10 - r),
                )) as _
            })
            .collect();
        let zones = [("t", t), ("u", u)]
            .into_iter()
            .map(|(name, chunks)| (name.to_string(), Arc::new(derive_zones(&chunks).unwrap())))
            .collect();
        (schema, zones)
    }

    fn skip_for(filter: datafusion::logical_expr::Expr) -> Option<Skip> {
        let (schema, zones) = zones();
        let df_schema = DFSchema::try_from(schema.as_ref().clone()).unwrap();
        let context =
            datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext::default();
        let filter =
            create_physical_expr(&filter, &df_schema, &ExecutionProps::new(), &context).unwrap();
        skip_by(&filter, &schema, zones)
    }

    /// A column whose zones are not known (a string, say) rules nothing out: a conjunction
    /// still skips by the others, a disjunction does not.
    #[test]
    fn a_column_without_zones_rules_nothing_out() {
        let (schema, mut zones) = zones();
        zones.remove("u");
        let df_schema = DFSchema::try_from(schema.as_ref().clone()).unwrap();
        let context =
            datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext::default();
        let skip = |filter: datafusion::logical_expr::Expr| {
            let filter =
                create_physical_expr(&filter, &df_schema, &ExecutionProps::new(), &context)
                    .unwrap();
            skip_by(&filter, &schema, zones.clone())
        };
        let t = col("t").lt(lit(10i64));
        let u = col("u").gt(lit(85i64));
        assert_eq!(
            skip(t.clone().and(u.clone())),
            Some(Skip {
                within: 10,
                chunks: 3
            })
        );
        assert_eq!(skip(t.or(u.clone())), None);
        assert_eq!(skip(u), None);
    }

    #[test]
    fn the_pass_stops_after_the_last_chunk_that_may_pass() {
        let skip = |within, chunks| Some(Skip { within, chunks });
        assert_eq!(skip_for(col("t").lt(lit(25i64))), skip(30, 1));
        assert_eq!(skip_for(col("t").lt(lit(10i64))), skip(10, 3));
        assert_eq!(skip_for(col("t").lt(lit(0i64))), skip(0, 4));
        // A chunk ahead of the last one that may pass is read: only a prefix is skipped to.
        assert_eq!(
            skip_for(col("t").lt(lit(5i64)).or(col("t").eq(lit(24i64)))),
            skip(30, 1)
        );
        // The last chunk's rows are all NULL: no comparison passes there, `IS NULL` does.
        assert_eq!(skip_for(col("t").gt(lit(5i64))), skip(30, 1));
        assert_eq!(skip_for(col("t").is_null()), None);
        assert_eq!(skip_for(col("u").gt(lit(0i64))), None);
        // Both columns: `u` descends 100 → 61 across the chunks.
        assert_eq!(
            skip_for(col("t").lt(lit(25i64)).and(col("u").gt(lit(85i64)))),
            skip(20, 2)
        );
        assert_eq!(skip_for(col("u").lt(lit(0i64))), skip(0, 4));
    }
}
