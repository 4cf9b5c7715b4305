//! [`GpuTable`]: an in-memory table for GPU-resident top-k. It holds record batches as
//! DataFusion's `MemTable` does and answers every query the same way, with two differences
//! that make repeated top-k queries cheap end to end:
//!
//! - Planning does not depend on the table's size: a scan shares the table's batches (one
//!   reference count) and reports statistics computed once, where a `MemTable` scan copies its
//!   batch lists and sums every batch's sizes for each query.
//! - The device column cache knows the table by identity: its columns are cached as
//!   `(table, column)` entries, found in O(1), where a `MemTable`'s are keyed by every batch's
//!   buffers. A table's batches never change; a new `GpuTable` is a new table to the cache.
//!
//! [`GpuTable::load`] uploads columns ahead of the first query and pins them: they stay in
//! device memory, outside the budget's eviction, until the table is dropped or unpinned.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::column_cache::table_key;
use crate::input::{ColumnImage, Identity, TableInput};
use async_trait::async_trait;
use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch, make_array};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::Session;
use datafusion::catalog::TableProviderFactory;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{Statistics, project_schema};
use datafusion::datasource::listing_table_factory::ListingTableFactory;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::CreateExternalTable;
use datafusion::logical_expr::Expr;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::collect_partitioned;
use datafusion::physical_plan::coop::cooperative;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType, SchedulingType};
use datafusion::physical_plan::memory::MemoryStream;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
    SendableRecordBatchStream,
};

/// A table's batches, shared by the table and its scans.
#[derive(Debug)]
pub(crate) struct TableData {
    /// Unique in the process: what the column cache knows the table by.
    pub id: u64,
    pub schema: SchemaRef,
    pub partitions: Vec<Vec<RecordBatch>>,
    pub rows: usize,
    /// Rows of each partition.
    partition_rows: Vec<usize>,
    /// Bytes of the batches' arrays.
    bytes: usize,
    /// The non-empty batches in input order, and the position of each one's first row.
    pub batches: Vec<RecordBatch>,
    pub starts: Vec<u64>,
    /// Per column, what the generated code reads of it.
    pub columns: Vec<TableColumnData>,
}

/// One column of a [`TableData`] as the generated code reads it, worked out once: the queries
/// over the table then do nothing per batch.
#[derive(Debug)]
pub(crate) struct TableColumnData {
    /// One array per non-empty batch: the column, or a dictionary column's codes.
    pub chunks: Vec<ArrayRef>,
    /// Whether any chunk holds NULLs.
    pub nullable: bool,
    /// A dictionary column's dictionary, when every batch has the same one.
    pub dictionary: Option<ArrayRef>,
    /// A dictionary column's arrays themselves (what its prefix words are derived from).
    pub encoded: Option<Vec<ArrayRef>>,
}

impl TableColumnData {
    fn new(batches: &[RecordBatch], index: usize) -> Self {
        let mut dictionary: Option<ArrayRef> = None;
        let mut shared = true;
        let chunks: Vec<ArrayRef> = batches
            .iter()
            .map(|b| {
                let column = b.column(index);
                match column.as_any_dictionary_opt() {
                    Some(d) => {
                        match &dictionary {
                            None => dictionary = Some(Arc::clone(d.values())),
                            Some(first) => {
                                shared &= Arc::ptr_eq(first, d.values())
                                    || first.to_data() == d.values().to_data()
                            }
                        }
                        make_array(d.keys().to_data())
                    }
                    None => Arc::clone(column),
                }
            })
            .collect();
        let encoded = (batches.first())
            .is_some_and(|b| b.column(index).as_any_dictionary_opt().is_some())
            .then(|| {
                batches
                    .iter()
                    .map(|b| Arc::clone(b.column(index)))
                    .collect()
            });
        Self {
            nullable: chunks.iter().any(|c| c.null_count() > 0),
            dictionary: dictionary.filter(|_| shared),
            encoded,
            chunks,
        }
    }
}

impl TableData {
    /// Column `index` (named `name`) as a generated program's input over the whole table.
    pub(crate) fn input(&self, index: usize, name: &str) -> TableInput<'_> {
        let column = &self.columns[index];
        TableInput {
            chunks: std::borrow::Cow::Borrowed(&column.chunks),
            lookup: None,
            name: name.to_string(),
            identity: Some(Identity {
                key: table_key(self.id, index),
                // A dictionary column's chunks are its codes.
                data_type: (column.chunks.first()).map_or_else(
                    || self.schema.field(index).data_type().clone(),
                    |c| c.data_type().clone(),
                ),
                rows: self.rows,
                nullable: column.nullable,
                transient: false,
            }),
            image: Default::default(),
            encoded: None,
        }
    }

    /// Column `index` as the input of its prefix words: a dictionary column's own arrays,
    /// not its codes.
    pub(crate) fn prefix_input(&self, index: usize, name: &str) -> TableInput<'_> {
        let column = &self.columns[index];
        let Some(encoded) = &column.encoded else {
            return TableInput {
                image: ColumnImage::Prefix,
                ..self.input(index, name)
            };
        };
        let data_type = self.schema.field(index).data_type().clone();
        TableInput {
            chunks: std::borrow::Cow::Borrowed(encoded),
            lookup: None,
            name: name.to_string(),
            identity: Some(Identity {
                key: table_key(self.id, index),
                data_type,
                rows: self.rows,
                nullable: encoded.iter().any(|c| c.logical_null_count() > 0),
                transient: false,
            }),
            image: ColumnImage::Prefix,
            encoded: None,
        }
    }
}

