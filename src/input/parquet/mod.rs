//! Parquet inputs whose columns the device column cache keeps: a scan of Parquet files that
//! hands every row of its files to the operator (no limit, no filter evaluated in the scan, no
//! partition or virtual columns) can be read as a table, like an in-memory one.
//!
//! A column's cache entry is that column of the scan's row groups, in the scan's order, keyed by
//! every file's path, size, modification time and byte range: a rewritten file misses. The
//! scan's row groups are those DataFusion's scan reads (a file range reads the row groups whose
//! first page starts inside it), so positions in the image are the streaming path's input
//! order, partition by partition, and ties resolve alike. On a miss the program's columns are
//! read from the files, all row groups at once: as their pages (read and decompressed here,
//! decoded on the device: [`ParquetInput::read_pages`]) where the device decodes them, else
//! decoded here; only the winners' rows of the output columns are read afterwards, through a
//! row selection.
//!
//! A dictionary-encoded column the program reads as codes (each row group has its own
//! dictionary) is cached as codes into one dictionary for all the row groups
//! ([`global_codes`]); that dictionary is kept in memory beside the entry
//! ([`kept_dictionary`]) for the programs' lookups. Row groups' statistics are read as the
//! zones of their chunks ([`ParquetInput::row_group_zones`]).
//!
//! Files' footers are kept in memory (keyed by the same identity), so a query whose columns
//! are resident reads nothing from the files but the winners' rows.

mod columns;
mod dictionary;
mod footers;
mod pages;
#[cfg(test)]
mod tests;

pub(crate) use columns::{ParquetColumnRows, file_column, image_type, read_missing};
pub(crate) use dictionary::{global_codes, keep_dictionary, kept_dictionary};

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::DefaultParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{
    FileScanConfig, FileSource, ParquetFileReaderFactory, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::object_store::ObjectStore;
use datafusion::parquet::arrow::ProjectionMask;
use datafusion::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection,
};
use datafusion::parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStreamBuilder};
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use futures::TryStreamExt;

use crate::device::column_cache::{CacheKey, ChunkZones, files_key};

use footers::{file_id, footer};
use pages::same_values;

/// A scan of Parquet files read as a table (see the module documentation).
pub(crate) struct ParquetInput {
    store: ObjectStoreUrl,
    /// The scan's files, partition by partition: its input order.
    files: Vec<PartitionedFile>,
    /// Each of the scan's output columns as an expression over the file schema: a column, or
    /// one computed in the scan that cannot fail on any row (evaluated on every row here).
    pub columns: Vec<Arc<dyn PhysicalExpr>>,
    file_schema: SchemaRef,
    /// A hash of the file schema (the same files read as another schema are other entries).
    schema_hash: u64,
    /// The scan's own reader factory, if it has one.
    factory: Option<Arc<dyn ParquetFileReaderFactory>>,
    /// Whether the scan skips row groups by their statistics (the session's
    /// `datafusion.execution.parquet.pruning`): the table path then may too.
    prunes: bool,
}

/// `input` as a Parquet input, when it is a Parquet scan that hands over its files' rows as
/// they are.
pub(crate) fn parquet_input(input: &Arc<dyn ExecutionPlan>) -> Option<ParquetInput> {
    let scan = input.downcast_ref::<DataSourceExec>()?;
    let config = scan.data_source().downcast_ref::<FileScanConfig>()?;
    let source = config.file_source().downcast_ref::<ParquetSource>()?;
    // A filter evaluated in the scan drops rows the operator must not see.
    if config.limit.is_some()
        || source.table_parquet_options().global.pushdown_filters
        || !config.table_partition_cols().is_empty()
    {
        return None;
    }
    let file_schema = Arc::clone(config.file_schema());
    let width = file_schema.fields().len();
    let columns = match FileSource::projection(source) {
        Some(projection) => projection
            .iter()
            .map(|p| {
                let inside = collect_columns(&p.expr).iter().all(|c| c.index() < width);
                (inside && crate::fusion::cannot_fail::arithmetic(&p.expr, &file_schema))
                    .then(|| Arc::clone(&p.expr))
            })
            .collect::<Option<Vec<_>>>()?,
        None => (0..width)
            .map(|i| Arc::new(Column::new(file_schema.field(i).name(), i)) as _)
            .collect(),
    };
    let files: Vec<PartitionedFile> = config
        .file_groups
        .iter()
        .flat_map(|g| g.files().iter().cloned())
        .collect();
    if files.iter().any(|f| !f.extensions.is_empty()) {
        return None;
    }
    let mut hasher = std::hash::DefaultHasher::new();
    for field in file_schema.fields() {
        field.name().hash(&mut hasher);
        field.data_type().hash(&mut hasher);
    }
    Some(ParquetInput {
        store: config.object_store_url.clone(),
        files,
        columns,
        file_schema,
        schema_hash: hasher.finish(),
        factory: source.parquet_file_reader_factory().cloned(),
        prunes: source.table_parquet_options().global.pruning,
    })
}

