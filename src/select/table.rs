//! The selection over a whole table ([`TableSelector`]): the query's generated program
//! ([`crate::fusion`]) runs once over every row of an in-memory table or of a scan of Parquet
//! files, its input columns read from the device column cache (uploaded into it on a miss),
//! as an engine whose table lives in GPU memory runs it. The fused selection evaluates
//! predicate and keys inside the first pass of a sampled selection
//! ([`TopKEngine::fused_select`]); one read-back brings the winners' positions.
//!
//! A string sort key's column is held as its prefix words (each value's first 16 bytes,
//! `keys::prefix_words`, derived by the host's cores on a miss), which a prefix layout's
//! program packs into its composite. That composite is monotone, not exact: after the
//! selection one more pass of the program returns every row whose composite is at most the
//! k-th's ([`TopKEngine::fused_ties`]), and the caller ranks those by their whole keys
//! ([`TableSelection::refine`]).
//!
//! [`ResidentColumns`] is the same selection over columns uploaded once by the caller, with
//! the unfused variant beside it (a filter kernel, then top-k): the fusion benchmark
//! (`benches/fused.rs`) and the GPU tests compare both with DataFusion.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanBufferBuilder, RecordBatch, downcast_primitive_array,
};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;

use super::SelectionSpec;
use super::cuda::{ColumnBuffers, exec_error, gpu_error, program_error};
use crate::device::column_cache::{
    CacheKey, CacheUse, ChunkZones, ColumnCache, Loading, NewEntry, prefix_key, strings_key,
};
use crate::device::watch::{self, DeviceWatch};
use crate::device::{
    DeviceAlgorithm, DevicePairs, EncodedColumn, FUSED_SAMPLE_ROWS, FusedReport, GatherColumn,
    GeneratedKernel, GpuDevice, GpuError, GpuResult, GroupSpec, KeptPiece, KeptRows, PooledBuffer,
    TopKEngine, contain_panics,
};
use crate::fusion::{self, FusedProgram, KernelInput};

/// A program's inputs on the device, one buffer per Arrow buffer.
pub struct ResidentColumns {
    _buffers: Vec<PooledBuffer>,
    /// The kernel's input arguments (four per input, see the generated signature).
    args: Vec<u64>,
    rows: usize,
    /// Bytes of the per-row inputs (values and validity): what a pass must read.
    row_bytes: usize,
    /// The per-row inputs' device buffers: address and bytes.
    row_buffers: Vec<(u64, usize)>,
}

impl ResidentColumns {
    /// The program's input arrays for `batch` (whose schema is the operator's input): each
    /// column the program reads, a dictionary column's codes, the dictionary entries that match
    /// an `IN` list. A predicate the program leaves to the host has no device input.
    pub fn program_inputs(program: &FusedProgram, batch: &RecordBatch) -> Result<Vec<ArrayRef>> {
        program
            .inputs
            .iter()
            .map(|input| match input {
                KernelInput::Column(c) => Ok(Arc::clone(batch.column(*c))),
                KernelInput::DictionaryCodes(c) => fusion::dictionary_codes(batch.column(*c)),
                KernelInput::DictionaryMatch { column, values } => {
                    fusion::dictionary_match(batch.column(*column), values)
                }
                KernelInput::StringPrefix(c) => {
                    let words = crate::keys::prefix_words(batch.column(*c).as_ref())?;
                    let mut values = Vec::with_capacity(words.len());
                    values.extend(words.into_iter().map(|w| w as i128));
                    let prefix = datafusion::arrow::array::Decimal128Array::new(
                        values.into(),
                        batch.column(*c).logical_nulls(),
                    );
                    Ok(Arc::new(prefix) as ArrayRef)
                }
                KernelInput::StringColumn(_) => Err(exec_error(
                    "device-resident columns of strings are read through the column cache"
                        .to_string(),
                )),
                KernelInput::HostPredicate => Err(exec_error(
                    "a device-resident top-k needs the predicate on the GPU; this program \
                     leaves it to the host"
                        .to_string(),
                )),
            })
            .collect()
    }

