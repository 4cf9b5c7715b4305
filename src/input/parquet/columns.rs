//! A Parquet input's columns as program inputs for the column cache: read as pages the device
//! decodes, or decoded on the host.

use std::borrow::Cow;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::error::Result;
use datafusion::object_store::ObjectStore;

use super::{ParquetInput, RowGroupLayout};
use crate::device::EncodedColumn;
use crate::device::column_cache::CacheKey;
use crate::input::{ColumnImage, Identity, TableInput};

/// The columns `missing` of a Parquet input's row groups for the column cache: as pages to
/// decode on the device where `on_device` says so and the device decodes them (the second list,
/// `None` elsewhere), the others decoded on the host (the first list: none for a column read
/// as pages). A column whose pages cannot be read as such is decoded on the host. With
/// `streaming`, pages come as they are read ([`ParquetInput::read_pages`]).
pub(crate) async fn read_missing(
    files: &ParquetInput,
    store: &Arc<dyn ObjectStore>,
    layout: &RowGroupLayout,
    missing: &[usize],
    on_device: &[bool],
    streaming: bool,
) -> (Result<Vec<Vec<ArrayRef>>>, Vec<Option<Arc<EncodedColumn>>>) {
    let mut encoded = Vec::with_capacity(missing.len());
    for (&c, &on_device) in missing.iter().zip(on_device) {
        let pages = match on_device {
            true => files.read_pages(store, layout, c, streaming).await,
            false => Ok(None),
        };
        encoded.push(match pages {
            Ok(pages) => pages.map(Arc::new),
            Err(e) => {
                log::debug!("gpu-topk: column {c} is decoded on the host: {e}");
                None
            }
        });
    }
    let host: Vec<usize> = (missing.iter().zip(&encoded))
        .filter(|(_, pages)| pages.is_none())
        .map(|(&c, _)| c)
        .collect();
    let decoded = match host.is_empty() {
        true => Ok(Vec::new()),
        false => files.read_columns(store, layout, &host).await,
    };
    // In `missing`'s order, empty where the column is read as pages.
    let decoded = decoded.map(|mut decoded| {
        let mut next = decoded.drain(..);
        (encoded.iter())
            .map(|pages| match pages {
                Some(_) => Vec::new(),
                None => next.next().unwrap_or_default(),
            })
            .collect()
    });
    (decoded, encoded)
}

/// The type of the image a program input reads of a column of `data_type`: a dictionary
/// column's `codes` are of its key type.
pub(crate) fn image_type(data_type: DataType, codes: bool) -> Result<DataType> {
    match (codes, data_type) {
        (false, data_type) => Ok(data_type),
        (true, DataType::Dictionary(key, _)) => Ok(*key),
        (true, other) => datafusion::common::internal_err!("codes of a {other} column"),
    }
}

/// The rows of a Parquet input's column that a program input holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ParquetColumnRows {
    /// All the table's rows: the column the cache keeps.
    Whole(usize),
    /// The table's first rows only, for one selection ([`Identity::transient`]).
    Prefix(usize),
}

/// Column `c` of a Parquet input as a program input known by its key, read as `image`: `read`
/// is its row groups decoded, or its pages to decode on the device (neither where the cache
/// holds it).
pub(crate) fn file_column(
    key: CacheKey,
    data_type: DataType,
    rows: ParquetColumnRows,
    read: (Vec<ArrayRef>, Option<Arc<EncodedColumn>>),
    schema: &Schema,
    c: usize,
    image: ColumnImage,
) -> TableInput<'static> {
    let (chunks, encoded) = read;
    let nullable =
        chunks.iter().any(|a| a.null_count() > 0) || encoded.as_ref().is_some_and(|e| e.nullable);
    let (rows, transient) = match rows {
        ParquetColumnRows::Whole(rows) => (rows, false),
        ParquetColumnRows::Prefix(rows) => (rows, true),
    };
    TableInput {
        identity: Some(Identity {
            key,
            data_type,
            rows,
            nullable,
            transient,
        }),
        chunks: Cow::Owned(chunks),
        lookup: None,
        name: schema.field(c).name().clone(),
        image,
        encoded,
    }
}
