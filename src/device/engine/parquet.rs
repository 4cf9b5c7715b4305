//! Parquet pages decoded on the device (parquet.cu): a column's data pages, shipped as they
//! are stored (decompressed), become its column cache image.
//!
//! The pages go up a window of whole column chunks at a time (their bytes and dictionaries
//! back to back, then one descriptor a page), and one launch decodes a window's pages; the host
//! fills the next window's staging meanwhile. A malformed page sets the kernel's error flag, read
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

/// A column of fixed-width values as Parquet pages, to be decoded into its image.
#[derive(Debug, Clone)]
pub struct EncodedColumn {
    pub chunks: Vec<EncodedChunk>,
    /// Rows of the column.
    pub rows: usize,
    /// Bytes of a stored value (4: INT32 and FLOAT, 8: INT64 and DOUBLE).
    pub stored_width: usize,
    /// Bytes of an image value (1, 2, 4 or 8; narrower than stored: truncated).
    pub width: usize,
    /// Whether any page may hold NULLs (the image then has a validity bitmap).
    pub nullable: bool,
}

impl EncodedColumn {
    /// Bytes of every page and dictionary: what crosses PCIe.
    pub fn shipped_bytes(&self) -> usize {
        self.chunks.iter().map(EncodedChunk::bytes).sum()
    }
}

/// Page bytes shipped per decode launch, at most (a larger chunk goes alone).
const DECODE_WINDOW: usize = 128 << 20;
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
        // Windows of whole chunks, each its bytes and descriptors in one device buffer.
        let mut start = 0;
        while start < column.chunks.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < column.chunks.len()
                && (end == start || bytes + column.chunks[end].bytes() <= DECODE_WINDOW)
            {
                bytes += column.chunks[end].bytes();
                end += 1;
            }
            let window = &column.chunks[start..end];
            self.decode_window(column, window, dst, validity, error.ptr())?;
            start = end;
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
        let first_row = placed[0].1.first_row;
        let last = placed[placed.len() - 1].1;
        let window_rows = (last.first_row + u64::from(last.rows) - first_row) as usize;
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