    /// Uploads `arrays` (from [`program_inputs`](Self::program_inputs)) and waits for the copy.
    pub fn upload(
        engine: &mut TopKEngine,
        program: &FusedProgram,
        arrays: &[ArrayRef],
    ) -> Result<Self> {
        if arrays.len() != program.inputs.len() {
            return Err(exec_error(format!(
                "the program takes {} inputs, got {}",
                program.inputs.len(),
                arrays.len()
            )));
        }
        let mut rows = None;
        let mut row_bytes = 0;
        let mut buffers = Vec::new();
        let mut row_buffers = Vec::new();
        let mut args = Vec::new();
        for (array, input) in arrays.iter().zip(&program.inputs) {
            let width = match array.data_type() {
                DataType::Boolean => None,
                t => Some(t.primitive_width().ok_or_else(|| {
                    exec_error(format!("the generated program cannot read {t} columns"))
                })?),
            };
            let column = ColumnBuffers::of(array.as_ref(), width)?;
            let mut parts = Vec::new();
            column.parts(&mut parts);
            let mut addresses = Vec::new();
            for group in &parts {
                let bytes: usize = group.iter().map(|p| p.len()).sum();
                let buffer = engine
                    .device()
                    .pool
                    .alloc(bytes.max(1), engine.stream())
                    .map_err(gpu_error)?;
                let mut offset = 0;
                for part in group {
                    engine
                        .upload_bytes(part, buffer.ptr() + offset as u64)
                        .map_err(gpu_error)?;
                    offset += part.len();
                }
                if !input.per_dictionary_entry() {
                    row_bytes += bytes;
                    row_buffers.push((buffer.ptr(), bytes));
                }
                addresses.push(buffer.ptr());
                buffers.push(buffer);
            }
            args.extend(column.addresses(&mut addresses.into_iter()));
            if !input.per_dictionary_entry() {
                match rows {
                    None => rows = Some(array.len()),
                    Some(n) if n != array.len() => {
                        return Err(exec_error(format!(
                            "the program's inputs have {n} and {} rows",
                            array.len()
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        engine.synchronize().map_err(gpu_error)?;
        Ok(Self {
            _buffers: buffers,
            args,
            rows: rows.unwrap_or(0),
            row_bytes,
            row_buffers,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes a pass over every row reads: the read floor's size.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The per-row inputs' device buffers (address, bytes), e.g. to time a read of them.
    pub fn row_buffers(&self) -> &[(u64, usize)] {
        &self.row_buffers
    }

    /// The top `k` rows (positions, in output order) and how the selection went: with
    /// `sample_rows` > 0 (the fused selection, [`FUSED_SAMPLE_ROWS`] by default) the sampled
    /// threshold runs inside the program's pass, with 0 the program writes every passing row
    /// and the selection follows ([`TopKEngine::fused_select`]). An error flag raised by the
    /// program becomes the error the streaming path reports.
    pub fn top_k(
        &self,
        engine: &mut TopKEngine,
        kernel: &GeneratedKernel,
        k: usize,
        algorithm: DeviceAlgorithm,
        sample_rows: usize,
    ) -> Result<(Vec<u64>, FusedReport)> {
        let (sorted, m, report) = self.run(engine, kernel, k, algorithm, sample_rows)?;
        let ids = engine.download_ids(&sorted, m).map_err(gpu_error)?;
        Ok((ids, report))
    }

    /// The selection of [`top_k`](Self::top_k) without reading its result back (for timing:
    /// the host waits only where the selection itself does): the sorted pairs on the device,
    /// how many of them are the result, and the report.
    pub fn run(
        &self,
        engine: &mut TopKEngine,
        kernel: &GeneratedKernel,
        k: usize,
        algorithm: DeviceAlgorithm,
        sample_rows: usize,
    ) -> Result<(DevicePairs, usize, FusedReport)> {
        let (sorted, m, report) = engine
            .fused_select(kernel, &self.args, self.rows, k, algorithm, sample_rows)
            .map_err(gpu_error)?;
        program_error(report.error)?;
        Ok((sorted, m, report))
    }
}

// ---- A whole table, its columns kept in the column cache -------------------------------------

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
    pub image: Image,
    /// The column as Parquet pages to decode on the device, instead of chunks (a column of
    /// Parquet files the cache does not hold; its values image only).
    pub encoded: Option<Arc<EncodedColumn>>,
}

impl TableInput<'_> {
    /// Whether the column's rows are given (as chunks or pages), not only its identity.
    fn given(&self) -> bool {
        !self.chunks.is_empty() || self.encoded.is_some()
    }

    /// The pieces the column comes in (the cache listing's chunks).
    fn pieces(&self) -> usize {
        match &self.encoded {
            Some(encoded) => encoded.chunk_count,
            None => self.chunks.len(),
        }
    }
}

/// The device image of a column that a program input reads, each its own cache entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Image {
    /// The column's values (and validity), as its Arrow buffers hold them.
    #[default]
    Values,
    /// A string or binary column's prefix words, 16 bytes a row
    /// ([`KernelInput::StringPrefix`]), not the strings.
    Prefix,
    /// A string column's row ends (i64) and bytes ([`KernelInput::StringColumn`]).
    Strings,
}

impl Image {
    /// The image a program input reads; `None` for inputs that are no column.
    pub fn of(input: &KernelInput) -> Option<(usize, Self)> {
        match input {
            KernelInput::Column(c) | KernelInput::DictionaryCodes(c) => Some((*c, Image::Values)),
            KernelInput::StringPrefix(c) => Some((*c, Image::Prefix)),
            KernelInput::StringColumn(c) => Some((*c, Image::Strings)),
            KernelInput::HostPredicate | KernelInput::DictionaryMatch { .. } => None,
        }
    }

    /// The cache key of this image of the column whose key is `key`.
    pub fn key(self, key: CacheKey) -> CacheKey {
        match self {
            Image::Values => key,
            Image::Prefix => prefix_key(key),
            Image::Strings => strings_key(key),
        }
    }

    /// Device bytes a row of the image takes besides a string column's bytes (`None`:
    /// bit-packed booleans) for a column of `data_type`.
    pub fn row_bytes(self, data_type: &DataType) -> Option<usize> {
        match self {
            Image::Values => data_type.primitive_width(),
            Image::Prefix => Some(PREFIX_BYTES),
            Image::Strings => Some(STRING_END_BYTES),
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

/// What [`TableSelector::select`] found.
#[derive(Debug)]
pub struct TableSelection {
    /// The winners' positions in the table (all batches back to back), in output order; with
    /// `refine`, the candidates (in no order) that hold them, to be ranked by their whole keys.
    pub positions: Vec<u64>,
    /// Whether `positions` are a prefix layout's candidates: every row whose composite is at
    /// most the k-th's (all passing rows where fewer than k passed).
    pub refine: bool,
    /// Candidates besides the k-th whose composite equals its: the ties the whole keys settle.
    pub tied: usize,
    /// A per-group selection's pairs sorted (all that passed, or fewer:
    /// [`crate::device::GroupAlgorithm`]).
    pub sorted: usize,
    /// A per-group selection's device phases in ms ([`crate::device::FusedReport`]).
    pub group_phases_ms: [f32; 3],
    /// Rows that passed the predicate.
    pub passed: usize,
    /// Time spent compiling or loading the generated program.
    pub compile_time: std::time::Duration,
    /// A per-group selection's: each position's rank in its group (empty for a top-k).
    pub ranks: Vec<u64>,
    /// A per-group selection's rows kept.
    pub kept: usize,
}

/// Where a per-group selection sends its kept rows' columns: the program inputs (indices
/// into its inputs: per-row columns of fixed-width values) whose values the kept rows take on
/// the device, and the consumer of each piece read back, in the kept rows' order.
pub struct GroupRows<'s> {
    pub inputs: Vec<usize>,
    /// Whether the kept rows' ranks come back too.
    pub ranks: bool,
    /// Most bytes of read-back pieces the sink may keep as they are ([`KeptPiece::buffer`]).
    pub lend: usize,
    pub sink: &'s mut dyn FnMut(KeptPiece<'_>) -> Result<()>,
}

/// What a selection over a whole table computes after the generated program's pass.
#[derive(Debug, Clone, Copy)]
enum TableStep {
    /// The k best rows, by this algorithm, of the first `within` rows (all where `None`):
    /// the caller knows that no row after them passes the filter.
    TopK {
        algorithm: DeviceAlgorithm,
        within: Option<usize>,
    },
    /// The k best rows of every group, the group keys from composite bit `lo` up.
    Groups(GroupSpec),
}

/// The values buffer of a primitive array, sliced to its rows.
fn primitive_values(array: &dyn Array) -> Option<&Buffer> {
    downcast_primitive_array!(
        array => Some(array.values().inner()),
        _ => None
    )
}

/// One per-row input's device image, and its key in the column cache.
struct TableColumn<'i, 'a> {
    input: &'i TableInput<'a>,
    /// Bytes per value; `None`: bit-packed booleans.
    width: Option<usize>,
    key: CacheKey,
    rows: usize,
    /// Whether any chunk holds NULLs (the image then has a validity bitmap).
    nullable: bool,
    /// A strings image's bytes (0 where the chunks are not given), counted where needed: a
    /// hit does not (over views, counting reads every row's view).
    data_bytes: std::cell::OnceCell<usize>,
}

impl<'i, 'a> TableColumn<'i, 'a> {
    fn new(input: &'i TableInput<'a>) -> Result<Self> {
        let data_type = match (&input.identity, input.chunks.first()) {
            (Some(known), _) => known.data_type.clone(),
            (None, Some(chunk)) => chunk.data_type().clone(),
            (None, None) => DataType::Null,
        };
        let width = match &data_type {
            t if input.image == Image::Prefix => {
                if !crate::keys::has_prefix_words(t) {
                    return Err(exec_error(format!("no prefix words of {t} columns")));
                }
                Some(PREFIX_BYTES)
            }
            t if input.image == Image::Strings => {
                if !crate::fusion::is_device_string(t) {
                    return Err(exec_error(format!("no string image of {t} columns")));
                }
                Some(STRING_END_BYTES)
            }
            DataType::Boolean => None,
            t => Some(t.primitive_width().ok_or_else(|| {
                exec_error(format!("the generated program cannot read {t} columns"))
            })?),
        };
        let data_bytes = std::cell::OnceCell::new();
        if let Some(known) = &input.identity {
            return Ok(Self {
                input,
                width,
                key: input.image.key(known.key.clone()),
                rows: known.rows,
                nullable: known.nullable,
                data_bytes,
            });
        }
        // Per chunk: its values' address and extent, and its validity's (0: no NULLs). The
        // values alone do not tell whether a chunk has NULLs (arrays may share values).
        let mut key = Vec::with_capacity(2 * input.chunks.len());
        let (mut rows, mut nullable) = (0, false);
        for chunk in input.chunks.iter() {
            let chunk = chunk.as_ref();
            let n = chunk.len();
            let mismatch = || {
                exec_error(format!(
                    "a table column of {data_type} and {} chunks",
                    chunk.data_type()
                ))
            };
            let validity = chunk.nulls().filter(|v| v.null_count() > 0);
            // A dictionary's rows are also NULL where their values are.
            nullable |= validity.is_some() || chunk.logical_null_count() > 0;
            rows += n;
            if input.image != Image::Values {
                // The strings' every buffer (offsets or views, and the bytes; a dictionary's
                // values too), and where the array starts in them.
                let data = chunk.to_data();
                if data.data_type() != &data_type {
                    return Err(mismatch());
                }
                key.push((data.offset(), n));
                key.extend(
                    buffers(&data)
                        .iter()
                        .map(|b| (b.as_ptr() as usize, b.len())),
                );
            }
            key.push(match width {
                _ if input.image != Image::Values => (0, 0),
                Some(_) => {
                    let values = primitive_values(chunk).ok_or_else(mismatch)?;
                    (values.as_ptr() as usize, values.len())
                }
                None => {
                    let bits = chunk.as_boolean_opt().ok_or_else(mismatch)?.values();
                    (bits.inner().as_ptr() as usize, (bits.offset() << 32) | n)
                }
            });
            key.push(match validity {
                Some(validity) => {
                    let bits = validity.inner();
                    (bits.inner().as_ptr() as usize, (bits.offset() << 32) | n)
                }
                None => (0, n),
            });
        }
        Ok(Self {
            input,
            width,
            key: input.image.key(key),
            rows,
            nullable,
            data_bytes,
        })
    }

    /// Whether the column is uploaded for one selection only ([`Identity::transient`]).
    fn transient(&self) -> bool {
        self.input.identity.as_ref().is_some_and(|i| i.transient)
    }

    /// Bytes of the per-row values, a strings image's bytes not included.
    fn row_bytes(&self) -> usize {
        match self.width {
            Some(width) => self.rows * width,
            None => self.rows.div_ceil(8),
        }
    }

    /// A strings image's bytes (0 for other images).
    fn data_bytes(&self) -> usize {
        *self.data_bytes.get_or_init(|| match self.input.image {
            Image::Strings => (self.input.chunks.iter())
                .map(|c| string_data_len(c.as_ref()))
                .sum(),
            _ => 0,
        })
    }

    /// Bytes of the per-row values, a strings image's bytes included.
    fn values_bytes(&self) -> usize {
        self.row_bytes() + self.data_bytes()
    }

    /// Device bytes of the image and where its parts start: the values, then the validity
    /// bitmap at an aligned offset; a strings image's values are its row ends, and its
    /// bytes come last, at an aligned offset.
    fn layout(&self) -> (usize, Vec<usize>) {
        let align = |bytes: usize| bytes.div_ceil(TABLE_ALIGN) * TABLE_ALIGN;
        let values = align(self.row_bytes());
        let mut offsets = vec![0];
        let mut end = values;
        if self.nullable {
            // Whole 32-bit words: the device sets validity bits a word at a time.
            offsets.push(values);
            end = values + self.rows.div_ceil(32) * 4;
        }
        if self.input.image == Image::Strings {
            let at = align(end);
            offsets.push(at);
            end = at + self.data_bytes();
        }
        (end.max(TABLE_ALIGN), offsets)
    }

    /// The host buffers the key's addresses belong to (none for a table known by identity).
    fn owners(&self) -> Vec<Buffer> {
        if self.input.identity.is_some() {
            return Vec::new();
        }
        let mut owners = Vec::with_capacity(2 * self.input.chunks.len());
        for chunk in self.input.chunks.iter() {
            let chunk = chunk.as_ref();
            match self.width {
                _ if self.input.image != Image::Values => owners.extend(buffers(&chunk.to_data())),
                Some(_) => owners.extend(primitive_values(chunk).cloned()),
                None => owners.extend(chunk.as_boolean_opt().map(|b| b.values().inner().clone())),
            }
            if let Some(validity) = chunk.nulls() {
                owners.push(validity.inner().inner().clone());
            }
        }
        owners
    }

    /// Uploads the image to `dst`: fixed-width values straight from the chunks' buffers,
    /// bit-packed values and validity repacked into one bitmap first.
    fn upload(&self, engine: &mut TopKEngine, dst: u64, offsets: &[usize]) -> GpuResult<()> {
        if let Some(encoded) = &self.input.encoded {
            if self.input.image != Image::Values || self.width != Some(encoded.width) {
                return Err(GpuError(format!(
                    "no device decode of Parquet pages into the {:?} image of {:?}-byte values",
                    self.input.image, self.width
                )));
            }
            let validity = if self.nullable {
                dst + offsets[1] as u64
            } else {
                0
            };
            return engine.decode_pages(encoded, dst, validity);
        }
        let bitmap = |bits: &dyn Fn(&dyn Array, &mut BooleanBufferBuilder)| {
            let mut builder = BooleanBufferBuilder::new(self.rows);
            for chunk in self.input.chunks.iter() {
                bits(chunk.as_ref(), &mut builder);
            }
            builder.finish()
        };
        let mut bitmaps = Vec::new();
        let mut parts: Vec<(usize, &[u8])> = Vec::with_capacity(self.input.chunks.len() + 1);
        match self.width {
            _ if self.input.image == Image::Strings => {
                // A window of chunks at a time: their row ends (counted from the bytes before
                // them) in one upload, their bytes in another.
                let (mut row, mut byte) = (0usize, 0usize);
                for window in prefix_windows(&self.input.chunks) {
                    // Each chunk's row ends count from the bytes of the chunks before it.
                    let mut bases = Vec::with_capacity(window.len());
                    let mut window_bytes = 0;
                    for chunk in window {
                        bases.push((byte + window_bytes) as i64);
                        window_bytes += string_data_len(chunk.as_ref());
                    }
                    let converted =
                        on_cores(window.iter().zip(bases).collect(), |(chunk, base)| {
                            let ends = string_ends(chunk.as_ref(), base)?;
                            let bytes = string_bytes(chunk.as_ref())
                                .map_err(|e| GpuError(e.to_string()))?;
                            Ok((ends, bytes))
                        })?;
                    let mut ends = Vec::with_capacity(window.iter().map(|c| c.len()).sum());
                    let mut data = Vec::with_capacity(window.len());
                    for (chunk_ends, bytes) in converted {
                        ends.extend(chunk_ends);
                        data.push(bytes);
                    }
                    let ends = Buffer::from_vec(ends);
                    let at = dst + (row * STRING_END_BYTES) as u64;
                    engine.upload_image(&[(0, ends.as_slice())], ends.len(), at)?;
                    let parts: Vec<(usize, &[u8])> = (data.iter())
                        .scan(0, |at, bytes| {
                            let part = (*at, bytes.as_ref());
                            *at += bytes.len();
                            Some(part)
                        })
                        .collect();
                    let at = offsets[offsets.len() - 1] + byte;
                    engine.upload_image(&parts, window_bytes, dst + at as u64)?;
                    row += ends.len() / STRING_END_BYTES;
                    byte += window_bytes;
                }
                return self.upload_validity(engine, dst, offsets);
            }
            _ if self.input.image == Image::Prefix => {
                // Derived by the host's cores a window of chunks at a time, each window
                // shipped before the next is derived.
                let mut at = 0;
                for window in prefix_windows(&self.input.chunks) {
                    let bytes = derive_prefix_words(window)?;
                    engine.upload_image(&[(0, &bytes)], bytes.len(), dst + at as u64)?;
                    at += bytes.len();
                }
                return self.upload_validity(engine, dst, offsets);
            }
            Some(_) => {
                let mut at = 0;
                for chunk in self.input.chunks.iter() {
                    // `new` checked that every chunk is primitive.
                    if let Some(values) = primitive_values(chunk.as_ref()) {
                        parts.push((at, values.as_slice()));
                        at += values.len();
                    }
                }
            }
            None => bitmaps.push((
                0,
                bitmap(&|chunk, b| {
                    if let Some(bits) = chunk.as_boolean_opt() {
                        b.append_buffer(bits.values());
                    }
                }),
            )),
        }
        if self.nullable {
            bitmaps.push((offsets[1], self.validity()));
        }
        parts.extend(bitmaps.iter().map(|(at, bits)| (*at, bits.values())));
        let total = parts.iter().map(|(at, p)| at + p.len()).max().unwrap_or(0);
        engine.upload_image(&parts, total, dst)
    }

    /// The chunks' validity as one bitmap (all valid where a chunk has none).
    fn validity(&self) -> datafusion::arrow::buffer::BooleanBuffer {
        let mut builder = BooleanBufferBuilder::new(self.rows);
        for chunk in self.input.chunks.iter() {
            match chunk.logical_nulls() {
                Some(validity) => builder.append_buffer(validity.inner()),
                None => builder.append_n(chunk.len(), true),
            }
        }
        builder.finish()
    }

    /// Uploads the validity bitmap, where the image at `dst` has one (at `offsets[1]`).
    fn upload_validity(
        &self,
        engine: &mut TopKEngine,
        dst: u64,
        offsets: &[usize],
    ) -> GpuResult<()> {
        if !self.nullable {
            return Ok(());
        }
        let validity = self.validity();
        let bits = validity.values();
        engine.upload_image(&[(0, bits)], bits.len(), dst + offsets[1] as u64)
    }

    /// The kernel's four arguments for the image at `addresses` (values, then the validity
    /// bitmap where the image has one; a strings image's bytes last, passed second).
    fn args(&self, addresses: &[u64]) -> [u64; 4] {
        if self.input.image == Image::Strings {
            let validity = if addresses.len() == 3 {
                addresses[1]
            } else {
                0
            };
            return [addresses[0], addresses[addresses.len() - 1], validity, 0];
        }
        [addresses[0], 0, addresses.get(1).copied().unwrap_or(0), 0]
    }
}

/// The share of the bytes of `inputs`' per-row columns that the column cache holds.
pub fn resident_share(device: &GpuDevice, inputs: &[TableInput<'_>]) -> f64 {
    let columns = (inputs.iter().filter(|i| i.lookup.is_none()))
        .filter_map(|input| TableColumn::new(input).ok())
        .map(|column| (column.row_bytes(), column.key));
    resident_share_of(device, columns)
}

/// The share of the bytes of `columns` (bytes, cache key) that the column cache holds.
pub fn resident_share_of(
    device: &GpuDevice,
    columns: impl IntoIterator<Item = (usize, CacheKey)>,
) -> f64 {
    let (mut held, mut total) = (0, 0);
    for (bytes, key) in columns {
        total += bytes;
        if device.column_cache.contains(&key) {
            held += bytes;
        }
    }
    if total == 0 {
        0.0
    } else {
        held as f64 / total as f64
    }
}

/// The chunk zones of a per-row input whose values the column cache holds: each chunk's least
/// and greatest value, NULLs and rows, kept with the entry. The first ask starts working them
/// out on one thread of its own (a pass over the column) and the query goes on without them.
/// `None` until then, where the cache does not hold the column, the input comes without its
/// chunks, or its type is not an integer, decimal or temporal one (floats' NaNs and signed
/// zeros are left to the pass).
pub fn chunk_zones(device: &GpuDevice, input: &TableInput<'_>) -> Option<Arc<ChunkZones>> {
    let first = input.chunks.first()?;
    if input.image != Image::Values || input.lookup.is_some() || !has_zones(first.data_type()) {
        return None;
    }
    let key = TableColumn::new(input).ok()?.key;
    device.column_cache.zones(&key, |slot| {
        let chunks = input.chunks.to_vec();
        let spawned = std::thread::Builder::new()
            .name("gpu-topk-zones".into())
            .spawn(move || slot.fill(derive_zones(&chunks).ok()));
        if let Err(e) = spawned {
            log::warn!("cannot start working out chunk zones: {e}");
        }
    })
}

/// Whether columns of `data_type` have zones: integer, decimal and temporal ones, ordered as
/// their values (floats' NaNs and signed zeros are left to the pass).
pub(crate) fn has_zones(data_type: &DataType) -> bool {
    data_type.is_integer()
        || data_type.is_temporal()
        || matches!(
            data_type,
            DataType::Decimal32(..)
                | DataType::Decimal64(..)
                | DataType::Decimal128(..)
                | DataType::Decimal256(..)
        )
}

/// [`ChunkZones`] of `chunks`, on the calling thread: they are worked out in the background,
/// where all cores would slow the queries running meanwhile.
pub(crate) fn derive_zones(chunks: &[ArrayRef]) -> Result<ChunkZones> {
    use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
    use datafusion::logical_expr::Accumulator;
    let zone = |chunk: &ArrayRef| -> Result<_> {
        let mut min = MinAccumulator::try_new(chunk.data_type())?;
        let mut max = MaxAccumulator::try_new(chunk.data_type())?;
        min.update_batch(std::slice::from_ref(chunk))?;
        max.update_batch(std::slice::from_ref(chunk))?;
        Ok((min.evaluate()?, max.evaluate()?, chunk.null_count() as u64))
    };
    let (mut mins, mut maxs, mut nulls) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in chunks {
        let (min, max, null) = zone(chunk)?;
        mins.push(min);
        maxs.push(max);
        nulls.push(null);
    }
    let rows = chunks.iter().map(|c| c.len() as u64);
    Ok(ChunkZones {
        mins: datafusion::common::ScalarValue::iter_to_array(mins)?,
        maxs: datafusion::common::ScalarValue::iter_to_array(maxs)?,
        nulls: Arc::new(datafusion::arrow::array::UInt64Array::from(nulls)),
        rows: Arc::new(datafusion::arrow::array::UInt64Array::from_iter_values(
            rows,
        )),
    })
}

/// Uploads one table column (a `GpuTable`'s, known by identity) into the column cache and pins
/// it there; returns its device bytes. A column already cached is pinned where it is.
pub fn pin_column(device: &Arc<GpuDevice>, input: &TableInput<'_>) -> Result<usize> {
    load_column(device, input, true)?.ok_or_else(|| {
        gpu_error(GpuError(format!(
            "cannot reserve room for column {} in the column cache",
            input.name
        )))
    })
}

/// Uploads one table column into the column cache (`pinned`: never evicted while its table
/// pins it, and bounded by no budget) unless it is there; returns its device bytes, `None`
/// where it does not fit the cache's budget.
fn load_column(
    device: &Arc<GpuDevice>,
    input: &TableInput<'_>,
    pinned: bool,
) -> Result<Option<usize>> {
    let column = TableColumn::new(input)?;
    if column.rows == 0 {
        return Ok(Some(0));
    }
    if pinned && let Some(bytes) = device.column_cache.pin(&column.key) {
        return Ok(Some(bytes));
    }
    let (bytes, offsets) = column.layout();
    if !pinned && device.column_cache.contains(&column.key) {
        return Ok(Some(bytes));
    }
    if !input.given() {
        return Ok(None);
    }
    let reserved = match pinned {
        true => device.column_cache.reserve_pinned(bytes),
        false => device.column_cache.reserve(bytes),
    };
    if !reserved {
        return Ok(None);
    }
    let mut reserved = Reserved { device, bytes };
    let buffer = contain_panics(|| -> GpuResult<PooledBuffer> {
        let mut engine = TopKEngine::new(device, crate::device::KeyWidth::W64)?;
        let buffer = device.pool.alloc(bytes, engine.stream())?;
        column.upload(&mut engine, buffer.ptr(), &offsets)?;
        engine.synchronize()?;
        Ok(buffer)
    })
    .unwrap_or_else(|panic| Err(GpuError(format!("the CUDA bindings panicked: {panic}"))))
    .map_err(gpu_error)?;
    let entry = NewEntry {
        buffer,
        offsets,
        owners: column.owners(),
        column: input.name.clone(),
        chunks: input.pieces(),
        pinned,
    };
    device.column_cache.insert(column.key.clone(), entry);
    reserved.filled(bytes);
    Ok(Some(bytes))
}

/// Alignment of a table image's validity bitmap.
const TABLE_ALIGN: usize = 256;

/// Bytes a row of a string column's prefix words take on the device.
pub(crate) const PREFIX_BYTES: usize = crate::keys::PREFIX_WORD_BYTES;

/// Bytes of a row's end offset in a string column's bytes image.
pub(crate) const STRING_END_BYTES: usize = 8;

/// The bytes of a string chunk's rows, back to back (borrowed where the array holds them so).
fn string_bytes(chunk: &dyn Array) -> Result<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
    ) -> Cow<'_, [u8]> {
        let offsets = strings.value_offsets();
        let (start, end) = (offsets[0].as_usize(), offsets[offsets.len() - 1].as_usize());
        Cow::Borrowed(&strings.value_data()[start..end])
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        return Ok(of_offsets(strings));
    }
    if let Some(strings) = chunk.as_string_opt::<i64>() {
        return Ok(of_offsets(strings));
    }
    if let Some(views) = chunk.as_string_view_opt() {
        // A NULL row's view need not be an empty string's: it takes no bytes.
        let mut bytes = Vec::with_capacity(string_data_len(chunk));
        for i in (0..views.len()).filter(|&i| views.is_valid(i)) {
            bytes.extend_from_slice(views.value(i).as_bytes());
        }
        return Ok(Cow::Owned(bytes));
    }
    Err(exec_error(format!(
        "no string image of {} columns",
        chunk.data_type()
    )))
}

/// Bytes of a string chunk's rows (what [`string_bytes`] gives), without copying them.
fn string_data_len(chunk: &dyn Array) -> usize {
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
    ) -> usize {
        let offsets = strings.value_offsets();
        offsets[offsets.len() - 1].as_usize() - offsets[0].as_usize()
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        of_offsets(strings)
    } else if let Some(strings) = chunk.as_string_opt::<i64>() {
        of_offsets(strings)
    } else if let Some(views) = chunk.as_string_view_opt() {
        (0..views.len())
            .filter(|&i| views.is_valid(i))
            .map(|i| views.views()[i] as u32 as usize)
            .sum()
    } else {
        0
    }
}

/// A string chunk's row ends, each from `base` (the bytes of the rows before the chunk).
fn string_ends(chunk: &dyn Array, base: i64) -> GpuResult<Vec<i64>> {
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
        base: i64,
    ) -> Vec<i64> {
        let offsets = strings.value_offsets();
        let start = offsets[0].as_usize() as i64;
        (offsets[1..].iter())
            .map(|o| base + o.as_usize() as i64 - start)
            .collect()
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        return Ok(of_offsets(strings, base));
    }
    if let Some(strings) = chunk.as_string_opt::<i64>() {
        return Ok(of_offsets(strings, base));
    }
    if let Some(views) = chunk.as_string_view_opt() {
        let mut end = base;
        return Ok((views.views().iter().enumerate())
            .map(|(i, view)| {
                if views.is_valid(i) {
                    end += (*view as u32) as i64;
                }
                end
            })
            .collect());
    }
    Err(GpuError(format!(
        "no string image of {} columns",
        chunk.data_type()
    )))
}

/// Rows of string chunks whose prefix words (or row ends) are derived at once (at least one
/// chunk).
const PREFIX_WINDOW_ROWS: usize = 1 << 23;

/// `chunks` in consecutive windows of about [`PREFIX_WINDOW_ROWS`] rows.
fn prefix_windows(chunks: &[ArrayRef]) -> Vec<&[ArrayRef]> {
    let mut windows = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, chunk) in chunks.iter().enumerate() {
        if rows > 0 && rows + chunk.len() > PREFIX_WINDOW_ROWS {
            windows.push(&chunks[start..i]);
            (start, rows) = (i, 0);
        }
        rows += chunk.len();
    }
    if start < chunks.len() {
        windows.push(&chunks[start..]);
    }
    windows
}

/// Every buffer of `data` and of its children, validity bitmaps of the children included (a
/// dictionary's values and their NULLs are part of what its rows read).
fn buffers(data: &datafusion::arrow::array::ArrayData) -> Vec<Buffer> {
    let mut all = data.buffers().to_vec();
    for child in data.child_data() {
        all.extend(child.nulls().map(|n| n.inner().inner().clone()));
        all.extend(buffers(child));
    }
    all
}

/// `f` of each item, in order, the items spread over up to one thread a core: deriving
/// prefix words, gathering strings' row ends and bytes (`Utf8View` bytes row by row), and
/// the rows a per-group selection kept.
pub(crate) fn on_cores<T: Send, R: Send>(
    items: Vec<T>,
    f: impl Fn(T) -> GpuResult<R> + Sync,
) -> GpuResult<Vec<R>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len().max(1));
    if threads <= 1 {
        return items.into_iter().map(f).collect();
    }
    let mut shares: Vec<Vec<(usize, T)>> = (0..threads).map(|_| Vec::new()).collect();
    let n = items.len();
    for (i, item) in items.into_iter().enumerate() {
        shares[i % threads].push((i, item));
    }
    let f = &f;
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|scope| {
        let running: Vec<_> = (shares.into_iter())
            .map(|share| {
                scope.spawn(move || -> GpuResult<Vec<(usize, R)>> {
                    share
                        .into_iter()
                        .map(|(i, item)| Ok((i, f(item)?)))
                        .collect()
                })
            })
            .collect();
        for thread in running {
            let done = thread.join().unwrap_or_else(|_| {
                Err(GpuError(
                    "a host thread deriving a column image panicked".into(),
                ))
            })?;
            for (i, r) in done {
                results[i] = Some(r);
            }
        }
        Ok::<_, GpuError>(())
    })?;
    Ok(results
        .into_iter()
        .map(|r| r.expect("every item done"))
        .collect())
}

