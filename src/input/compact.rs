//! In-memory tables rewritten into large batches: [`CompactTables`].
//!
//! A `MemTable` made by `CREATE TABLE … AS`, grown by `INSERT INTO` or registered from record
//! batches holds its rows as the batches that made it: thousands of them for a large table
//! (`datafusion.execution.batch_size` rows each). Everything the operator does once per batch
//! then runs thousands of times per query: DataFusion's scan copies the batch lists and sums
//! their sizes, the column cache keys a column by every batch's buffers, the plan cache
//! compares them. Merging runs of small batches into large ones once, the first time a query
//! reads them, leaves a few batches per partition for every later query to walk, and the same
//! ones each time, so the column cache and the plan cache find them again.
//!
//! The rewrite keeps what a table is to DataFusion: its partitions, and in each its rows in
//! their order (batch, then row), which is the order the operator breaks ties by. Only the
//! batch boundaries move. Rows appended later (`INSERT INTO`) are new batches, which change
//! the table's buffers and so its keys in both caches; the next query merges them in turn.

use std::sync::Arc;

use datafusion::arrow::array::{Array, RecordBatch};
use datafusion::arrow::compute::concat_batches;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::{MemTable, source_as_provider};
use datafusion::error::Result;
use datafusion::logical_expr::LogicalPlan;
use datafusion::optimizer::AnalyzerRule;

use crate::config::GpuTopKConfig;

/// Most rows of a merged batch: few enough batches that a query's walks over them cost next to
/// nothing, small enough that chunk zones (one per batch) still skip parts of a table and that
/// DataFusion's own operators still stream them.
pub(crate) const TARGET_ROWS: usize = 1 << 17;

/// Most bytes of a merged batch (its arrays' buffers): well inside the 32-bit offsets of a
/// string column, and a bounded copy per batch.
pub(crate) const TARGET_BYTES: usize = 1 << 28;

/// The analyzer rule that merges the small batches of every `MemTable` a query scans
/// (`gpu_topk.compact_tables`), before DataFusion plans the scans. It changes no plan.
#[derive(Debug, Default)]
pub(crate) struct CompactTables;

impl CompactTables {
    pub const NAME: &'static str = "gpu_topk_compact_tables";
}

impl AnalyzerRule for CompactTables {
    fn analyze(&self, plan: LogicalPlan, config: &ConfigOptions) -> Result<LogicalPlan> {
        let on = (config.extensions.get::<GpuTopKConfig>())
            .is_some_and(|c| c.enabled && c.compact_tables);
        if on {
            for table in scanned_memory_tables(&plan) {
                if let Some(table) = table.downcast_ref::<MemTable>() {
                    compact_table(table);
                }
            }
        }
        Ok(plan)
    }

    fn name(&self) -> &str {
        Self::NAME
    }
}