/// The row groups the scan reads, with where each starts among all of them.
pub(crate) struct RowGroupLayout {
    files: Vec<FileRows>,
    pub rows: usize,
}

impl RowGroupLayout {
    /// The row groups holding the table's first `rows` rows (whole row groups: it may hold
    /// more).
    pub fn prefix(&self, rows: usize) -> RowGroupLayout {
        let files: Vec<FileRows> = (self.files.iter())
            .map(|file| FileRows {
                file: file.file,
                metadata: Arc::clone(&file.metadata),
                groups: (file.groups.iter())
                    .filter(|&&(_, start, _)| (start as usize) < rows)
                    .copied()
                    .collect(),
            })
            .filter(|file| !file.groups.is_empty())
            .collect();
        let rows = (files.iter().flat_map(|f| &f.groups))
            .map(|&(_, _, n)| n)
            .sum();
        RowGroupLayout { files, rows }
    }
}

struct FileRows {
    /// Index into the input's files.
    file: usize,
    metadata: Arc<ParquetMetaData>,
    /// Row group, position of its first row in the table, rows.
    groups: Vec<(usize, u64, usize)>,
}

type Exprs = Vec<Arc<dyn PhysicalExpr>>;

impl ParquetInput {
    pub fn store(&self) -> &ObjectStoreUrl {
        &self.store
    }

    /// The cache key of the scan's output column `column` over its files.
    pub fn key(&self, column: usize) -> CacheKey {
        let expr = &self.columns[column];
        // A file column by its index; a computed one by its text (with the high bit set).
        let id = match expr.downcast_ref::<Column>() {
            Some(c) => c.index(),
            None => {
                let mut hasher = std::hash::DefaultHasher::new();
                expr.to_string().hash(&mut hasher);
                (hasher.finish() as usize) | (1 << (usize::BITS - 1))
            }
        };
        let files = self.files.iter().map(|f| {
            let (path, size, modified) = file_id(f);
            let mut hasher = std::hash::DefaultHasher::new();
            path.hash(&mut hasher);
            let range = f
                .range
                .as_ref()
                .map_or((0, u64::MAX), |r| (r.start as u64, r.end as u64));
            (hasher.finish(), size, modified, range)
        });
        files_key(self.schema_hash, id, files)
    }

    /// The type of the scan's output column `column`.
    pub fn data_type(&self, column: usize) -> Result<DataType> {
        self.columns[column].data_type(&self.file_schema)
    }

    /// The file columns `outputs` (scan output columns) read, in file order, and each output
    /// rewritten over a batch of those columns.
    fn plan_read(&self, outputs: &[usize]) -> Result<(Vec<usize>, Exprs)> {
        let mut read: Vec<usize> = (outputs.iter())
            .flat_map(|&o| collect_columns(&self.columns[o]))
            .map(|c| c.index())
            .collect();
        read.sort_unstable();
        read.dedup();
        let exprs = outputs
            .iter()
            .map(|&o| {
                Arc::clone(&self.columns[o])
                    .transform_down(|e| match e.downcast_ref::<Column>() {
                        Some(c) => {
                            let at = read.binary_search(&c.index()).expect("collected above");
                            Ok(Transformed::yes(Arc::new(Column::new(c.name(), at)) as _))
                        }
                        None => Ok(Transformed::no(e)),
                    })
                    .data()
            })
            .collect::<Result<_>>()?;
        Ok((read, exprs))
    }