/// The prefix words of `chunks`, back to back, derived on up to one thread a core.
fn derive_prefix_words(chunks: &[ArrayRef]) -> GpuResult<Vec<u8>> {
    let rows: usize = chunks.iter().map(|c| c.len()).sum();
    let mut bytes = vec![0u8; rows * PREFIX_BYTES];
    // Pieces of at most 2^20 rows (slices share the chunk's buffers), so that a window of
    // few large chunks still spreads over the threads.
    let pieces: Vec<ArrayRef> = (chunks.iter())
        .flat_map(|c| {
            (0..c.len())
                .step_by(1 << 20)
                .map(|at| c.slice(at, (c.len() - at).min(1 << 20)))
        })
        .collect();
    let mut slots = Vec::with_capacity(pieces.len());
    let mut rest = bytes.as_mut_slice();
    for piece in &pieces {
        let (slot, tail) = rest.split_at_mut(piece.len() * PREFIX_BYTES);
        slots.push((piece, slot));
        rest = tail;
    }
    on_cores(slots, |(piece, slot)| {
        crate::keys::write_prefix_words(piece.as_ref(), slot).map_err(|e| GpuError(e.to_string()))
    })?;
    Ok(bytes)
}

/// The selection over a whole table (see the module documentation), built by
/// [`super::create_selector`] for a plan over a whole table.
#[derive(Debug)]
pub struct TableSelector {
    spec: SelectionSpec,
    device: Arc<GpuDevice>,
    algorithm: DeviceAlgorithm,
}

