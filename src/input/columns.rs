//! Column images in the device column cache: a per-row input's image and key, its upload, its
//! pinning, and the share of a program's columns the cache holds.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, BooleanBufferBuilder, downcast_primitive_array};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};

use super::strings::{
    PREFIX_BYTES, STRING_END_BYTES, buffers, derive_prefix_words, on_cores, prefix_windows,
    string_bytes, string_data_len, string_ends,
};
use super::{ColumnImage, TableInput};
use crate::device::column_cache::{CacheKey, NewEntry};
use crate::device::error::gpu_error;
use crate::device::{GpuDevice, GpuError, GpuResult, PooledBuffer, TopKEngine, contain_panics};
use crate::fusion::{self, FusedProgram};

/// Alignment of a table image's validity bitmap.
const TABLE_ALIGN: usize = 256;

/// The values buffer of a primitive array, sliced to its rows.
fn primitive_values(array: &dyn Array) -> Option<&Buffer> {
    downcast_primitive_array!(
        array => Some(array.values().inner()),
        _ => None
    )
}

/// One per-row input's device image, and its key in the column cache.
pub(crate) struct TableColumn<'i, 'a> {
    pub(crate) input: &'i TableInput<'a>,
    /// Bytes per value; `None`: bit-packed booleans.
    pub(crate) width: Option<usize>,
    pub(crate) key: CacheKey,
    pub(crate) rows: usize,
    /// Whether any chunk holds NULLs (the image then has a validity bitmap).
    pub(crate) nullable: bool,
    /// A strings image's bytes (0 where the chunks are not given), counted where needed: a
    /// hit does not (over views, counting reads every row's view).
    pub(crate) data_bytes: std::cell::OnceCell<usize>,
}