impl Drop for TableData {
    fn drop(&mut self) {
        if let Some(device) = crate::device::gpu() {
            device.column_cache.forget_table(self.id);
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct GpuTable {
    data: Arc<TableData>,
}

impl GpuTable {
    /// A table of `partitions` (each a list of batches, read by one scan partition), whose
    /// batches all have `schema`'s columns.
    pub fn try_new(schema: SchemaRef, partitions: Vec<Vec<RecordBatch>>) -> Result<Self> {
        // Process-wide: a table's identity keys the process's column cache.
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        for batch in partitions.iter().flatten() {
            let fields = batch.schema_ref().fields().len();
            if fields != schema.fields().len() || !schema.contains(batch.schema_ref()) {
                return Err(DataFusionError::Plan(format!(
                    "GpuTable: a batch's schema {} does not match the table's {}",
                    batch.schema(),
                    schema
                )));
            }
        }
        let partition_rows: Vec<usize> = partitions
            .iter()
            .map(|p| p.iter().map(RecordBatch::num_rows).sum())
            .collect();
        let bytes = (partitions.iter().flatten())
            .map(RecordBatch::get_array_memory_size)
            .sum();
        let batches: Vec<RecordBatch> = (partitions.iter().flatten())
            .filter(|b| b.num_rows() > 0)
            .cloned()
            .collect();
        let starts = batches
            .iter()
            .scan(0u64, |next, b| {
                let start = *next;
                *next += b.num_rows() as u64;
                Some(start)
            })
            .collect();
        let columns = (0..schema.fields().len())
            .map(|c| TableColumnData::new(&batches, c))
            .collect();
        Ok(Self {
            data: Arc::new(TableData {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                schema,
                rows: partition_rows.iter().sum(),
                partitions,
                partition_rows,
                bytes,
                batches,
                starts,
                columns,
            }),
        })
    }

    /// Rows of the table.
    pub fn num_rows(&self) -> usize {
        self.data.rows
    }

    /// Uploads the named columns (the ones top-k queries filter and rank by) to the device's
    /// column cache and pins them there, so that the first query is as fast as the next (a
    /// column compared by bytes, such as strings, as the first 16 bytes of each value, what
    /// its sort key's selection reads; a string column also as its bytes, what string
    /// predicates read; a dictionary also as its codes).
    /// Returns the device bytes they take. Without a GPU, an error says so.
    pub fn load(&self, columns: &[&str]) -> Result<usize> {
        let device = crate::device::gpu()
            .ok_or_else(|| DataFusionError::Execution("GpuTable::load: no GPU".into()))?;
        let mut bytes = 0;
        for name in columns {
            let index = self.data.schema.index_of(name)?;
            let input = self.data.input(index, name);
            let data_type = self.data.schema.field(index).data_type();
            let mut images = Vec::new();
            if crate::keys::has_prefix_words(data_type) {
                images.push(ColumnImage::Prefix);
            }
            if crate::fusion::is_device_string(data_type) {
                images.push(ColumnImage::Strings);
            }
            // A dictionary's codes are what its predicates read.
            if !crate::keys::has_prefix_words(data_type)
                || matches!(data_type, DataType::Dictionary(..))
            {
                images.push(ColumnImage::Values);
            }
            for image in images {
                let input = match image {
                    ColumnImage::Prefix => self.data.prefix_input(index, name),
                    image => TableInput {
                        image,
                        ..input.clone()
                    },
                };
                bytes += crate::input::columns::pin_column(&device, &input)?;
            }
        }
        Ok(bytes)
    }

    /// Lets the table's pinned columns be evicted again (they stay cached until they are).
    pub fn unpin(&self) {
        if let Some(device) = crate::device::gpu() {
            device.column_cache.pin_table(self.data.id, false);
        }
    }
}

#[async_trait]
impl TableProvider for GpuTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.data.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(GpuTableExec::try_new(
            Arc::clone(&self.data),
            projection.cloned(),
        )?))
    }
}

/// The scan of a [`GpuTable`]: each partition's batches, projected.
#[derive(Debug)]
pub struct GpuTableExec {
    data: Arc<TableData>,
    projection: Option<Vec<usize>>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
}