impl TableSelector {
    pub(crate) fn new(
        spec: &SelectionSpec,
        device: Arc<GpuDevice>,
        algorithm: DeviceAlgorithm,
    ) -> Result<Self> {
        if spec.program.is_none() {
            return datafusion::common::internal_err!(
                "a selection over a whole table needs a generated program"
            );
        }
        Ok(Self {
            spec: spec.clone(),
            device,
            algorithm,
        })
    }

    /// E.g. `cuda sample over the whole table (sm_90)`.
    pub fn describe(&self) -> String {
        format!(
            "cuda {} over the whole table ({})",
            self.algorithm.name(),
            self.device.arch()
        )
    }

    /// Holds the cache's entries of `keys` (`None` where it has none) until the returned
    /// uses are dropped: a column found now stays until the selection has read it.
    pub(crate) fn hold(&self, keys: &[CacheKey]) -> Vec<Option<CacheUse>> {
        let cache = &self.device.column_cache;
        keys.iter().map(|key| cache.acquire(key)).collect()
    }

    /// The bytes of columns not yet resident the cache may load: its budget.
    pub fn cache_budget(&self) -> usize {
        self.device.column_cache.budget()
    }

    /// Top-k of the program over the whole table whose columns `inputs` are: the per-row
    /// ones read from the column cache, or uploaded into it on a miss (one entry per column,
    /// the table's batches back to back; an entry keyed by buffers keeps them, so a changed
    /// table misses). One fused selection over all rows, one read-back of the winners'
    /// positions.
    ///
    /// `Ok(None)`: the missing columns do not fit the cache's budget; the caller streams the
    /// table instead. Device failures are [`super::DeviceError`]s (the caller falls back).
    ///
    /// With `within`, only the table's first `within` rows are read: the caller knows that no
    /// later row passes the filter (the chunks' zones say so).
    pub fn select(
        &self,
        inputs: &[TableInput<'_>],
        within: Option<usize>,
    ) -> Result<Option<TableSelection>> {
        let step = TableStep::TopK {
            algorithm: self.algorithm,
            within,
        };
        select_table(&self.spec, &self.device, step, inputs, None)
    }

    /// As [`select`](Self::select), the k best rows of every group instead: the program's
    /// composite holds the group keys from bit `lo` up; the positions come in (group, order
    /// keys, position) order with their ranks ([`TableSelection::ranks`]).
    ///
    /// With `rows_out`, the kept rows' columns are gathered on the device and handed to its
    /// sink in pieces instead (the selection's positions and ranks are then empty).
    pub fn select_groups(
        &self,
        inputs: &[TableInput<'_>],
        groups: GroupSpec,
        rows_out: Option<GroupRows<'_>>,
    ) -> Result<Option<TableSelection>> {
        let step = TableStep::Groups(groups);
        select_table(&self.spec, &self.device, step, inputs, rows_out)
    }
}

/// Loads a table's columns into the column cache in the background, after a run on the CPU
/// path chose not to ship them (a plan's warm-up): one load at a time, each column unpinned
/// and within the budget.
pub struct CacheLoader {
    device: Arc<GpuDevice>,
    _loading: Loading<'static>,
}

/// Loads being handed to the background whose loader is not yet known ([`CacheLoader::spawn`]).
static STARTING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CacheLoader {
    /// Runs `load` in the background with the loader, if there is a GPU and no other load
    /// runs. The device is started there where planning left it unstarted (the query ran on
    /// the CPU path before it could have started), so the query does not wait for it.
    pub fn spawn<F, Fut>(slot: crate::device::DeviceSlot, load: F)
    where
        F: FnOnce(CacheLoader) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        use std::sync::atomic::Ordering;
        STARTING.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let loader = tokio::task::spawn_blocking(move || CacheLoader::start(slot)).await;
            // The loader (if any) marks the cache as loading before this count drops.
            STARTING.fetch_sub(1, Ordering::SeqCst);
            if let Ok(Some(loader)) = loader {
                load(loader).await;
            }
        });
    }

    /// Whether a load runs or is being started.
    pub fn busy() -> bool {
        STARTING.load(std::sync::atomic::Ordering::SeqCst) > 0
            || crate::device::started_gpu().is_some_and(|d| d.column_cache.loading())
    }

    /// The loader of the device in `slot`, where it is usable and no other load runs.
    pub fn start(slot: crate::device::DeviceSlot) -> Option<Self> {
        let device = crate::device::static_gpu_on(slot)?;
        let cache: &'static ColumnCache = &device.column_cache;
        let loading = cache.start_loading()?;
        Some(Self {
            device: Arc::clone(device),
            _loading: loading,
        })
    }

    /// Compiles (or loads) the program, so the next run's plan counts no compile.
    pub fn compile(&self, program: &FusedProgram) -> Result<()> {
        self.device
            .generated_kernel(&program.source, fusion::ENTRY)
            .map(drop)
            .map_err(gpu_error)
    }

    /// Whether the cache holds the column known by `key`.
    pub fn is_resident(&self, key: &CacheKey) -> bool {
        self.device.column_cache.contains(key)
    }

    /// Uploads one column unless the cache holds it; `false` where it does not fit the
    /// budget (the load stops there).
    pub fn load(&self, input: &TableInput<'_>) -> Result<bool> {
        Ok(load_column(&self.device, input, false)?.is_some())
    }
}

