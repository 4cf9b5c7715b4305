//! A Parquet column read as its pages, for the device to decode.

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};
use datafusion::object_store::ObjectStore;
use datafusion::parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::parquet::basic::{Encoding, Type as PhysicalType};
use datafusion::parquet::column::page::{Page, PageReader};
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::metadata::ColumnChunkMetaData;
use datafusion::parquet::file::reader::{ChunkReader, Length};
use datafusion::parquet::file::serialized_reader::SerializedPageReader;
use datafusion::physical_expr::expressions::Column;

use crate::device::{EncodedChunk, EncodedColumn, EncodedPage};

use super::{ParquetInput, RowGroupLayout};

impl ParquetInput {
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

    /// The scan's output column `output` over every row group of `layout` as its pages, to be
    /// decoded on the device: `None` where it cannot be (a computed column, a type or encoding
    /// the device does not decode, a nested schema). The host reads the column chunks and
    /// decompresses their pages on all cores, one task per row group; with `streaming` the
    /// column is returned at once and its chunks follow as they are read (the tasks run on
    /// the runtime meanwhile), else once all are read.
    pub async fn read_pages(
        &self,
        store: &Arc<dyn ObjectStore>,
        layout: &RowGroupLayout,
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
pub(super) fn same_values(natural: &DataType, data_type: &DataType) -> bool {
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