impl GpuTableExec {
    fn try_new(data: Arc<TableData>, projection: Option<Vec<usize>>) -> Result<Self> {
        let schema = project_schema(&data.schema, projection.as_ref())?;
        let properties = PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(data.partitions.len().max(1)),
            EmissionType::Incremental,
            Boundedness::Bounded,
        )
        // As a memory source: otherwise DataFusion wraps the scan for cooperative scheduling.
        .with_scheduling_type(SchedulingType::Cooperative);
        Ok(Self {
            data,
            projection,
            schema,
            properties: Arc::new(properties),
        })
    }

    pub(crate) fn data(&self) -> &Arc<TableData> {
        &self.data
    }

    /// The same scan as DataFusion's in-memory source (the same batches, partitions and
    /// projection), which every DataFusion process can decode: what a cluster's workers run.
    #[cfg(feature = "cluster")]
    pub(crate) fn as_memory_scan(&self) -> Result<Arc<dyn ExecutionPlan>> {
        let data = &self.data;
        let scan = datafusion::datasource::memory::MemorySourceConfig::try_new_exec(
            &data.partitions,
            Arc::clone(&data.schema),
            self.projection.clone(),
        )?;
        Ok(scan)
    }

    /// For each output column, the table's column it is.
    pub(crate) fn columns(&self) -> Vec<usize> {
        match &self.projection {
            Some(projection) => projection.clone(),
            None => (0..self.data.schema.fields().len()).collect(),
        }
    }
}

impl DisplayAs for GpuTableExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "GpuTableExec: partitions={}, rows={}",
            self.data.partitions.len(),
            self.data.rows
        )
    }
}

impl ExecutionPlan for GpuTableExec {
    fn name(&self) -> &str {
        "GpuTableExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !children.is_empty() {
            return datafusion::common::internal_err!("GpuTableExec has no children");
        }
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let batches = match self.data.partitions.get(partition) {
            Some(batches) => batches.clone(),
            None if partition == 0 => Vec::new(),
            None => {
                return datafusion::common::internal_err!(
                    "GpuTableExec has {} partitions, asked for {partition}",
                    self.data.partitions.len()
                );
            }
        };
        Ok(Box::pin(cooperative(MemoryStream::try_new(
            batches,
            Arc::clone(&self.schema),
            self.projection.clone(),
        )?)))
    }

    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>> {
        let mut statistics = Statistics::new_unknown(&self.schema);
        let rows = match partition {
            Some(p) => self.data.partition_rows.get(p).copied().unwrap_or(0),
            None => self.data.rows,
        };
        statistics.num_rows = Precision::Exact(rows);
        if partition.is_none() {
            let share =
                self.schema.fields().len() as f64 / self.data.schema.fields().len().max(1) as f64;
            statistics.total_byte_size =
                Precision::Inexact((self.data.bytes as f64 * share) as usize);
        }
        Ok(Arc::new(statistics))
    }
}

/// `CREATE EXTERNAL TABLE name STORED AS GPU LOCATION 'path' OPTIONS ('source' 'parquet')`:
/// reads the files (Parquet, CSV or JSON, as `source` says; the other options are the
/// source format's, e.g. `'has_header' 'true'`) into a [`GpuTable`], one partition per scan
/// partition, files in order. `'pin' 'a, b'` loads and pins those columns on the GPU, where
/// there is one ([`GpuTable::load`]). The table holds the files' rows as they were when it
/// was created: a rewritten file is read again by creating the table again.
#[derive(Debug, Default)]
pub struct GpuTableFactory;

#[async_trait]
impl TableProviderFactory for GpuTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let mut options = cmd.options.clone();
        let source = options.remove("format.source").ok_or_else(|| {
            DataFusionError::Plan(
                "STORED AS GPU reads files: say which kind with OPTIONS ('source' 'parquet'), \
                 'csv' or 'json'"
                    .into(),
            )
        })?;
        let pin = options.remove("format.pin");
        let files = CreateExternalTable {
            file_type: source.to_uppercase(),
            options,
            ..cmd.clone()
        };
        let files = ListingTableFactory::new().create(state, &files).await?;
        let schema = files.schema();
        let pinned: Vec<String> = match &pin {
            Some(pin) => pin
                .split(',')
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect(),
            None => Vec::new(),
        };
        for column in &pinned {
            if schema.index_of(column).is_err() {
                return Err(DataFusionError::Plan(format!(
                    "STORED AS GPU: cannot pin '{column}': the table has no such column"
                )));
            }
        }
        let scan = files.scan(state, None, &[], None).await?;
        // The files' order, whichever partition reads faster.
        let scan = scan.with_preserve_order(true).unwrap_or(scan);
        let partitions = collect_partitioned(scan, state.task_ctx()).await?;
        let table = GpuTable::try_new(schema, partitions)?;
        if !pinned.is_empty() && crate::device::gpu().is_some() {
            let names: Vec<&str> = pinned.iter().map(String::as_str).collect();
            table.load(&names)?;
        }
        Ok(Arc::new(table))
    }
}
