//! Parquet pages decoded on the device (parquet.cu): a column's data pages, shipped as they
//! are stored (decompressed), become its column cache image.
//!
//! The pages go up a window of whole column chunks at a time, as the host reads them (their
//! bytes and dictionaries back to back, then one descriptor a page), and one launch decodes a
//! window's pages; the host reads and stages the next window's meanwhile. A malformed page sets the kernel's error flag, read
//! once after the last window; the caller then decodes the files on the host.

use super::*;

/// One data page of a flat column: its definition levels and values as stored, decompressed.
#[derive(Debug, Clone)]
pub struct EncodedPage {
    /// The page's levels and values (a v1 page's bytes after decompression; a v2 page's levels
    /// and decompressed values).
    pub bytes: bytes::Bytes,
    /// The page's first row in the column.
    pub first_row: u64,
    /// Rows (levels) in the page.
    pub rows: u32,
    /// Where the RLE / bit-packed definition levels lie in `bytes` (empty: every row valid).
    pub levels: std::ops::Range<u32>,
    /// Where the values lie in `bytes`: PLAIN, or a dictionary page's indices.
    pub values: std::ops::Range<u32>,
    /// Whether the values are indices into the chunk's dictionary (else PLAIN values).
    pub dictionary: bool,
}

/// One column chunk (a row group's column): its dictionary page's PLAIN values and entries,
/// if it has one, and its data pages.
#[derive(Debug, Clone, Default)]
pub struct EncodedChunk {
    pub dictionary: Option<(bytes::Bytes, u64)>,
    pub pages: Vec<EncodedPage>,
}

impl EncodedChunk {
    fn bytes(&self) -> usize {
        let dictionary = self.dictionary.as_ref().map_or(0, |(d, _)| d.len());
        dictionary + self.pages.iter().map(|p| p.bytes.len()).sum::<usize>()
    }
}

/// A column of fixed-width values as Parquet pages, to be decoded into its image. Its chunks
/// arrive as the host reads them, in any order (each page knows its rows), so that shipping
/// and decoding overlap the reads; a chunk that could not be read arrives as the reason.
#[derive(Debug)]
pub struct EncodedColumn {
    chunks: std::sync::Mutex<std::sync::mpsc::Receiver<Result<EncodedChunk, String>>>,
    /// Chunks to come.
    pub chunk_count: usize,
    /// Rows of the column.
    pub rows: usize,
    /// Bytes of a stored value (4: INT32 and FLOAT, 8: INT64 and DOUBLE).
    pub stored_width: usize,
    /// Bytes of an image value (1, 2, 4 or 8; narrower than stored: truncated).
    pub width: usize,
    /// Whether any page may hold NULLs (the image then has a validity bitmap).
    pub nullable: bool,
    /// Bytes of the pages as stored, uncompressed, by the files' metadata: about what the
    /// host holds and ships.
    pub page_bytes: usize,
    shipped: std::sync::atomic::AtomicUsize,
}

impl EncodedColumn {
    /// A column whose `chunk_count` chunks come through `chunks`.
    pub fn new(
        chunks: std::sync::mpsc::Receiver<Result<EncodedChunk, String>>,
        chunk_count: usize,
        rows: usize,
        (stored_width, width): (usize, usize),
        nullable: bool,
        page_bytes: usize,
    ) -> Self {
        Self {
            chunks: std::sync::Mutex::new(chunks),
            chunk_count,
            rows,
            stored_width,
            width,
            nullable,
            page_bytes,
            shipped: Default::default(),
        }
    }

    /// The next chunk read (waiting for it), or why none comes.
    pub fn next_chunk(&self) -> Result<EncodedChunk, String> {
        let chunks = self
            .chunks
            .lock()
            .map_err(|_| "the pages' receiver is poisoned")?;
        chunks
            .recv()
            .map_err(|_| "the pages' reader stopped".to_string())?
    }