/// [`TableSelector::select`].
fn select_table(
    spec: &SelectionSpec,
    device: &Arc<GpuDevice>,
    step: TableStep,
    inputs: &[TableInput<'_>],
    rows_out: Option<GroupRows<'_>>,
) -> Result<Option<TableSelection>> {
    let Some(program) = &spec.program else {
        return datafusion::common::internal_err!("a table selection needs a generated program");
    };
    if inputs.len() != program.inputs.len() {
        return Err(exec_error(format!(
            "the program takes {} inputs, got {}",
            program.inputs.len(),
            inputs.len()
        )));
    }
    let _entered = spec.watch.as_ref().map(DeviceWatch::enter);
    let mut columns = Vec::new();
    let mut lookups = Vec::new();
    for input in inputs.iter().filter(|i| i.lookup.is_none()) {
        let column = TableColumn::new(input)?;
        lookups.push(device.column_cache.acquire(&column.key));
        columns.push(column);
    }
    // Columns given in part hold at least the rows the selection reads.
    let within = match step {
        TableStep::TopK { within, .. } => within,
        TableStep::Groups(_) => None,
    };
    let rows = columns.first().map_or(0, |c| c.rows);
    let short = |c: &TableColumn<'_, '_>| match within {
        Some(within) => c.rows < within,
        None => c.rows != rows,
    };
    if let Some(c) = columns.iter().find(|&c| short(c)) {
        return Err(exec_error(format!(
            "the program's inputs have {rows} and {} rows",
            c.rows
        )));
    }
    // Room for the missing columns, or stream.
    let missing: usize = (columns.iter().zip(&lookups))
        .filter(|(_, hit)| hit.is_none())
        .map(|(c, _)| c.layout().0)
        .sum();
    if missing > 0 && !device.column_cache.reserve(missing) {
        return Ok(None);
    }
    let mut reserved = Reserved {
        device,
        bytes: missing,
    };
    let result = contain_panics(|| {
        run_table(
            spec, device, program, step, inputs, &columns, &lookups, rows_out,
        )
    })
    .unwrap_or_else(|panic| Err(GpuError(format!("the CUDA bindings panicked: {panic}"))))
    .map_err(gpu_error)?;
    let (positions, ranks, tied, report, compile_time, uploaded) = result;
    let kept = match step {
        TableStep::Groups(_) => report.kept,
        TableStep::TopK { .. } => positions.len(),
    };
    let hit_bytes: Vec<usize> = (lookups.iter())
        .map(|hit| hit.as_ref().map_or(0, |h| h.entry().bytes()))
        .collect();
    drop(lookups);
    let mut transfers = (0, 0, 0, 0);
    for ((column, buffer), hit_bytes) in columns.iter().zip(uploaded).zip(hit_bytes) {
        let bytes = match (buffer.is_some(), &column.input.encoded) {
            (false, _) => hit_bytes,
            (true, Some(encoded)) => encoded.shipped_bytes(),
            (true, None) => column.values_bytes(),
        };
        match buffer {
            None => {
                transfers.0 += 1;
                transfers.2 += bytes;
            }
            Some(_) if column.transient() => {
                transfers.1 += 1;
                transfers.3 += bytes;
            }
            Some((buffer, offsets)) => {
                transfers.1 += 1;
                transfers.3 += bytes;
                let entry_bytes = column.layout().0;
                debug_assert_eq!(buffer.bytes(), entry_bytes);
                let entry = NewEntry {
                    buffer,
                    offsets,
                    owners: column.owners(),
                    column: column.input.name.clone(),
                    chunks: column.input.pieces(),
                    pinned: false,
                };
                device.column_cache.insert(column.key.clone(), entry);
                reserved.filled(entry_bytes);
            }
        }
    }
    drop(reserved);
    spec.transfers.cache_hits.add(transfers.0);
    spec.transfers.cache_misses.add(transfers.1);
    spec.transfers.resident_bytes.add(transfers.2);
    spec.transfers.uploaded_bytes.add(transfers.3);
    program_error(report.error)?;
    let (tied, sorted) = match step {
        TableStep::Groups(_) => (0, tied),
        TableStep::TopK { .. } => (tied, 0),
    };
    Ok(Some(TableSelection {
        positions,
        refine: program.refines,
        tied,
        sorted,
        group_phases_ms: report.group_phases_ms,
        passed: report.passed as usize,
        compile_time,
        ranks,
        kept,
    }))
}

/// The device work of [`select_table`]: the uploads of missing columns (their new buffers,
/// in column order, `None` where resident), the selection and the read-back.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn run_table(
    spec: &SelectionSpec,
    device: &Arc<GpuDevice>,
    program: &FusedProgram,
    step: TableStep,
    inputs: &[TableInput<'_>],
    columns: &[TableColumn<'_, '_>],
    lookups: &[Option<CacheUse>],
    rows_out: Option<GroupRows<'_>>,
) -> GpuResult<(
    Vec<u64>,
    Vec<u64>,
    usize,
    FusedReport,
    std::time::Duration,
    Vec<Option<(PooledBuffer, Vec<usize>)>>,
)> {
    let (kernel, compile_time) = device.generated_kernel(&program.source, fusion::ENTRY)?;
    // Engines outlive the query (they idle for the next): not its memory.
    let mut engine = watch::outside(|| device.engine(program.key_kind))?;
    let upload_started = std::time::Instant::now();
    let mut uploaded = Vec::with_capacity(columns.len());
    let mut column_args = Vec::with_capacity(columns.len());
    for (column, lookup) in columns.iter().zip(lookups) {
        match lookup {
            Some(hit) => {
                column_args.push(column.args(&hit.entry().addresses()));
                uploaded.push(None);
            }
            None if !column.input.given() => {
                return Err(GpuError(format!(
                    "column {} is neither cached nor given",
                    column.input.name
                )));
            }
            None => {
                let (bytes, offsets) = column.layout();
                let stream = Arc::clone(engine.stream());
                // The cache's memory, not the query's.
                let buffer = watch::outside(|| device.pool.alloc(bytes, &stream))?;
                column.upload(&mut engine, buffer.ptr(), &offsets)?;
                let addresses: Vec<u64> =
                    offsets.iter().map(|&o| buffer.ptr() + o as u64).collect();
                column_args.push(column.args(&addresses));
                uploaded.push(Some((buffer, offsets)));
            }
        }
    }
    if uploaded.iter().any(Option::is_some) {
        engine.synchronize()?;
        (spec.transfers.upload_time).add_duration(upload_started.elapsed());
    }
    // Per-dictionary-entry inputs: small, shipped with every query.
    let mut lookup_tables = Vec::new();
    let mut args = Vec::with_capacity(4 * inputs.len());
    let mut per_row = column_args.into_iter();
    for input in inputs {
        let Some(array) = &input.lookup else {
            args.extend(per_row.next().expect("one per per-row input"));
            continue;
        };
        let width = match array.data_type() {
            DataType::Boolean => None,
            t => t.primitive_width(),
        };
        let column =
            ColumnBuffers::of(array.as_ref(), width).map_err(|e| GpuError(e.to_string()))?;
        let mut parts = Vec::new();
        column.parts(&mut parts);
        let mut addresses = Vec::new();
        for group in &parts {
            let bytes: usize = group.iter().map(|p| p.len()).sum();
            let buffer = device.pool.alloc(bytes.max(1), engine.stream())?;
            let image: Vec<(usize, &[u8])> = group
                .iter()
                .scan(0, |at, p| {
                    let part = (*at, *p);
                    *at += p.len();
                    Some(part)
                })
                .collect();
            engine.upload_image(&image, bytes, buffer.ptr())?;
            addresses.push(buffer.ptr());
            lookup_tables.push(buffer);
        }
        args.extend(column.addresses(&mut addresses.into_iter()));
    }
    let mut rows = columns.first().map_or(0, |c| c.rows);
    let algorithm = match step {
        TableStep::TopK { algorithm, within } => {
            // The first rows of every column: the program reads them as a shorter table.
            rows = within.map_or(rows, |w| w.min(rows));
            algorithm
        }
        TableStep::Groups(groups) => {
            let mut rows_out = rows_out;
            let mut forward;
            let kept_rows = match &mut rows_out {
                None => None,
                Some(out) => {
                    let columns = gather_columns(inputs, columns, &args, &out.inputs)?;
                    let sink = &mut out.sink;
                    forward = move |piece: KeptPiece<'_>| -> GpuResult<()> {
                        sink(piece).map_err(|e| GpuError(e.to_string()))
                    };
                    Some(KeptRows {
                        columns,
                        ranks: out.ranks,
                        lend: out.lend,
                        sink: &mut forward,
                    })
                }
            };
            let kept = engine.fused_groups(&kernel, &args, rows, groups, spec.k, kept_rows)?;
            drop(lookup_tables);
            engine.synchronize()?;
            device.idle_engine(engine);
            // A per-group selection has no ties to refine: the count is of its pairs sorted.
            let sorted = kept.sorted;
            return Ok((
                kept.ids,
                kept.ranks,
                sorted,
                kept.report,
                compile_time,
                uploaded,
            ));
        }
    };
    let (sorted, m, report) =
        engine.fused_select(&kernel, &args, rows, spec.k, algorithm, FUSED_SAMPLE_ROWS)?;
    let (positions, tied) = if report.error != 0 {
        engine.synchronize()?;
        (Vec::new(), 0)
    } else if program.refines && m == spec.k && m > 0 {
        // A prefix layout's k-th composite may tie rows the selection left out.
        engine.fused_ties(&kernel, &args, rows, &sorted, m - 1)?
    } else {
        (engine.download_ids(&sorted, m)?, 0)
    };
    drop((sorted, lookup_tables));
    engine.synchronize()?;
    device.idle_engine(engine);
    Ok((positions, Vec::new(), tied, report, compile_time, uploaded))
}