impl<'i, 'a> TableColumn<'i, 'a> {
    pub(crate) fn new(input: &'i TableInput<'a>) -> Result<Self> {
        let data_type = match (&input.identity, input.chunks.first()) {
            (Some(known), _) => known.data_type.clone(),
            (None, Some(chunk)) => chunk.data_type().clone(),
            (None, None) => DataType::Null,
        };
        let width = match &data_type {
            t if input.image == ColumnImage::Prefix => {
                if !crate::keys::has_prefix_words(t) {
                    return Err(DataFusionError::Execution(format!(
                        "no prefix words of {t} columns"
                    )));
                }
                Some(PREFIX_BYTES)
            }
            t if input.image == ColumnImage::Codes => {
                if !crate::fusion::is_device_string(t) {
                    return Err(DataFusionError::Execution(format!(
                        "no codes of {t} columns"
                    )));
                }
                Some(8)
            }
            t if input.image == ColumnImage::Strings => {
                if !crate::fusion::is_device_string(t) {
                    return Err(DataFusionError::Execution(format!(
                        "no string image of {t} columns"
                    )));
                }
                Some(STRING_END_BYTES)
            }
            DataType::Boolean => None,
            t => Some(t.primitive_width().ok_or_else(|| {
                DataFusionError::Execution(format!("the generated program cannot read {t} columns"))
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
                DataFusionError::Execution(format!(
                    "a table column of {data_type} and {} chunks",
                    chunk.data_type()
                ))
            };
            let validity = chunk.nulls().filter(|v| v.null_count() > 0);
            // A dictionary's rows are also NULL where their values are.
            nullable |= validity.is_some() || chunk.logical_null_count() > 0;
            rows += n;
            if input.image != ColumnImage::Values {
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
                _ if input.image != ColumnImage::Values => (0, 0),
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
    pub(crate) fn transient(&self) -> bool {
        self.input.identity.as_ref().is_some_and(|i| i.transient)
    }

    /// Bytes of the per-row values, a strings image's bytes not included.
    pub(crate) fn row_bytes(&self) -> usize {
        match self.width {
            Some(width) => self.rows * width,
            None => self.rows.div_ceil(8),
        }
    }

    /// A strings image's bytes (0 for other images).
    pub(crate) fn data_bytes(&self) -> usize {
        *self.data_bytes.get_or_init(|| match self.input.image {
            ColumnImage::Strings => (self.input.chunks.iter())
                .map(|c| string_data_len(c.as_ref()))
                .sum(),
            _ => 0,
        })
    }

    /// Bytes of the per-row values, a strings image's bytes included.
    pub(crate) fn values_bytes(&self) -> usize {
        self.row_bytes() + self.data_bytes()
    }

    /// Device bytes of the image and where its parts start: the values, then the validity
    /// bitmap at an aligned offset; a strings image's values are its row ends, and its
    /// bytes come last, at an aligned offset.
    pub(crate) fn layout(&self) -> (usize, Vec<usize>) {
        let align = |bytes: usize| bytes.div_ceil(TABLE_ALIGN) * TABLE_ALIGN;
        let values = align(self.row_bytes());
        let mut offsets = vec![0];
        let mut end = values;
        if self.nullable {
            // Whole 32-bit words: the device sets validity bits a word at a time.
            offsets.push(values);
            end = values + self.rows.div_ceil(32) * 4;
        }
        if self.input.image == ColumnImage::Strings {
            let at = align(end);
            offsets.push(at);
            end = at + self.data_bytes();
        }
        (end.max(TABLE_ALIGN), offsets)
    }

    /// The host buffers the key's addresses belong to (none for a table known by identity).
    pub(crate) fn owners(&self) -> Vec<Buffer> {
        if self.input.identity.is_some() {
            return Vec::new();
        }
        let mut owners = Vec::with_capacity(2 * self.input.chunks.len());
        for chunk in self.input.chunks.iter() {
            let chunk = chunk.as_ref();
            match self.width {
                _ if self.input.image != ColumnImage::Values => {
                    owners.extend(buffers(&chunk.to_data()))
                }
                Some(_) => owners.extend(primitive_values(chunk).cloned()),
                None => owners.extend(chunk.as_boolean_opt().map(|b| b.values().inner().clone())),
            }
            if let Some(validity) = chunk.nulls() {
                owners.push(validity.inner().inner().clone());
            }
        }
        owners
    }

    /// [`NewEntry::short_bytes`] of the column's image: for a prefix image of given chunks,
    /// the bytes of its prefix words that tell its values apart exactly
    /// ([`super::strings::exact_prefix_bytes`]; one more read of the values, on the cores).
    pub(crate) fn short_bytes(&self) -> Option<u32> {
        (self.input.image == ColumnImage::Prefix && self.input.given())
            .then(|| super::strings::exact_prefix_bytes(&self.input.chunks))
            .flatten()
    }

    /// Uploads the image to `dst`: fixed-width values straight from the chunks' buffers,
    /// bit-packed values and validity repacked into one bitmap first.
    pub(crate) fn upload(
        &self,
        engine: &mut TopKEngine,
        dst: u64,
        offsets: &[usize],
    ) -> GpuResult<()> {
        if let Some(encoded) = &self.input.encoded {
            if self.input.image != ColumnImage::Values || self.width != Some(encoded.width) {
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
            _ if self.input.image == ColumnImage::Strings => {
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
            _ if self.input.image == ColumnImage::Codes => {
                // Interned on the host's cores; the dictionary stays on the host, kept under
                // the image's key for the queries' output.
                let interned = super::codes::intern(&self.input.chunks)
                    .map_err(|e| GpuError(e.to_string()))?;
                super::codes::keep(&self.key, self.owners(), interned.dictionary);
                let codes = Buffer::from_vec(interned.codes);
                engine.upload_image(&[(0, codes.as_slice())], codes.len(), dst)?;
                return self.upload_validity(engine, dst, offsets);
            }
            _ if self.input.image == ColumnImage::Prefix => {
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
    pub(crate) fn validity(&self) -> datafusion::arrow::buffer::BooleanBuffer {
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
    pub(crate) fn upload_validity(
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
    pub(crate) fn args(&self, addresses: &[u64]) -> [u64; 4] {
        if self.input.image == ColumnImage::Strings {
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

/// The share of the bytes a generated program reads from an in-memory input or Parquet files
/// that the device's column cache already holds (the cost model counts no PCIe transfer for
/// them); `None` where the input cannot be read as a whole table.
pub(crate) fn plan_resident_share(
    input: &Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    program: &FusedProgram,
    slot: Option<crate::device::DeviceSlot>,
) -> Option<f64> {
    use crate::device::GpuStatus;
    // A device not started yet holds nothing, and planning does not start it (another of the
    // process's devices opens once the first is started).
    let device = match crate::device::probed_status() {
        Some(GpuStatus::Unavailable(_)) => return None,
        Some(GpuStatus::Available(_)) => crate::device::gpu_on(slot.unwrap_or_default()),
        None => None,
    };
    let device = device.as_ref();
    if let Some(files) = crate::input::parquet::parquet_input(input) {
        // Per-row inputs (a dictionary column's codes are of its key type); the dictionary
        // lookups move nothing per row.
        let columns = (program.inputs.iter())
            .filter(|input| !matches!(input, fusion::KernelInput::DictionaryMatch { .. }))
            .map(|input| {
                let (c, image) =
                    ColumnImage::of(input).filter(|(c, _)| *c < files.columns.len())?;
                let data_type = match (input, files.data_type(c).ok()?) {
                    (
                        fusion::KernelInput::DictionaryCodes(_),
                        datafusion::arrow::datatypes::DataType::Dictionary(key, _),
                    ) => *key,
                    (_, data_type) => data_type,
                };
                let width = image.row_bytes(&data_type).unwrap_or(1);
                Some((width, image.key(files.key(c))))
            })
            .collect::<Option<Vec<_>>>()?;
        return Some(device.map_or(0.0, |d| resident_share_of(d, columns)));
    }
    let memory = crate::input::memory::memory_input(input)?;
    let names: Vec<String> = (input.schema().fields().iter())
        .map(|f| f.name().clone())
        .collect();
    let inputs = crate::input::memory::table_inputs(&memory, program, &names).ok()??;
    Some(device.map_or(0.0, |d| resident_share(d, &inputs)))
}

/// The layout of `specs`, the keys `sort_exprs` of the whole table `input`: byte keys whose
/// prefix images the device holds, with every value short enough to be its own prefix word
/// (or values told apart by their prefix words), are laid out whole, and the keys after them
/// then rank their ties on the device ([`resident_short_bytes`]).
pub(crate) fn resident_layout(
    input: &Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    sort_exprs: &datafusion::physical_expr::LexOrdering,
    specs: Vec<crate::keys::KeySpec>,
    slot: Option<crate::device::DeviceSlot>,
) -> std::result::Result<crate::keys::KeyLayout, String> {
    let byte_columns = byte_key_columns(sort_exprs, &specs);
    let short = match byte_columns.iter().any(Option::is_some) {
        true => resident_short_bytes(input, &byte_columns, slot),
        false => Vec::new(),
    };
    crate::keys::KeyLayout::with_known_bytes(specs, &short)
}

/// Per sort key: the input column of a byte key that is a plain column, else `None`.
fn byte_key_columns(
    sort_exprs: &datafusion::physical_expr::LexOrdering,
    specs: &[crate::keys::KeySpec],
) -> Vec<Option<usize>> {
    use datafusion::physical_expr::expressions::Column;
    (sort_exprs.iter().zip(specs))
        .map(|(sort, spec)| {
            let column = sort.expr.downcast_ref::<Column>()?;
            spec.by_bytes().then(|| column.index())
        })
        .collect()
}

/// What a prefix layout's warm-up loads besides its program's columns: every sort key that is
/// a plain column, a byte key as its prefix image, so that the next plan learns which byte
/// keys are exact (and reads the keys after them) at once; `None` where the layout is exact
/// or no key is a byte column.
pub(crate) fn key_columns_program(
    sort_exprs: &datafusion::physical_expr::LexOrdering,
    layout: &crate::keys::KeyLayout,
) -> Option<FusedProgram> {
    use datafusion::physical_expr::expressions::Column;
    let byte_columns = byte_key_columns(sort_exprs, layout.specs());
    if layout.exact() || byte_columns.iter().all(Option::is_none) {
        return None;
    }
    let inputs = (sort_exprs.iter().zip(&byte_columns))
        .filter_map(|(sort, bytes)| match bytes {
            Some(c) => Some(fusion::KernelInput::StringPrefix(*c)),
            None => Some(fusion::KernelInput::Column(
                sort.expr.downcast_ref::<Column>()?.index(),
            )),
        })
        .collect();
    Some(FusedProgram {
        source: String::new(),
        inputs,
        key_kind: crate::device::KeyWidth::W64,
        refines: false,
    })
}

/// Per entry of `columns` (input column indices, `None` for keys that are no column): where
/// `input` is an in-memory table whose column the device's column cache holds as a prefix
/// image whose words tell its values apart, the bytes of the words that do
/// ([`super::strings::exact_prefix_bytes`]); else `None`. Planning reads it to lay out such a key
/// exactly;
/// the column cache observes the lookups, so a plan made before the image was cached is
/// replaced once it is.
pub(crate) fn resident_short_bytes(
    input: &Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    columns: &[Option<usize>],
    slot: Option<crate::device::DeviceSlot>,
) -> Vec<Option<u32>> {
    let known = || -> Option<Vec<Option<u32>>> {
        let Some(crate::device::GpuStatus::Available(_)) = crate::device::probed_status() else {
            return None;
        };
        let device = crate::device::gpu_on(slot.unwrap_or_default())?;
        let memory = crate::input::memory::memory_input(input)?;
        let names: Vec<String> = (input.schema().fields().iter())
            .map(|f| f.name().clone())
            .collect();
        let short = |c: usize| -> Option<u32> {
            let program = FusedProgram {
                source: String::new(),
                inputs: vec![fusion::KernelInput::StringPrefix(c)],
                key_kind: crate::device::KeyWidth::W64,
                refines: false,
            };
            let inputs = crate::input::memory::table_inputs(&memory, &program, &names).ok()??;
            let column = TableColumn::new(inputs.first()?).ok()?;
            device.column_cache.short_bytes(&column.key)?
        };
        Some(columns.iter().map(|c| c.and_then(short)).collect())
    };
    known().unwrap_or_else(|| vec![None; columns.len()])
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
pub(crate) fn load_column(
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
        short_bytes: column.short_bytes(),
    };
    device.column_cache.insert(column.key.clone(), entry);
    reserved.filled(bytes);
    Ok(Some(bytes))
}

/// Room reserved in the column cache for a table selection's new entries; what no entry
/// took is given back.
pub(crate) struct Reserved<'a> {
    pub(crate) device: &'a GpuDevice,
    pub(crate) bytes: usize,
}

impl Reserved<'_> {
    /// An entry of `bytes` took its share.
    pub(crate) fn filled(&mut self, bytes: usize) {
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
    use std::sync::Arc;

    use datafusion::arrow::datatypes::DataType;
    use datafusion::physical_expr::expressions::{Column, lit};
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};

    use super::key_columns_program;
    use crate::fusion::KernelInput;
    use crate::keys::{KeyLayout, KeySpec};

    fn spec(data_type: DataType) -> KeySpec {
        KeySpec {
            data_type,
            descending: false,
            nulls_first: false,
            nullable: true,
        }
    }

    /// A prefix layout's warm-up reads every plain-column key, byte keys as prefix images; an
    /// exact layout, or one without byte keys, adds nothing.
    #[test]
    fn a_prefix_layouts_warm_up_reads_every_key_column() {
        let sort = |exprs: Vec<Arc<dyn datafusion::physical_expr::PhysicalExpr>>| {
            LexOrdering::new(exprs.into_iter().map(PhysicalSortExpr::new_default)).unwrap()
        };
        let keys = sort(vec![
            Arc::new(Column::new("instr", 2)),
            Arc::new(Column::new("mode", 3)),
            lit(1i64),
            Arc::new(Column::new("okey", 0)),
        ]);
        let specs = vec![
            spec(DataType::Utf8),
            spec(DataType::Utf8),
            spec(DataType::Int64),
            spec(DataType::Int64),
        ];
        let layout = KeyLayout::with_prefixes(specs).unwrap();
        assert!(!layout.exact());
        let program = key_columns_program(&keys, &layout).unwrap();
        assert_eq!(
            program.inputs,
            [
                KernelInput::StringPrefix(2),
                KernelInput::StringPrefix(3),
                KernelInput::Column(0),
            ]
        );
        let fixed = sort(vec![Arc::new(Column::new("okey", 0))]);
        let exact = KeyLayout::with_prefixes(vec![spec(DataType::Int64)]).unwrap();
        assert_eq!(key_columns_program(&fixed, &exact), None);
    }
}
