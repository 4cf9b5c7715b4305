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

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, LazyLock, Mutex};

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
use datafusion::parquet::basic::{Encoding, Type as PhysicalType};
use datafusion::parquet::column::page::{Page, PageReader};
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::metadata::{ColumnChunkMetaData, PageIndexPolicy, ParquetMetaData};
use datafusion::parquet::file::reader::{ChunkReader, Length};
use datafusion::parquet::file::serialized_reader::SerializedPageReader;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use futures::TryStreamExt;

use crate::device::column_cache::{CacheKey, ChunkZones, files_key};
use crate::device::{EncodedChunk, EncodedColumn, EncodedPage};

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
                (inside && super::cannot_fail::arithmetic(&p.expr, &file_schema))
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
pub(crate) struct Layout {
    files: Vec<FileRows>,
    pub rows: usize,
}

impl Layout {
    /// The row groups holding the table's first `rows` rows (whole row groups: it may hold
    /// more).
    pub fn prefix(&self, rows: usize) -> Layout {
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
        Layout { files, rows }
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

/// Files' footers by identity (path, size, modification time).
type FileId = (String, u64, i64);
static FOOTERS: LazyLock<Mutex<HashMap<FileId, Arc<ParquetMetaData>>>> =
    LazyLock::new(Default::default);
/// Footers kept at most (a new one past this starts the map afresh).
const MAX_FOOTERS: usize = 4096;

fn file_id(file: &PartitionedFile) -> FileId {
    let meta = &file.object_meta;
    let modified = meta.last_modified.timestamp_nanos_opt().unwrap_or(i64::MIN);
    (meta.location.to_string(), meta.size, modified)
}

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
    pub async fn layout(&self, store: &Arc<dyn ObjectStore>) -> Result<Layout> {
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
        Ok(Layout {
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
        layout: &Layout,
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

    /// Whether the scan's output column `output` may be read as pages for the device to
    /// decode (a file column of a type it decodes; its files' encodings are known once read).
    pub fn may_read_pages(&self, output: usize) -> bool {
        use DataType::*;
        let Some(column) = self
            .columns
            .get(output)
            .and_then(|c| c.downcast_ref::<Column>())
        else {
            return false;
        };
        matches!(
            self.file_schema.field(column.index()).data_type(),
            Int8 | Int16
                | Int32
                | Int64
                | UInt8
                | UInt16
                | UInt32
                | UInt64
                | Float32
                | Float64
                | Date32
                | Timestamp(..)
        )
    }

    /// The least and greatest values and the NULLs of the scan's output column `output` in
    /// each row group of `layout`, from the files' statistics, as the column cache keeps its
    /// chunks' zones: `None` where the scan does not prune by statistics, the column is
    /// computed in the scan, its type has no zones (floats: the statistics leave NaNs out), or
    /// a file does not read as the scan's schema. A row group without statistics has NULL
    /// zones, which rule nothing out.
    pub fn row_group_zones(&self, layout: &Layout, output: usize) -> Option<ChunkZones> {
        use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
        let column = self.columns.get(output)?.downcast_ref::<Column>()?;
        let field = self.file_schema.field(column.index());
        if !self.prunes || !crate::select::table::has_zones(field.data_type()) {
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

    /// The scan's output column `output` over every row group of `layout` as its pages, to be
    /// decoded on the device: `None` where it cannot be (a computed column, a type or encoding
    /// the device does not decode, a nested schema). The host reads the column chunks and
    /// decompresses their pages on all cores, one task per row group; with `streaming` the
    /// column is returned at once and its chunks follow as they are read (the tasks run on
    /// the runtime meanwhile), else once all are read.
    pub async fn read_pages(
        &self,
        store: &Arc<dyn ObjectStore>,
        layout: &Layout,
        output: usize,
        streaming: bool,
    ) -> Result<Option<EncodedColumn>> {
        let Some(column) = self.columns[output].downcast_ref::<Column>() else {
            return Ok(None);
        };
        let c = column.index();
        let data_type = self.file_schema.field(c).data_type().clone();
        let mut widths = None;
        let (mut nullable, mut page_bytes) = (false, 0usize);
        let mut tasks = Vec::new();
        for rows in &layout.files {
            // Files the scan's schema cannot read are read by the scan, with its errors.
            self.reader_metadata(rows)?;
            // A flat schema whose leaf `c` is the field, read as the field's own type.
            let schema = rows.metadata.file_metadata().schema_descr();
            if schema.num_columns() != self.file_schema.fields().len() {
                return Ok(None);
            }
            let leaf = schema.column(c);
            let natural = ArrowReaderMetadata::try_new(
                Arc::clone(&rows.metadata),
                ArrowReaderOptions::new().with_skip_arrow_metadata(true),
            )?;
            let natural = natural.schema().fields().get(c).map(|f| f.data_type());
            if leaf.max_rep_level() != 0
                || leaf.max_def_level() > 1
                || leaf.path().parts().len() != 1
                || !natural.is_some_and(|n| same_values(n, &data_type))
            {
                return Ok(None);
            }
            let Some(these) = page_widths(&data_type, leaf.physical_type()) else {
                return Ok(None);
            };
            if widths.is_some_and(|w| w != these) {
                return Ok(None);
            }
            widths = Some(these);
            for &(group, first_row, n) in &rows.groups {
                let meta = rows.metadata.row_group(group).column(c).clone();
                // The chunk's encodings, by its metadata: those the device decodes.
                let decodes = meta.encodings().all(|e| {
                    matches!(
                        e,
                        Encoding::PLAIN
                            | Encoding::RLE
                            | Encoding::RLE_DICTIONARY
                            | Encoding::PLAIN_DICTIONARY
                    )
                });
                if !decodes {
                    return Ok(None);
                }
                nullable |= leaf.max_def_level() > 0
                    && meta.statistics().and_then(|s| s.null_count_opt()) != Some(0);
                page_bytes += usize::try_from(meta.uncompressed_size()).unwrap_or(0);
                let mut reader = self.reader(store, rows.file)?;
                let file_len = self.files[rows.file].object_meta.size;
                let stored = these.0;
                tasks.push(async move {
                    let (start, len) = meta.byte_range();
                    let bytes = reader.get_bytes(start..start + len).await?;
                    let chunk = ChunkBytes {
                        start,
                        bytes,
                        file_len,
                    };
                    // Decompression is the host's work: off the runtime's threads.
                    tokio::task::spawn_blocking(move || {
                        chunk_pages(chunk, &meta, n, first_row, stored)
                    })
                    .await
                    .map_err(|e| DataFusionError::External(Box::new(e)))?
                });
            }
        }
        let Some(widths) = widths else {
            return Ok(None);
        };
        let count = tasks.len();
        let (send, receive) = std::sync::mpsc::channel();
        let column = EncodedColumn::new(receive, count, layout.rows, widths, nullable, page_bytes);
        let sent = |chunk: Result<Option<EncodedChunk>>| match chunk {
            Ok(Some(chunk)) => Ok(chunk),
            Ok(None) => Err("a page in an encoding the device does not decode".to_string()),
            Err(e) => Err(e.to_string()),
        };
        if streaming {
            // Each task sends its chunk; once the column is dropped, a send fails and the
            // remaining tasks end after their read.
            for task in tasks {
                let send = send.clone();
                tokio::spawn(async move {
                    let _ = send.send(sent(task.await));
                });
            }
            return Ok(Some(column));
        }
        let mut running = tokio::task::JoinSet::new();
        for task in tasks {
            running.spawn(task);
        }
        while let Some(done) = running.join_next().await {
            let chunk = done.map_err(|e| DataFusionError::External(Box::new(e)))?;
            match chunk? {
                Some(chunk) => send.send(Ok(chunk)).expect("the receiver is held here"),
                None => return Ok(None),
            }
        }
        Ok(Some(column))
    }

    /// The rows at table `positions` of the scan's output columns `outputs`: one batch per
    /// file holding winners (its columns in `outputs`' order), and for each position its batch
    /// and row there (as `interleave` takes them).
    pub async fn read_rows(
        &self,
        store: &Arc<dyn ObjectStore>,
        layout: &Layout,
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

/// The dictionaries of dictionary-encoded columns whose codes the column cache holds, by the
/// codes' cache key: a query reading the codes looks its entries up in them.
static DICTIONARIES: LazyLock<Mutex<HashMap<CacheKey, ArrayRef>>> = LazyLock::new(Default::default);
/// Dictionaries kept at most (a new one past this starts the map afresh).
const MAX_DICTIONARIES: usize = 1024;

/// Keeps `values`, the dictionary of the codes cached under `key`.
pub(crate) fn keep_dictionary(key: &CacheKey, values: ArrayRef) {
    if let Ok(mut kept) = DICTIONARIES.lock() {
        if kept.len() >= MAX_DICTIONARIES {
            kept.clear();
        }
        kept.insert(key.clone(), values);
    }
}

/// The dictionary of the codes cached under `key`, if kept.
pub(crate) fn kept_dictionary(key: &CacheKey) -> Option<ArrayRef> {
    DICTIONARIES.lock().ok()?.get(key).cloned()
}

/// A dictionary-encoded string column's row groups (each with its own dictionary) as codes
/// into one dictionary for all of them: each chunk's keys renumbered (their type and NULLs
/// kept), and the dictionary, its entries in the order they first appear in the row groups'
/// dictionaries (so reading the same files again numbers them alike). An error where the
/// chunks are not string dictionaries or the entries outnumber the key type.
pub(crate) fn global_codes(chunks: &[ArrayRef]) -> Result<(Vec<ArrayRef>, ArrayRef)> {
    use datafusion::arrow::array::{Array, AsArray, PrimitiveArray, StringArray};
    use datafusion::arrow::datatypes::{
        ArrowDictionaryKeyType, ArrowNativeType, Int8Type, Int16Type, Int32Type, Int64Type,
        UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    /// `chunk`'s keys as the codes `table` gives its entries.
    fn renumber<K: ArrowDictionaryKeyType>(chunk: &ArrayRef, table: &[usize]) -> Result<ArrayRef> {
        let keys = chunk.as_dictionary::<K>().keys();
        let codes: Vec<K::Native> = (table.iter())
            .map(|&code| K::Native::from_usize(code))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                DataFusionError::Execution(format!(
                    "{} dictionary entries do not fit {} keys",
                    table.iter().max().map_or(0, |m| m + 1),
                    K::DATA_TYPE
                ))
            })?;
        let renumbered: PrimitiveArray<K> =
            keys.unary_opt(|k| k.to_usize().and_then(|k| codes.get(k).copied()));
        if renumbered.null_count() != keys.null_count() {
            return Err(DataFusionError::Execution(
                "a dictionary key outside its dictionary".into(),
            ));
        }
        Ok(Arc::new(renumbered))
    }
    // Each row group's entries numbered in the order they first appear (dictionaries are
    // small), then every row's key renumbered, the row groups spread over the cores.
    let (mut entries, mut order) = (HashMap::new(), Vec::new());
    let mut tables = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        let Some(dictionary) = chunk.as_any_dictionary_opt() else {
            return Err(DataFusionError::Execution(format!(
                "codes of a {} column",
                chunk.data_type()
            )));
        };
        let values = datafusion::arrow::compute::cast(dictionary.values(), &DataType::Utf8)?;
        let table: Vec<usize> = (values.as_string::<i32>().iter())
            .map(|entry| {
                let next = order.len();
                *entries.entry(entry.map(str::to_string)).or_insert_with(|| {
                    order.push(entry.map(str::to_string));
                    next
                })
            })
            .collect();
        tables.push(table);
    }
    let work: Vec<(&ArrayRef, Vec<usize>)> = chunks.iter().zip(tables).collect();
    let codes = crate::select::table::on_cores(work, |(chunk, table)| {
        let DataType::Dictionary(key, _) = chunk.data_type() else {
            unreachable!("checked above");
        };
        let renumbered = match key.as_ref() {
            DataType::Int8 => renumber::<Int8Type>(chunk, &table),
            DataType::Int16 => renumber::<Int16Type>(chunk, &table),
            DataType::Int32 => renumber::<Int32Type>(chunk, &table),
            DataType::Int64 => renumber::<Int64Type>(chunk, &table),
            DataType::UInt8 => renumber::<UInt8Type>(chunk, &table),
            DataType::UInt16 => renumber::<UInt16Type>(chunk, &table),
            DataType::UInt32 => renumber::<UInt32Type>(chunk, &table),
            DataType::UInt64 => renumber::<UInt64Type>(chunk, &table),
            other => Err(DataFusionError::Execution(format!(
                "{other} dictionary keys"
            ))),
        };
        renumbered.map_err(|e| crate::device::GpuError(e.to_string()))
    })
    .map_err(|e| DataFusionError::Execution(e.0))?;
    let values: StringArray = order.into_iter().collect();
    Ok((codes, Arc::new(values)))
}

/// How a column of a flat Parquet schema is shipped as pages: its leaf's physical value width
/// and its image's, where the reader's Arrow type is those values as they are (or truncated).
fn page_widths(data_type: &DataType, physical: PhysicalType) -> Option<(usize, usize)> {
    use DataType::*;
    let width = match (data_type, physical) {
        (Int8 | UInt8, PhysicalType::INT32) => 1,
        (Int16 | UInt16, PhysicalType::INT32) => 2,
        (Int32 | UInt32 | Date32, PhysicalType::INT32) | (Float32, PhysicalType::FLOAT) => 4,
        (Int64 | UInt64 | Timestamp(..), PhysicalType::INT64) | (Float64, PhysicalType::DOUBLE) => {
            8
        }
        _ => return None,
    };
    let stored = match physical {
        PhysicalType::INT32 | PhysicalType::FLOAT => 4,
        _ => 8,
    };
    Some((stored, width))
}

/// Whether a leaf that reads as `natural` by its Parquet types alone holds the values of
/// `data_type` bit for bit: the same type, or timestamps of one unit both with or both without
/// a time zone (the zone only names how UTC instants display).
fn same_values(natural: &DataType, data_type: &DataType) -> bool {
    match (natural, data_type) {
        (DataType::Timestamp(a, a_zone), DataType::Timestamp(b, b_zone)) => {
            a == b && a_zone.is_some() == b_zone.is_some()
        }
        (a, b) => a == b,
    }
}

/// A column chunk's bytes, read at the file offsets its metadata gives.
struct ChunkBytes {
    start: u64,
    bytes: bytes::Bytes,
    file_len: u64,
}

impl Length for ChunkBytes {
    fn len(&self) -> u64 {
        self.file_len
    }
}

impl ChunkReader for ChunkBytes {
    type T = bytes::buf::Reader<bytes::Bytes>;

    fn get_read(&self, start: u64) -> datafusion::parquet::errors::Result<Self::T> {
        use bytes::Buf;
        Ok(self.get_bytes(start, 0)?.reader())
    }

    fn get_bytes(
        &self,
        start: u64,
        length: usize,
    ) -> datafusion::parquet::errors::Result<bytes::Bytes> {
        let from = (start.checked_sub(self.start))
            .map(|at| at as usize)
            .filter(|&at| at <= self.bytes.len())
            .ok_or_else(|| {
                ParquetError::General(format!("offset {start} outside the column chunk"))
            })?;
        // A length of 0 reads to the chunk's end (for `get_read`).
        let to = if length == 0 {
            self.bytes.len()
        } else {
            from + length
        };
        if to > self.bytes.len() {
            return Err(ParquetError::General(format!(
                "{length} bytes at {start} run past the column chunk"
            )));
        }
        Ok(self.bytes.slice(from..to))
    }
}

/// A column chunk's pages as stored, decompressed; `None` where one of them is not in an
/// encoding the device decodes.
fn chunk_pages(
    chunk: ChunkBytes,
    column: &ColumnChunkMetaData,
    rows: usize,
    first_row: u64,
    stored_width: usize,
) -> Result<Option<EncodedChunk>> {
    let levels = column.column_descr().max_def_level() > 0;
    let mut reader = SerializedPageReader::new(Arc::new(chunk), column, rows, None)?;
    let mut encoded = EncodedChunk::default();
    let mut row = first_row;
    let range = |from: usize, to: usize| -> Result<std::ops::Range<u32>> {
        match (u32::try_from(from), u32::try_from(to)) {
            (Ok(from), Ok(to)) if from <= to => Ok(from..to),
            _ => Err(DataFusionError::Execution(format!(
                "a page range {from}..{to}"
            ))),
        }
    };
    while let Some(page) = reader.get_next_page()? {
        let (buf, values, encoding, level_bytes) = match page {
            Page::DictionaryPage {
                buf,
                num_values,
                encoding,
                ..
            } => {
                let plain = matches!(encoding, Encoding::PLAIN | Encoding::PLAIN_DICTIONARY);
                if !plain || buf.len() < num_values as usize * stored_width {
                    return Ok(None);
                }
                encoded.dictionary = Some((buf, u64::from(num_values)));
                continue;
            }
            Page::DataPage {
                buf,
                num_values,
                encoding,
                def_level_encoding,
                ..
            } => {
                let level_bytes = match levels {
                    false => None,
                    true if def_level_encoding != Encoding::RLE || buf.len() < 4 => {
                        return Ok(None);
                    }
                    // v1 levels: a 4-byte length, then the runs.
                    true => {
                        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
                        Some((4, 4 + len as usize))
                    }
                };
                (buf, num_values, encoding, level_bytes)
            }
            Page::DataPageV2 {
                buf,
                num_values,
                encoding,
                num_nulls,
                def_levels_byte_len,
                rep_levels_byte_len,
                ..
            } => {
                let def = def_levels_byte_len as usize;
                if rep_levels_byte_len != 0 || (!levels && def > 0) || (def == 0 && num_nulls > 0) {
                    return Ok(None);
                }
                (buf, num_values, encoding, (def > 0).then_some((0, def)))
            }
        };
        let dictionary = match encoding {
            Encoding::PLAIN => false,
            Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY => true,
            _ => return Ok(None),
        };
        let (levels_at, values_at) = match level_bytes {
            Some((from, to)) if to <= buf.len() => (range(from, to)?, to),
            Some(_) => return Ok(None),
            None => (0..0, 0),
        };
        encoded.pages.push(EncodedPage {
            values: range(values_at, buf.len())?,
            levels: levels_at,
            bytes: buf,
            first_row: row,
            rows: values,
            dictionary,
        });
        row += u64::from(values);
    }
    if row != first_row + rows as u64 {
        return Err(DataFusionError::Execution(format!(
            "a column chunk's pages hold {} of its {rows} rows",
            row - first_row
        )));
    }
    Ok(Some(encoded))
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

/// The footer of `file`, read once per file identity.
async fn footer(
    factory: Option<Arc<dyn ParquetFileReaderFactory>>,
    store: Arc<dyn ObjectStore>,
    file: PartitionedFile,
) -> Result<Arc<ParquetMetaData>> {
    let id = file_id(&file);
    let known = match FOOTERS.lock() {
        Ok(footers) => footers.get(&id).cloned(),
        Err(_) => None,
    };
    if let Some(known) = known {
        return Ok(known);
    }
    let mut reader = reader(&factory, &store, &file)?;
    // With the page index, a row selection reads only the pages holding the winners.
    let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
    let read = ArrowReaderMetadata::load_async(&mut reader, options).await?;
    let metadata = Arc::clone(read.metadata());
    if let Ok(mut footers) = FOOTERS.lock() {
        if footers.len() >= MAX_FOOTERS {
            footers.clear();
        }
        footers.insert(id, Arc::clone(&metadata));
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Float64Array, Int64Array, UInt64Array};
    use datafusion::arrow::compute::take_record_batch;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    use datafusion::physical_plan::{collect_partitioned, displayable};
    use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

    use super::*;

    /// The Parquet input of `sql`'s plan (a bare scan), its store and its layout.
    async fn scanned(
        ctx: &SessionContext,
        sql: &str,
    ) -> (ParquetInput, Arc<dyn ObjectStore>, Layout) {
        let plan = (ctx.sql(sql).await.unwrap())
            .create_physical_plan()
            .await
            .unwrap();
        let input = parquet_input(&plan).expect("a Parquet scan");
        let store = ctx.runtime_env().object_store(input.store()).unwrap();
        let layout = input.layout(&store).await.unwrap();
        (input, store, layout)
    }

    /// Files of several row groups, split into byte ranges over more partitions than files:
    /// the columns read as a table and the rows read at positions are the scan's, in its order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_split_scan_reads_as_its_rows_in_input_order() {
        let dir = std::env::temp_dir().join(format!("gpu-topk-parquet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("x", DataType::Float64, true),
        ]));
        for file in 0..3i64 {
            let properties = WriterProperties::builder()
                .set_max_row_group_row_count(Some(1000 + 300 * file as usize))
                .build();
            let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
            let mut writer =
                ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
            let ids: Vec<i64> = (0..7000).map(|i| file * 10_000 + i).collect();
            let xs: Vec<Option<f64>> = ids
                .iter()
                .map(|&i| (i % 7 != 0).then_some((i * 37 % 101) as f64))
                .collect();
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(ids)),
                    Arc::new(Float64Array::from(xs)),
                ],
            )
            .unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
        }
        let config = SessionConfig::new()
            .with_target_partitions(5)
            .with_repartition_file_min_size(1024);
        let ctx = SessionContext::new_with_config(config);
        let path = dir.to_str().unwrap();
        ctx.register_parquet("t", path, ParquetReadOptions::default())
            .await
            .unwrap();
        // Columns, and a column computed in the scan (evaluated here on every row).
        for sql in [
            "SELECT x, id FROM t",
            "SELECT x * 2.0 - 1.0 AS y, id FROM t",
        ] {
            let plan = ctx
                .sql(sql)
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap();
            let scan = plan.with_preserve_order(true).unwrap_or(plan);
            let text = displayable(scan.as_ref()).indent(true).to_string();
            assert!(text.contains(".parquet:"), "ranges expected: {text}");
            let input = parquet_input(&scan).expect("a Parquet scan");
            assert_eq!(input.columns[1].to_string(), "id@0", "{sql}");
            let computed = input.columns[0].downcast_ref::<Column>().is_none();
            assert_eq!(computed, sql.contains('*'), "{sql}: {}", input.columns[0]);
            let partitions = collect_partitioned(Arc::clone(&scan), ctx.task_ctx())
                .await
                .unwrap();
            let batches: Vec<RecordBatch> = partitions.into_iter().flatten().collect();
            let want = concat_batches(&scan.schema(), &batches).unwrap();
            assert_eq!(want.num_rows(), 21_000);

            let store = ctx.runtime_env().object_store(input.store()).unwrap();
            let layout = input.layout(&store).await.unwrap();
            assert_eq!(layout.rows, 21_000);
            let read = input.read_columns(&store, &layout, &[0, 1]).await.unwrap();
            for (column, chunks) in read.iter().enumerate() {
                let arrays: Vec<&dyn datafusion::arrow::array::Array> =
                    chunks.iter().map(|a| a.as_ref()).collect();
                let got = datafusion::arrow::compute::concat(&arrays).unwrap();
                assert_eq!(
                    got.as_ref(),
                    want.column(column).as_ref(),
                    "{sql}: {column}"
                );
            }
            // Winners in any order, from several files and row groups, one repeated.
            let positions: Vec<u64> = vec![20_999, 5, 7000, 13_999, 1001, 5, 14_000, 3300];
            let (batches, at) = input
                .read_rows(&store, &layout, &positions, &[1, 0])
                .await
                .unwrap();
            for (i, &p) in positions.iter().enumerate() {
                let (slot, row) = at[i];
                let expected = take_record_batch(&want, &UInt64Array::from(vec![p])).unwrap();
                for (got, column) in [(0, 1), (1, 0)] {
                    let got = batches[slot][got].slice(row, 1);
                    assert_eq!(&got, expected.column(column), "{sql}: position {p}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Row groups' statistics read as chunk zones: each row group's least and greatest values
    /// and NULLs, as the column cache derives them from the decoded row groups, for the
    /// scan's row groups of split files; none for floats or where the session turns pruning
    /// off. A prefix layout holds the whole row groups of the first rows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn row_group_statistics_are_the_zones_of_the_row_groups() {
        let dir = std::env::temp_dir().join(format!("gpu-topk-zones-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ms = DataType::Timestamp(datafusion::arrow::datatypes::TimeUnit::Millisecond, None);
        let schema = Arc::new(Schema::new(vec![
            Field::new("t", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
            Field::new("ms", ms, false),
        ]));
        for file in 0..2i64 {
            let properties = WriterProperties::builder()
                .set_max_row_group_row_count(Some(700))
                .build();
            let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
            let mut writer =
                ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
            // Ascending, NULL every 11th row, and all NULL in one row group.
            let ts: Vec<Option<i64>> = (0..3000i64)
                .map(|i| (i % 11 != 0 && !(1400..2100).contains(&i)).then_some(file * 5000 + i))
                .collect();
            let xs: Vec<f64> = (0..3000).map(|i| i as f64).collect();
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(ts)),
                    Arc::new(Float64Array::from(xs)),
                    Arc::new(datafusion::arrow::array::TimestampMillisecondArray::from(
                        (0..3000).collect::<Vec<i64>>(),
                    )),
                ],
            )
            .unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
        }
        for pruning in [true, false] {
            let config = SessionConfig::new()
                .with_target_partitions(3)
                .with_repartition_file_min_size(1024)
                .set_bool("datafusion.execution.parquet.pruning", pruning);
            let ctx = SessionContext::new_with_config(config);
            let path = dir.to_str().unwrap();
            ctx.register_parquet("t", path, ParquetReadOptions::default())
                .await
                .unwrap();
            let (input, store, layout) = scanned(&ctx, "SELECT t, x, ms FROM t").await;
            assert_eq!(layout.rows, 6000);
            assert!(input.row_group_zones(&layout, 1).is_none(), "floats");
            assert_eq!(input.row_group_zones(&layout, 2).is_some(), pruning);
            // The same files read as timestamps of another unit: their statistics are not
            // those values.
            let micros =
                DataType::Timestamp(datafusion::arrow::datatypes::TimeUnit::Microsecond, None);
            let read_as = Schema::new(vec![
                Field::new("t", DataType::Int64, true),
                Field::new("x", DataType::Float64, true),
                Field::new("ms", micros, false),
            ]);
            let options = ParquetReadOptions::default().schema(&read_as);
            ctx.register_parquet("u", path, options).await.unwrap();
            let (other, _, other_layout) = scanned(&ctx, "SELECT ms FROM u").await;
            assert!(
                other.row_group_zones(&other_layout, 0).is_none(),
                "another unit"
            );
            let Some(zones) = input.row_group_zones(&layout, 0) else {
                assert!(!pruning, "zones expected");
                continue;
            };
            assert!(pruning, "no zones without pruning");
            let chunks = input.read_columns(&store, &layout, &[0]).await.unwrap();
            assert_eq!(chunks[0].len(), 10, "five row groups a file");
            let want = crate::select::table::derive_zones(&chunks[0]).unwrap();
            assert_eq!(zones.mins.as_ref(), want.mins.as_ref());
            assert_eq!(zones.maxs.as_ref(), want.maxs.as_ref());
            assert_eq!(zones.nulls.as_ref(), want.nulls.as_ref());
            assert_eq!(zones.rows.as_ref(), want.rows.as_ref());
            // The first rows, in whole row groups.
            for (rows, groups) in [(1, 1), (700, 1), (701, 2), (3001, 6), (6000, 10)] {
                let prefix = layout.prefix(rows);
                let held: usize = chunks[0][..groups].iter().map(|a| a.len()).sum();
                assert_eq!(prefix.rows, held, "{rows}");
                let read = input.read_columns(&store, &prefix, &[0]).await.unwrap();
                assert_eq!(read[0].len(), groups, "{rows}");
                for (got, want) in read[0].iter().zip(&chunks[0]) {
                    assert_eq!(got.as_ref(), want.as_ref(), "{rows}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Row groups' dictionaries renumbered into one: every row's code names its string (NULL
    /// keys stay NULL, a NULL entry stays one), entries in the order they first appear,
    /// the same for the same row groups; too many entries for the key type are an error.
    #[test]
    fn row_groups_codes_are_renumbered_into_one_dictionary() {
        use datafusion::arrow::array::{Array, AsArray, DictionaryArray, Int8Array, StringArray};
        use datafusion::arrow::datatypes::{Int8Type, Int32Type};
        let group = |keys: Vec<Option<i32>>, values: Vec<Option<&str>>| -> ArrayRef {
            let keys = datafusion::arrow::array::Int32Array::from(keys);
            Arc::new(
                DictionaryArray::<Int32Type>::try_new(keys, Arc::new(StringArray::from(values)))
                    .unwrap(),
            )
        };
        let chunks = vec![
            group(
                vec![Some(0), Some(1), None, Some(1)],
                vec![Some("en"), Some("es")],
            ),
            group(
                vec![Some(2), Some(0), Some(1), Some(0)],
                vec![Some("fr"), None, Some("en")],
            ),
            group(vec![Some(0)], vec![Some("ja"), Some("unused")]),
        ];
        let (codes, dictionary) = global_codes(&chunks).unwrap();
        let dictionary = dictionary.as_string::<i32>();
        let order: Vec<Option<&str>> = dictionary.iter().collect();
        assert_eq!(
            order,
            vec![
                Some("en"),
                Some("es"),
                Some("fr"),
                None,
                Some("ja"),
                Some("unused")
            ]
        );
        for (chunk, codes) in chunks.iter().zip(&codes) {
            let chunk = chunk.as_dictionary::<Int32Type>();
            let codes = codes.as_primitive::<Int32Type>();
            assert_eq!(codes.len(), chunk.len());
            for row in 0..chunk.len() {
                assert_eq!(codes.is_null(row), chunk.is_null(row), "row {row}");
                if chunk.is_null(row) {
                    continue;
                }
                let values = chunk.values().as_string::<i32>();
                let key = chunk.keys().value(row) as usize;
                let want = values.is_valid(key).then(|| values.value(key));
                let code = codes.value(row) as usize;
                let got = dictionary.is_valid(code).then(|| dictionary.value(code));
                assert_eq!(got, want, "row {row}");
            }
        }
        let (again, _) = global_codes(&chunks).unwrap();
        assert_eq!(again, codes);
        // 200 entries do not fit Int8 keys.
        let wide: Vec<ArrayRef> = (0..2)
            .map(|g| {
                let values: Vec<String> = (0..100).map(|i| format!("{g}-{i}")).collect();
                let keys = Int8Array::from_iter_values(0..100);
                Arc::new(
                    DictionaryArray::<Int8Type>::try_new(keys, Arc::new(StringArray::from(values)))
                        .unwrap(),
                ) as ArrayRef
            })
            .collect();
        let error = global_codes(&wide).unwrap_err().to_string();
        assert!(error.contains("do not fit"), "{error}");
        assert!(global_codes(&[Arc::new(StringArray::from(vec!["x"])) as ArrayRef]).is_err());
    }

    /// What parquet.cu computes from a column's pages, on the host: each row's value (its
    /// image bytes, little-endian) and validity, walking the same runs.
    fn decode_like_the_device(column: &EncodedColumn) -> (Vec<u64>, Vec<bool>) {
        let chunks: Vec<EncodedChunk> = (0..column.chunk_count)
            .map(|_| column.next_chunk().unwrap())
            .collect();
        assert!(
            chunks.iter().any(|c| c.pages.len() > 1),
            "pages of 300 rows"
        );
        fn runs(stream: &[u8], bits: u32, n: usize) -> Vec<u32> {
            let mut out = Vec::with_capacity(n);
            let mut at = 0;
            while out.len() < n {
                let (mut header, mut shift) = (0u32, 0);
                loop {
                    let b = stream[at];
                    at += 1;
                    header |= u32::from(b & 0x7f) << shift;
                    shift += 7;
                    if b & 0x80 == 0 {
                        break;
                    }
                }
                if header & 1 == 1 {
                    let count = (header >> 1) as usize * 8;
                    for i in 0..count {
                        let bit = at * 8 + i * bits as usize;
                        let mut word = 0u64;
                        for j in 0..8 {
                            word |= u64::from(*stream.get(bit / 8 + j).unwrap_or(&0)) << (8 * j);
                        }
                        out.push(((word >> (bit % 8)) & ((1u64 << bits) - 1)) as u32);
                    }
                    at += (header >> 1) as usize * bits as usize;
                } else {
                    let bytes = bits.div_ceil(8) as usize;
                    let mut value = 0u32;
                    for j in 0..bytes {
                        value |= u32::from(stream[at + j]) << (8 * j);
                    }
                    at += bytes;
                    out.extend(std::iter::repeat_n(value, (header >> 1) as usize));
                }
            }
            out.truncate(n);
            out
        }
        let (stored, width) = (column.stored_width, column.width);
        let value = |bytes: &[u8], i: usize| {
            let mut v = 0u64;
            for j in 0..stored {
                v |= u64::from(bytes[i * stored + j]) << (8 * j);
            }
            if width < 8 {
                v & ((1u64 << (8 * width)) - 1)
            } else {
                v
            }
        };
        let (mut values, mut valid) = (vec![0; column.rows], vec![false; column.rows]);
        // Chunks arrive in any order; each page knows its rows.
        for chunk in &chunks {
            for page in &chunk.pages {
                let bytes = &page.bytes;
                let rows = page.rows as usize;
                let levels = &bytes[page.levels.start as usize..page.levels.end as usize];
                let here: Vec<bool> = match levels.is_empty() {
                    true => vec![true; rows],
                    false => runs(levels, 1, rows).into_iter().map(|l| l == 1).collect(),
                };
                let data = &bytes[page.values.start as usize..page.values.end as usize];
                let count = here.iter().filter(|&&v| v).count();
                let taken: Vec<u64> = match (page.dictionary, &chunk.dictionary) {
                    (true, Some((dictionary, entries))) => {
                        runs(&data[1..], u32::from(data[0]), count)
                            .into_iter()
                            .map(|i| {
                                assert!(u64::from(i) < *entries);
                                value(dictionary, i as usize)
                            })
                            .collect()
                    }
                    (true, None) => panic!("a dictionary page without a dictionary"),
                    (false, _) => (0..count).map(|i| value(data, i)).collect(),
                };
                let mut next = taken.into_iter();
                for (i, is_valid) in here.into_iter().enumerate() {
                    let row = page.first_row as usize + i;
                    values[row] = if is_valid { next.next().unwrap() } else { 0 };
                    valid[row] = is_valid;
                }
            }
        }
        (values, valid)
    }

    /// Every type the device decodes, NULLs and none, over files written with dictionaries,
    /// without them and with a dictionary that overflows into PLAIN pages; v1 and v2 pages;
    /// uncompressed, zstd, snappy and lz4; many pages a row group: the pages read for the
    /// device decode, as the kernel does, to the values the host's reader decodes. Columns in
    /// an encoding the device does not decode (DELTA_BINARY_PACKED, strings) are not read as
    /// pages.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pages_decode_to_the_readers_values() {
        use datafusion::arrow::array::{
            Array, Date32Array, Float32Array, Int8Array, Int16Array, Int32Array, StringArray,
            TimestampMicrosecondArray, TimestampNanosecondArray, UInt8Array, UInt16Array,
            UInt32Array,
        };
        use datafusion::arrow::datatypes::TimeUnit;
        use datafusion::parquet::basic::{Compression, ZstdLevel};
        use datafusion::parquet::file::properties::WriterVersion;
        let n = 9000usize;
        let null = |i: usize| i % 11 == 3;
        let v = |i: usize| ((i * 7919) % 1000) as i64 - 500;
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("i8", DataType::Int8, true),
            Field::new("i16", DataType::Int16, true),
            Field::new("i32", DataType::Int32, false),
            Field::new("u8", DataType::UInt8, true),
            Field::new("u16", DataType::UInt16, true),
            Field::new("u32", DataType::UInt32, true),
            Field::new("u64", DataType::UInt64, true),
            Field::new("f32", DataType::Float32, true),
            Field::new("f64", DataType::Float64, true),
            Field::new("d", DataType::Date32, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
            Field::new(
                "tz",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
                true,
            ),
            Field::new("all", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let opt = |i: usize, x: i64| (!null(i)).then_some(x);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(
                (0..n).map(|i| i as i64 * 1_000_003),
            )),
            Arc::new(Int8Array::from_iter(
                (0..n).map(|i| opt(i, v(i) % 128).map(|x| x as i8)),
            )),
            Arc::new(Int16Array::from_iter(
                (0..n).map(|i| opt(i, v(i) * 60).map(|x| x as i16)),
            )),
            Arc::new(Int32Array::from_iter_values(
                (0..n).map(|i| v(i) as i32 * 4_000_000),
            )),
            Arc::new(UInt8Array::from_iter(
                (0..n).map(|i| opt(i, v(i) + 500).map(|x| x as u8)),
            )),
            Arc::new(UInt16Array::from_iter(
                (0..n).map(|i| opt(i, v(i) * 99).map(|x| x as u16)),
            )),
            Arc::new(UInt32Array::from_iter(
                (0..n).map(|i| opt(i, v(i) << 22).map(|x| x as u32)),
            )),
            Arc::new(UInt64Array::from_iter(
                (0..n).map(|i| opt(i, v(i) << 50).map(|x| x as u64)),
            )),
            Arc::new(Float32Array::from_iter(
                (0..n).map(|i| opt(i, v(i)).map(|x| x as f32 / 3.0)),
            )),
            Arc::new(Float64Array::from_iter(
                (0..n).map(|i| opt(i, i as i64).map(|x| x as f64 * 0.1)),
            )),
            Arc::new(Date32Array::from_iter(
                (0..n).map(|i| opt(i, v(i) * 40).map(|x| x as i32)),
            )),
            Arc::new(TimestampMicrosecondArray::from_iter(
                (0..n).map(|i| opt(i, v(i) << 30)),
            )),
            Arc::new(
                TimestampNanosecondArray::from_iter((0..n).map(|i| opt(i, i as i64 * 999_983)))
                    .with_timezone("UTC"),
            ),
            Arc::new(Int64Array::from_iter(
                (0..n).map(|i| (i >= n / 2).then_some(v(i))),
            )),
            Arc::new(StringArray::from_iter(
                (0..n).map(|i| opt(i, v(i)).map(|x| x.to_string())),
            )),
        ];
        let batch = RecordBatch::try_new(Arc::clone(&schema), columns).unwrap();
        let zstd = Compression::ZSTD(ZstdLevel::default());
        // Without a dictionary, v2 pages store integers DELTA_BINARY_PACKED: host-decoded.
        let writers = [
            (
                "dictionary",
                true,
                WriterVersion::PARQUET_1_0,
                Compression::UNCOMPRESSED,
                1 << 20,
            ),
            (
                "plain-zstd",
                false,
                WriterVersion::PARQUET_1_0,
                zstd,
                1 << 20,
            ),
            (
                "dictionary-v2-snappy",
                true,
                WriterVersion::PARQUET_2_0,
                Compression::SNAPPY,
                1 << 20,
            ),
            (
                "overflow-lz4",
                true,
                WriterVersion::PARQUET_1_0,
                Compression::LZ4_RAW,
                512,
            ),
            (
                "delta-v2",
                false,
                WriterVersion::PARQUET_2_0,
                Compression::UNCOMPRESSED,
                1 << 20,
            ),
        ];
        for (name, dictionary, version, compression, dictionary_bytes) in writers {
            let dir =
                std::env::temp_dir().join(format!("gpu-topk-pages-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for file in 0..2 {
                let properties = WriterProperties::builder()
                    .set_max_row_group_row_count(Some(2000 + 700 * file))
                    .set_data_page_row_count_limit(300)
                    .set_write_batch_size(100)
                    .set_dictionary_enabled(dictionary)
                    .set_dictionary_page_size_limit(dictionary_bytes)
                    .set_writer_version(version)
                    .set_compression(compression)
                    .build();
                let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
                let mut writer =
                    ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
                writer.write(&batch).unwrap();
                writer.close().unwrap();
            }
            let ctx =
                SessionContext::new_with_config(SessionConfig::new().with_target_partitions(3));
            ctx.register_parquet("t", dir.to_str().unwrap(), ParquetReadOptions::default())
                .await
                .unwrap();
            let (input, store, layout) = scanned(&ctx, "SELECT * FROM t").await;
            assert_eq!(layout.rows, 2 * n);
            let strings = schema.fields().len() - 1;
            assert!(
                input
                    .read_pages(&store, &layout, strings, false)
                    .await
                    .unwrap()
                    .is_none()
            );
            for c in 0..strings {
                let streaming = c % 2 == 0;
                let pages = input
                    .read_pages(&store, &layout, c, streaming)
                    .await
                    .unwrap();
                let float = matches!(
                    schema.field(c).data_type(),
                    DataType::Float32 | DataType::Float64
                );
                if name == "delta-v2" && !float {
                    assert!(pages.is_none(), "{name}: column {c} is DELTA_BINARY_PACKED");
                    continue;
                }
                let pages = pages.unwrap_or_else(|| panic!("{name}: column {c} as pages"));
                let chunks = input
                    .read_columns(&store, &layout, &[c])
                    .await
                    .unwrap()
                    .remove(0);
                let arrays: Vec<&dyn Array> = chunks.iter().map(|a| a.as_ref()).collect();
                let want = datafusion::arrow::compute::concat(&arrays).unwrap();
                assert_eq!(pages.rows, want.len());
                assert_eq!(
                    pages.nullable,
                    want.null_count() > 0 || c == strings - 1,
                    "{name} {c}"
                );
                let (values, valid) = decode_like_the_device(&pages);
                let data = want.to_data();
                let bytes = data.buffers()[0].as_slice();
                for row in 0..want.len() {
                    assert_eq!(
                        valid[row],
                        want.is_valid(row),
                        "{name}: column {c} row {row}"
                    );
                    if valid[row] {
                        let w = pages.width;
                        let at = (data.offset() + row) * w;
                        let mut expected = 0u64;
                        for j in 0..w {
                            expected |= u64::from(bytes[at + j]) << (8 * j);
                        }
                        assert_eq!(values[row], expected, "{name}: column {c} row {row}");
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