/// The device columns of program inputs `wanted` (indices into `inputs`, each a per-row
/// input of fixed-width values; `columns` are the per-row inputs' images, `args` the
/// program's arguments, four an input).
fn gather_columns(
    inputs: &[TableInput<'_>],
    columns: &[TableColumn<'_, '_>],
    args: &[u64],
    wanted: &[usize],
) -> GpuResult<Vec<GatherColumn>> {
    wanted
        .iter()
        .map(|&i| {
            let input = inputs
                .get(i)
                .ok_or_else(|| GpuError(format!("no program input {i} to gather")))?;
            let per_row = inputs[..i].iter().filter(|x| x.lookup.is_none()).count();
            let width = match (input.lookup.is_none(), input.image, columns.get(per_row)) {
                (true, Image::Values, Some(column)) => column.width,
                _ => None,
            };
            let Some(width) = width else {
                return Err(GpuError(format!(
                    "program input {} is no column of fixed-width values",
                    input.name
                )));
            };
            Ok(GatherColumn {
                values: args[4 * i],
                width,
                validity: args[4 * i + 2],
            })
        })
        .collect()
}

/// Room reserved in the column cache for a table selection's new entries; what no entry
/// took is given back.
struct Reserved<'a> {
    device: &'a GpuDevice,
    bytes: usize,
}

