//! What a table is to the operators: the inputs a generated program reads over a whole table,
//! and the caches that serve them.
//!
//! A whole table is an in-memory table (a `MemTable`'s batches, [`memory`], merged into few
//! large ones the first time a query reads them, [`compact`]), a [`GpuTable`]
//! (known to the cache by identity, [`gpu_table`]) or a scan of Parquet files ([`parquet`]:
//! footers, pages decoded on the device, dictionaries renumbered into one). Each column a
//! program reads becomes a [`TableInput`], read through one of its device images
//! ([`ColumnImage`]): values, prefix words ([`strings`]), string bytes or a string
//! column's order-preserving codes ([`codes`]). [`columns`] uploads
//! an image into the device column cache and says how much of a program's input is resident;
//! [`zones`] keeps each cached chunk's least and greatest values so a pass skips the chunks
//! no row of which can pass; [`loader`] loads columns in the background after a run on the
//! CPU path.
//!
//! The selectors ([`crate::select`]) read tables only through this module; it reads the
//! device's cache and engine ([`crate::device`]) and the generated program's inputs
//! ([`crate::fusion`]).
//!
//! [`GpuTable`]: gpu_table::GpuTable

pub mod codes;
pub mod columns;
pub mod compact;
pub mod gpu_table;
pub mod loader;
pub mod memory;
pub mod parquet;
pub mod strings;
pub mod zones;

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::DataType;

use crate::device::EncodedColumn;
use crate::device::column_cache::{CacheKey, codes_key, prefix_key, strings_key};
use crate::fusion::KernelInput;
use strings::{PREFIX_BYTES, STRING_END_BYTES};

/// One input of a generated program over a whole in-memory table.
#[derive(Debug, Clone)]
pub struct TableInput<'a> {
    /// A per-row input: one array per batch of the table, in input order.
    pub chunks: std::borrow::Cow<'a, [ArrayRef]>,
    /// A per-dictionary-entry input (the program's lookup table), instead of chunks.
    pub lookup: Option<ArrayRef>,
    /// What the cache listing calls it (the column's name).
    pub name: String,
    /// What the chunks are, where the cache knows them by that instead of by their buffers
    /// (a column known by identity may come without chunks when the cache holds it).
    pub identity: Option<Identity>,
    /// Which image of the chunks the program reads (and the cache holds).
    pub image: ColumnImage,
    /// The column as Parquet pages to decode on the device, instead of chunks (a column of
    /// Parquet files the cache does not hold; its values image only).
    pub encoded: Option<Arc<EncodedColumn>>,
}

impl TableInput<'_> {
    /// Whether the column's rows are given (as chunks or pages), not only its identity.
    pub(crate) fn given(&self) -> bool {
        !self.chunks.is_empty() || self.encoded.is_some()
    }

    /// The pieces the column comes in (the cache listing's chunks).
    pub(crate) fn pieces(&self) -> usize {
        match &self.encoded {
            Some(encoded) => encoded.chunk_count,
            None => self.chunks.len(),
        }
    }
}

/// The device image of a column that a program input reads, each its own cache entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ColumnImage {
    /// The column's values (and validity), as its Arrow buffers hold them.
    #[default]
    Values,
    /// A string or binary column's prefix words, 16 bytes a row
    /// ([`KernelInput::StringPrefix`]), not the strings.
    Prefix,
    /// A string column's row ends (i64) and bytes ([`KernelInput::StringColumn`]).
    Strings,
    /// A string column's order-preserving codes, an i64 a row ([`KernelInput::StringCodes`],
    /// [`codes`]).
    Codes,
}

impl ColumnImage {
    /// The image a program input reads; `None` for inputs that are no column.
    pub fn of(input: &KernelInput) -> Option<(usize, Self)> {
        match input {
            KernelInput::Column(c) | KernelInput::DictionaryCodes(c) => {
                Some((*c, ColumnImage::Values))
            }
            KernelInput::StringPrefix(c) => Some((*c, ColumnImage::Prefix)),
            KernelInput::StringColumn(c) => Some((*c, ColumnImage::Strings)),
            KernelInput::StringCodes(c) => Some((*c, ColumnImage::Codes)),
            KernelInput::HostPredicate | KernelInput::DictionaryMatch { .. } => None,
        }
    }

    /// The cache key of this image of the column whose key is `key`.
    pub fn key(self, key: CacheKey) -> CacheKey {
        match self {
            ColumnImage::Values => key,
            ColumnImage::Prefix => prefix_key(key),
            ColumnImage::Strings => strings_key(key),
            ColumnImage::Codes => codes_key(key),
        }
    }

    /// Device bytes a row of the image takes besides a string column's bytes (`None`:
    /// bit-packed booleans) for a column of `data_type`.
    pub fn row_bytes(self, data_type: &DataType) -> Option<usize> {
        match self {
            ColumnImage::Values => data_type.primitive_width(),
            ColumnImage::Prefix => Some(PREFIX_BYTES),
            ColumnImage::Strings => Some(STRING_END_BYTES),
            ColumnImage::Codes => Some(8),
        }
    }
}

/// A column the cache knows by what it is rather than by its buffers (a `GpuTable`'s column,
/// a column of a set of Parquet files), with what is known of it without reading it.
#[derive(Debug, Clone)]
pub struct Identity {
    pub key: CacheKey,
    pub data_type: DataType,
    pub rows: usize,
    /// Whether any chunk holds NULLs (read only where the column is uploaded).
    pub nullable: bool,
    /// Whether these are only the column's first `rows` rows, read for one selection that
    /// reads no further: uploaded for it and not kept (the key names the whole column, which
    /// the cache may hold meanwhile and the selection then reads).
    pub transient: bool,
}

/// Whether `input` hands out an in-memory table's own batches, whose buffers the next query
/// receives again, or reads Parquet files as they are: only then can the device column cache
/// serve them.
pub(crate) fn is_whole_table(input: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> bool {
    memory::memory_input(input).is_some() || parquet::parquet_input(input).is_some()
}