/// The `MemTable`s `plan` scans, its subqueries' included.
fn scanned_memory_tables(plan: &LogicalPlan) -> Vec<Arc<dyn datafusion::catalog::TableProvider>> {
    let mut tables = Vec::new();
    // The walk itself cannot fail: its closure returns no error.
    let _ = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && let Ok(provider) = source_as_provider(&scan.source)
            && provider.downcast_ref::<MemTable>().is_some()
        {
            tables.push(provider);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    tables
}

/// Merges the runs of small batches in each of `table`'s partitions, in place; returns the
/// number of partitions rewritten. A partition being read or written right now is left to a
/// later query. Partitions are rewritten on the host's cores at once.
pub(crate) fn compact_table(table: &MemTable) -> usize {
    let mut locked: Vec<_> = (table.batches.iter())
        .filter_map(|partition| partition.try_write().ok())
        .filter(|batches| needs_compacting(batches))
        .collect();
    let partitions: Vec<&mut Vec<RecordBatch>> = locked.iter_mut().map(|g| &mut **g).collect();
    let count = partitions.len();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if count <= 1 || threads <= 1 {
        partitions.into_iter().for_each(compact_partition);
        return count;
    }
    let mut shares: Vec<Vec<&mut Vec<RecordBatch>>> =
        (0..threads.min(count)).map(|_| Vec::new()).collect();
    let n = shares.len();
    for (i, partition) in partitions.into_iter().enumerate() {
        shares[i % n].push(partition);
    }
    std::thread::scope(|scope| {
        for share in shares {
            scope.spawn(move || share.into_iter().for_each(compact_partition));
        }
    });
    count
}

/// Bytes of a batch's rows (a slice of larger arrays counts only its own part).
fn batch_bytes(batch: &RecordBatch) -> usize {
    (batch.columns().iter())
        .map(|c| {
            let data = c.to_data();
            data.get_slice_memory_size()
                .unwrap_or_else(|_| c.get_array_memory_size())
        })
        .sum()
}

/// Whether two neighbouring batches fit in one merged batch.
fn fit(a: (usize, usize), b: (usize, usize), same_schema: bool) -> bool {
    same_schema && a.0 + b.0 <= TARGET_ROWS && a.1 + b.1 <= TARGET_BYTES
}

/// Whether a partition has an empty batch, or two neighbours that fit in one.
pub(crate) fn needs_compacting(batches: &[RecordBatch]) -> bool {
    if batches.len() < 2 {
        return false;
    }
    if batches.iter().any(|b| b.num_rows() == 0) {
        return true;
    }
    // Only pairs small enough by rows are measured in bytes.
    batches.windows(2).any(|w| {
        w[0].num_rows() + w[1].num_rows() <= TARGET_ROWS
            && fit(
                (w[0].num_rows(), batch_bytes(&w[0])),
                (w[1].num_rows(), batch_bytes(&w[1])),
                w[0].schema_ref() == w[1].schema_ref(),
            )
    })
}

/// Merges a partition's runs of neighbouring batches that fit together (empty ones dropped);
/// a batch that fits with no neighbour stays as it is, its buffers untouched.
pub(crate) fn compact_partition(batches: &mut Vec<RecordBatch>) {
    let old = std::mem::take(batches);
    let mut out = Vec::with_capacity(old.len().min(64));
    let mut run: Vec<RecordBatch> = Vec::new();
    let mut size = (0usize, 0usize);
    let flush = |run: &mut Vec<RecordBatch>, out: &mut Vec<RecordBatch>| {
        match run.len() {
            0 => {}
            1 => out.append(run),
            _ => match concat_batches(run[0].schema_ref(), run.iter()) {
                Ok(merged) => {
                    out.push(merged);
                    run.clear();
                }
                // Batches that do not concatenate stay as they were.
                Err(_) => out.append(run),
            },
        }
    };
    for batch in old {
        if batch.num_rows() == 0 {
            continue;
        }
        let this = (batch.num_rows(), batch_bytes(&batch));
        let same = run
            .first()
            .is_none_or(|r| r.schema_ref() == batch.schema_ref());
        if !run.is_empty() && !fit(size, this, same) {
            flush(&mut run, &mut out);
            size = (0, 0);
        }
        size = (size.0 + this.0, size.1 + this.1);
        run.push(batch);
    }
    flush(&mut run, &mut out);
    *batches = out;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};

    use super::{TARGET_ROWS, compact_partition, needs_compacting};

    fn batch(schema: &Arc<Schema>, start: i64, rows: usize) -> RecordBatch {
        let ids: Vec<i64> = (start..start + rows as i64).collect();
        let names: Vec<Option<String>> = (ids.iter())
            .map(|i| (i % 5 != 0).then(|| format!("n{i}")))
            .collect();
        RecordBatch::try_new(
            Arc::clone(schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(StringArray::from(names)),
            ],
        )
        .unwrap()
    }

    /// Runs of small batches, empty ones among them, become few batches holding the same rows
    /// in the same order; a batch that fits with no neighbour keeps its buffers; a second
    /// pass finds nothing to do.
    #[test]
    fn merges_runs_keeping_rows_and_order() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]));
        let sizes = [1, 7, 0, 8192, 3, TARGET_ROWS, 0, 5, 1, TARGET_ROWS - 2, 2];
        let mut batches = Vec::new();
        let mut next = 0i64;
        for rows in sizes {
            batches.push(batch(&schema, next, rows));
            next += rows as i64;
        }
        let big = batches[5].column(0).to_data().buffers()[0].as_ptr();
        let before = datafusion::arrow::compute::concat_batches(&schema, &batches).unwrap();
        assert!(needs_compacting(&batches));
        compact_partition(&mut batches);
        let rows: Vec<usize> = batches.iter().map(RecordBatch::num_rows).collect();
        assert_eq!(
            rows,
            [1 + 7 + 8192 + 3, TARGET_ROWS, 5 + 1, TARGET_ROWS - 2 + 2]
        );
        assert_eq!(batches[1].column(0).to_data().buffers()[0].as_ptr(), big);
        let after = datafusion::arrow::compute::concat_batches(&schema, &batches).unwrap();
        assert_eq!(before, after);
        assert!(!needs_compacting(&batches));
        let kept: Vec<_> = batches.iter().map(|b| b.column(0).to_data()).collect();
        compact_partition(&mut batches);
        let again: Vec<_> = batches.iter().map(|b| b.column(0).to_data()).collect();
        assert!(kept.iter().zip(&again).all(|(a, b)| a.ptr_eq(b)));
    }
}