    /// Bytes of pages and dictionaries shipped so far: what crossed PCIe.
    pub fn shipped_bytes(&self) -> usize {
        self.shipped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Page bytes shipped per decode launch, at least (the last window's excepted): a window goes
/// as soon as the chunks read fill it.
const DECODE_WINDOW: usize = 64 << 20;
/// Warps (one a page) per block of `parquet_decode`.
const DECODE_WARPS: usize = 8;
/// u64 words of a page's descriptor.
const DESCRIPTOR_WORDS: usize = 8;

impl TopKEngine {
    /// Decodes `column`'s pages into its image: values at `dst` (`width` bytes a row), and the
    /// validity bitmap at `validity` (0: the image has none, and a NULL is an error).
    pub(crate) fn decode_pages(
        &mut self,
        column: &EncodedColumn,
        dst: u64,
        validity: u64,
    ) -> GpuResult<()> {
        if !matches!(column.stored_width, 4 | 8)
            || !matches!(column.width, 1 | 2 | 4 | 8)
            || column.width > column.stored_width
        {
            return Err(GpuError(format!(
                "no device decode of {}-byte values into {}-byte ones",
                column.stored_width, column.width
            )));
        }
        if validity != 0 {
            self.memset_zero(validity, column.rows.div_ceil(32) * 4)?;
        }
        let error = self.device.pool.alloc(4, &self.stream)?;
        self.memset_zero(error.ptr(), 4)?;
        // Windows of whole chunks as they arrive, each its bytes and descriptors in one device
        // buffer.
        let (mut window, mut bytes, mut rows) = (Vec::new(), 0, 0usize);
        for received in 0..column.chunk_count {
            let chunk = column.next_chunk().map_err(GpuError)?;
            bytes += chunk.bytes();
            rows += chunk.pages.iter().map(|p| p.rows as usize).sum::<usize>();
            window.push(chunk);
            if bytes >= DECODE_WINDOW || received + 1 == column.chunk_count {
                self.decode_window(column, &window, dst, validity, error.ptr())?;
                column
                    .shipped
                    .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                (window, bytes) = (Vec::new(), 0);
            }
        }
        if rows != column.rows {
            return Err(GpuError(format!(
                "the pages hold {rows} rows of the column's {}",
                column.rows
            )));
        }
        let flag = self.read_bytes(error.ptr(), 4)?;
        let flag = u32::from_le_bytes(flag[..4].try_into().expect("4 bytes"));
        if flag != 0 {
            let what = [
                (1, "a stream ends early"),
                (2, "a dictionary index is out of range"),
                (4, "a NULL in a column without NULLs"),
                (8, "an index bit width above 32"),
            ]
            .iter()
            .filter(|(bit, _)| flag & bit != 0)
            .map(|(_, what)| *what)
            .collect::<Vec<_>>()
            .join(", ");
            return Err(GpuError(format!("malformed Parquet pages: {what}")));
        }
        Ok(())
    }

    /// Ships one window of chunks and enqueues their decode (its buffers are released in
    /// stream order, after the decode).
    fn decode_window(
        &mut self,
        column: &EncodedColumn,
        chunks: &[EncodedChunk],
        dst: u64,
        validity: u64,
        error: u64,
    ) -> GpuResult<()> {
        let align = |n: usize| n.div_ceil(16) * 16;
        // The bytes' image: each chunk's dictionary, then its pages, each 16-byte aligned.
        let mut parts: Vec<(usize, &[u8])> = Vec::new();
        let mut placed = Vec::new();
        let mut total = 0;
        for chunk in chunks {
            let dictionary = chunk.dictionary.as_ref().map(|(bytes, entries)| {
                let at = total;
                parts.push((at, bytes.as_ref()));
                total = align(total + bytes.len());
                (at, *entries)
            });
            for page in &chunk.pages {
                parts.push((total, page.bytes.as_ref()));
                placed.push((total, page, page.dictionary.then_some(dictionary).flatten()));
                total = align(total + page.bytes.len());
            }
        }
        if placed.is_empty() {
            return Ok(());
        }
        let data = self.device.pool.alloc(total.max(16), &self.stream)?;
        self.upload_image(&parts, total, data.ptr())?;
        // Chunks come in any order: the scratch spans the window's rows.
        let first_row = (placed.iter())
            .map(|(_, p, _)| p.first_row)
            .min()
            .unwrap_or(0);
        let end_row = (placed.iter())
            .map(|(_, p, _)| p.first_row + u64::from(p.rows))
            .max()
            .unwrap_or(0);
        let window_rows = (end_row - first_row) as usize;
        if end_row > column.rows as u64 {
            return Err(GpuError(format!(
                "a page's rows end at {end_row}, past the column's {}",
                column.rows
            )));
        }
        let mut words = Vec::with_capacity(placed.len() * DESCRIPTOR_WORDS);
        let mut uses_dictionary = false;
        for (at, page, dictionary) in &placed {
            if page.dictionary && dictionary.is_none() {
                return Err(GpuError(
                    "a dictionary-encoded page without a dictionary".into(),
                ));
            }
            let range =
                |r: &std::ops::Range<u32>| u64::from(r.start) | (u64::from(r.end - r.start) << 32);
            let (dict, entries) = match dictionary {
                Some((dict_at, entries)) => (data.ptr() + *dict_at as u64, *entries),
                None => (0, 0),
            };
            uses_dictionary |= dict != 0;
            words.extend([
                data.ptr() + *at as u64,
                page.bytes.len() as u64,
                page.first_row,
                u64::from(page.rows),
                range(&page.levels),
                range(&page.values),
                dict,
                entries,
            ]);
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let descriptors = self.device.pool.alloc(bytes.len(), &self.stream)?;
        self.upload_bytes(&bytes, descriptors.ptr())?;
        let scratch = match uses_dictionary {
            true => Some(
                self.device
                    .pool
                    .alloc(4 * window_rows.max(1), &self.stream)?,
            ),
            false => None,
        };
        let pages = placed.len();
        self.launch(
            "parquet_decode",
            pages.div_ceil(DECODE_WARPS) as u32,
            (32 * DECODE_WARPS) as u32,
            0,
            args![
                descriptors.ptr(),
                pages as u32,
                column.stored_width as u32,
                column.width as u32,
                dst,
                validity,
                scratch.as_ref().map_or(0, |s| s.ptr()),
                first_row,
                error
            ],
        )
    }
}