    /// The row groups the scan reads (footers read once per file).
    pub async fn layout(&self, store: &Arc<dyn ObjectStore>) -> Result<RowGroupLayout> {
        let mut files = Vec::with_capacity(self.files.len());
        let mut next = 0u64;
        for index in 0..self.files.len() {
            let file = &self.files[index];
            let metadata = footer(self.factory.clone(), Arc::clone(store), file.clone()).await?;
            let mut groups = Vec::new();
            for (g, group) in metadata.row_groups().iter().enumerate() {
                if let Some(range) = &file.range {
                    // DataFusion's rule: the row group whose first page starts in the range.
                    let first = group.column(0);
                    let offset = first
                        .dictionary_page_offset()
                        .unwrap_or_else(|| first.data_page_offset());
                    if !range.contains(offset) {
                        continue;
                    }
                }
                let rows = usize::try_from(group.num_rows()).unwrap_or(0);
                if rows > 0 {
                    groups.push((g, next, rows));
                    next += rows as u64;
                }
            }
            files.push(FileRows {
                file: index,
                metadata,
                groups,
            });
        }
        Ok(RowGroupLayout {
            files,
            rows: next as usize,
        })
    }

    /// How `file` reads as the scan's file schema; an error where it cannot (another schema).
    fn reader_metadata(&self, rows: &FileRows) -> Result<ArrowReaderMetadata> {
        let options = ArrowReaderOptions::new().with_schema(Arc::clone(&self.file_schema));
        Ok(ArrowReaderMetadata::try_new(
            Arc::clone(&rows.metadata),
            options,
        )?)
    }

    fn reader(
        &self,
        store: &Arc<dyn ObjectStore>,
        file: usize,
    ) -> Result<Box<dyn AsyncFileReader>> {
        reader(&self.factory, store, &self.files[file])
    }

    /// The scan's output columns `outputs` over every row group of `layout`, decoded (and
    /// computed) on all cores: per output, one array per row group in the table's order.
    pub async fn read_columns(
        &self,
        store: &Arc<dyn ObjectStore>,
        layout: &RowGroupLayout,
        outputs: &[usize],
    ) -> Result<Vec<Vec<ArrayRef>>> {
        let (read, exprs) = self.plan_read(outputs)?;
        let exprs = Arc::new(exprs);
        let mut tasks = Vec::new();
        for rows in &layout.files {
            let metadata = self.reader_metadata(rows)?;
            for &(group, _, n) in &rows.groups {
                let reader = self.reader(store, rows.file)?;
                let metadata = metadata.clone();
                let mask = ProjectionMask::roots(metadata.parquet_schema(), read.iter().copied());
                let exprs = Arc::clone(&exprs);
                tasks.push(async move {
                    let stream =
                        ParquetRecordBatchStreamBuilder::new_with_metadata(reader, metadata)
                            .with_projection(mask)
                            .with_row_groups(vec![group])
                            .with_batch_size(n)
                            .build()?;
                    let schema = Arc::clone(stream.schema());
                    let batches: Vec<RecordBatch> = stream.try_collect().await?;
                    let batch = concat_batches(&schema, &batches)?;
                    (exprs.iter())
                        .map(|e| e.evaluate(&batch)?.into_array(batch.num_rows()))
                        .collect::<Result<Vec<ArrayRef>>>()
                });
            }
        }
        // One task per row group (dropped, the set aborts them).
        let mut running = tokio::task::JoinSet::new();
        for (index, task) in tasks.into_iter().enumerate() {
            running.spawn(async move { (index, task.await) });
        }
        let mut groups: Vec<Option<Vec<ArrayRef>>> = vec![None; running.len()];
        while let Some(done) = running.join_next().await {
            let (index, arrays) = done.map_err(|e| DataFusionError::External(Box::new(e)))?;
            groups[index] = Some(arrays?);
        }
        let groups: Vec<Vec<ArrayRef>> = groups.into_iter().flatten().collect();
        let rows: usize = groups
            .iter()
            .map(|g| g.first().map_or(0, |a| a.len()))
            .sum();
        if rows != layout.rows {
            return Err(DataFusionError::Execution(format!(
                "read {rows} rows of the files' {}",
                layout.rows
            )));
        }
        (0..outputs.len())
            .map(|o| {
                let data_type = self.data_type(outputs[o])?;
                groups
                    .iter()
                    .map(|arrays| {
                        let array = Arc::clone(&arrays[o]);
                        if array.data_type() != &data_type {
                            return Err(DataFusionError::Execution(format!(
                                "column {} read as {}, not {data_type}",
                                self.columns[outputs[o]],
                                array.data_type(),
                            )));
                        }
                        Ok(array)
                    })
                    .collect()
            })
            .collect()
    }