impl Reserved<'_> {
    /// An entry of `bytes` took its share.
    fn filled(&mut self, bytes: usize) {
        self.bytes -= bytes.min(self.bytes);
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.device.column_cache.unreserve(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Results come back in the items' order whatever thread ran them, and an item's error
    /// is the call's.
    #[test]
    fn on_cores_keeps_order_and_errors() {
        let items: Vec<u64> = (0..1000).collect();
        let squares = on_cores(items.clone(), |i| Ok(i * i)).unwrap();
        assert_eq!(squares, items.iter().map(|i| i * i).collect::<Vec<_>>());
        let failed = on_cores(items, |i| match i {
            677 => Err(GpuError("item 677".into())),
            i => Ok(i),
        });
        assert_eq!(failed, Err(GpuError("item 677".into())));
        assert_eq!(on_cores(Vec::<u8>::new(), Ok).unwrap(), Vec::<u8>::new());
    }

    /// Prefix words derived in pieces over the cores are those of the whole chunks.
    #[test]
    fn derived_prefix_words_are_each_chunks() {
        use datafusion::arrow::array::StringArray;
        let chunks: Vec<ArrayRef> = (0..5)
            .map(|c| {
                let values: Vec<Option<String>> = (0..(c * 700_001 % 1_500_000))
                    .map(|i| (i % 7 != 3).then(|| format!("{c}-{i:09}-tail")))
                    .collect();
                Arc::new(StringArray::from(values)) as ArrayRef
            })
            .collect();
        let derived = derive_prefix_words(&chunks).unwrap();
        let mut want = Vec::new();
        for chunk in &chunks {
            for w in crate::keys::prefix_words(chunk.as_ref()).unwrap() {
                want.extend_from_slice(&w.to_le_bytes());
            }
        }
        assert_eq!(derived, want);
    }
}
