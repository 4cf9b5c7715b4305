//! Files' footers, read once per file identity.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::ParquetFileReaderFactory;
use datafusion::error::Result;
use datafusion::object_store::ObjectStore;
use datafusion::parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use datafusion::parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};

use super::reader;

/// Files' footers by identity (path, size, modification time).
type FileId = (String, u64, i64);
/// Process-wide: a file's footer is the same for every session that reads it, and the
/// column cache that the footers key is the process's.
static FOOTERS: LazyLock<Mutex<HashMap<FileId, Arc<ParquetMetaData>>>> =
    LazyLock::new(Default::default);
/// Footers kept at most (a new one past this starts the map afresh).
const MAX_FOOTERS: usize = 4096;

pub(super) fn file_id(file: &PartitionedFile) -> FileId {
    let meta = &file.object_meta;
    let modified = meta.last_modified.timestamp_nanos_opt().unwrap_or(i64::MIN);
    (meta.location.to_string(), meta.size, modified)
}

/// The footer of `file`, read once per file identity.
pub(super) async fn footer(
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