    /// The least and greatest values and the NULLs of the scan's output column `output` in
    /// each row group of `layout`, from the files' statistics, as the column cache keeps its
    /// chunks' zones: `None` where the scan does not prune by statistics, the column is
    /// computed in the scan, its type has no zones (floats: the statistics leave NaNs out), or
    /// a file does not read as the scan's schema. A row group without statistics has NULL
    /// zones, which rule nothing out.
    pub fn row_group_zones(&self, layout: &RowGroupLayout, output: usize) -> Option<ChunkZones> {
        use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
        let column = self.columns.get(output)?.downcast_ref::<Column>()?;
        let field = self.file_schema.field(column.index());
        if !self.prunes || !crate::input::zones::has_zones(field.data_type()) {
            return None;
        }
        let (mut mins, mut maxs, mut nulls) = (Vec::new(), Vec::new(), Vec::new());
        for rows in &layout.files {
            self.reader_metadata(rows).ok()?;
            // Statistics hold the file's own values: the column must read as them (not, say,
            // as timestamps of another unit).
            let natural = ArrowReaderMetadata::try_new(
                Arc::clone(&rows.metadata),
                ArrowReaderOptions::new().with_skip_arrow_metadata(true),
            )
            .ok()?;
            let natural = natural.schema().field_with_name(field.name()).ok()?;
            if !same_values(natural.data_type(), field.data_type()) {
                return None;
            }
            let converter = StatisticsConverter::try_new(
                field.name(),
                &self.file_schema,
                rows.metadata.file_metadata().schema_descr(),
            )
            .ok()?;
            let groups = || (rows.groups.iter()).map(|&(g, _, _)| rows.metadata.row_group(g));
            mins.push(converter.row_group_mins(groups()).ok()?);
            maxs.push(converter.row_group_maxes(groups()).ok()?);
            nulls.push(Arc::new(converter.row_group_null_counts(groups()).ok()?) as ArrayRef);
        }
        let concat = |arrays: &[ArrayRef]| {
            let arrays: Vec<&dyn datafusion::arrow::array::Array> =
                arrays.iter().map(|a| a.as_ref()).collect();
            datafusion::arrow::compute::concat(&arrays).ok()
        };
        let rows = (layout.files.iter().flat_map(|f| &f.groups)).map(|&(_, _, n)| n as u64);
        Some(ChunkZones {
            mins: concat(&mins)?,
            maxs: concat(&maxs)?,
            nulls: concat(&nulls)?,
            rows: Arc::new(datafusion::arrow::array::UInt64Array::from_iter_values(
                rows,
            )),
        })
    }

    /// The rows at table `positions` of the scan's output columns `outputs`: one batch per
    /// file holding winners (its columns in `outputs`' order), and for each position its batch
    /// and row there (as `interleave` takes them).
    pub async fn read_rows(
        &self,
        store: &Arc<dyn ObjectStore>,
        layout: &RowGroupLayout,
        positions: &[u64],
        outputs: &[usize],
    ) -> Result<(Vec<Vec<ArrayRef>>, Vec<(usize, usize)>)> {
        // Each position's file and (row group, row).
        let mut starts = Vec::new();
        for (f, rows) in layout.files.iter().enumerate() {
            for (g, &(_, start, _)) in rows.groups.iter().enumerate() {
                starts.push((start, f, g));
            }
        }
        // The winners' rows of each row group holding any, by (file, row group).
        let mut wanted: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
        let mut located = Vec::with_capacity(positions.len());
        for &p in positions {
            let i = starts.partition_point(|&(s, _, _)| s <= p);
            let Some(&(start, f, g)) = i.checked_sub(1).map(|i| &starts[i]) else {
                return Err(DataFusionError::Internal(format!(
                    "winning position {p} is outside the files"
                )));
            };
            let row = (p - start) as usize;
            wanted.entry((f, g)).or_default().push(row);
            located.push(((f, g), row));
        }
        let (read, exprs) = self.plan_read(outputs)?;
        let exprs = Arc::new(exprs);
        // One task per row group (dropped, the set aborts them): each reads only the pages
        // holding its winners.
        let mut running = tokio::task::JoinSet::new();
        let mut slots = HashMap::with_capacity(wanted.len());
        for (slot, ((f, g), mut rows)) in wanted.into_iter().enumerate() {
            rows.sort_unstable();
            rows.dedup();
            let file = &layout.files[f];
            let (group, _, n) = file.groups[g];
            let ranges = rows.iter().map(|&row| row..row + 1);
            let selection = RowSelection::from_consecutive_ranges(ranges, n);
            let metadata = self.reader_metadata(file)?;
            let mask = ProjectionMask::roots(metadata.parquet_schema(), read.iter().copied());
            let builder = ParquetRecordBatchStreamBuilder::new_with_metadata(
                self.reader(store, file.file)?,
                metadata,
            )
            .with_projection(mask)
            .with_row_groups(vec![group])
            .with_row_selection(selection)
            .with_batch_size(rows.len());
            let (count, exprs) = (rows.len(), Arc::clone(&exprs));
            running.spawn(async move {
                let stream = builder.build()?;
                let schema = Arc::clone(stream.schema());
                let batches: Vec<RecordBatch> = stream.try_collect().await?;
                let batch = concat_batches(&schema, &batches)?;
                if batch.num_rows() != count {
                    return Err(DataFusionError::Internal(format!(
                        "read {} of the {count} winning rows of a row group",
                        batch.num_rows(),
                    )));
                }
                let arrays = (exprs.iter())
                    .map(|e| e.evaluate(&batch)?.into_array(count))
                    .collect::<Result<Vec<ArrayRef>>>()?;
                Ok((slot, arrays))
            });
            slots.insert((f, g), (slot, rows));
        }
        let mut batches = vec![Vec::new(); slots.len()];
        while let Some(done) = running.join_next().await {
            let (slot, arrays) = done.map_err(|e| DataFusionError::External(Box::new(e)))??;
            batches[slot] = arrays;
        }
        let at = located
            .into_iter()
            .map(|(group, row)| {
                let (slot, rows) = &slots[&group];
                let index = rows.binary_search(&row).expect("every winner was read");
                (*slot, index)
            })
            .collect();
        Ok((batches, at))
    }
}

/// A reader of `file` from the scan's reader factory, or DataFusion's default one.
fn reader(
    factory: &Option<Arc<dyn ParquetFileReaderFactory>>,
    store: &Arc<dyn ObjectStore>,
    file: &PartitionedFile,
) -> Result<Box<dyn AsyncFileReader>> {
    let metrics = ExecutionPlanMetricsSet::new();
    let reader = match factory {
        Some(factory) => factory.create_reader(0, file.clone(), None, &metrics)?,
        None => DefaultParquetFileReaderFactory::new(Arc::clone(store)).create_reader(
            0,
            file.clone(),
            None,
            &metrics,
        )?,
    };
    Ok(reader)
}
