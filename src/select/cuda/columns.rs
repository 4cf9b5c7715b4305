//! Arrow columns to the device: the raw buffers of key and input columns as the kernels
//! read them (no host-side encoding), staged and uploaded, and the flags a generated
//! program raises read back as errors.

use super::*;

/// The raw Arrow buffers of one column, as the kernels read them.
pub(in crate::select) struct ColumnBuffers {
    /// The values: one slice, or the slices of several chunks staged back to back.
    values: Vec<(Buffer, std::ops::Range<usize>)>,
    /// Bit offset of the first value (bit-packed booleans).
    value_bit_offset: u64,
    /// Validity bytes, their range and bit offset, when the column holds NULLs.
    validity: Option<(Buffer, std::ops::Range<usize>, u64)>,
}

impl ColumnBuffers {
    /// `byte_width` is the value width, `None` for bit-packed booleans.
    pub(in crate::select) fn of(column: &dyn Array, byte_width: Option<usize>) -> Result<Self> {
        let n = column.len();
        let (values, values_range, value_bit_offset) = match byte_width {
            None => {
                let bits = column
                    .as_boolean_opt()
                    .ok_or_else(|| {
                        exec_error(format!(
                            "expected a boolean column, got {}",
                            column.data_type()
                        ))
                    })?
                    .values();
                let offset = bits.offset();
                (
                    bits.inner().clone(),
                    offset / 8..(offset + n).div_ceil(8),
                    (offset % 8) as u64,
                )
            }
            Some(width) => {
                let data: ArrayData = column.to_data();
                let offset = data.offset();
                let buffer = data.buffers().first().cloned().ok_or_else(|| {
                    exec_error(format!("a {} column without values", column.data_type()))
                })?;
                let range = offset * width..(offset + n) * width;
                if buffer.len() < range.end {
                    return Err(exec_error(format!(
                        "a {} column's buffer is shorter than its rows",
                        column.data_type()
                    )));
                }
                (buffer, range, 0)
            }
        };
        let validity = column
            .logical_nulls()
            .filter(|nulls| nulls.null_count() > 0)
            .map(|nulls| {
                let bits = nulls.inner();
                let offset = bits.offset();
                (
                    bits.inner().clone(),
                    offset / 8..(offset + n).div_ceil(8),
                    (offset % 8) as u64,
                )
            });
        Ok(Self {
            values: vec![(values, values_range)],
            value_bit_offset,
            validity,
        })
    }

    /// One column given as consecutive chunks. Fixed-width chunks without NULLs are staged
    /// back to back straight from their buffers; others are concatenated first.
    pub(in crate::select) fn of_chunks(
        chunks: &[ArrayRef],
        byte_width: Option<usize>,
    ) -> Result<Self> {
        let plain = byte_width.is_some()
            && chunks
                .iter()
                .all(|c| c.logical_nulls().is_none_or(|n| n.null_count() == 0));
        match chunks {
            [one] => Self::of(one.as_ref(), byte_width),
            _ if plain => {
                let mut values = Vec::with_capacity(chunks.len());
                for chunk in chunks {
                    values.extend(Self::of(chunk.as_ref(), byte_width)?.values);
                }
                Ok(Self {
                    values,
                    value_bit_offset: 0,
                    validity: None,
                })
            }
            _ => {
                let parts: Vec<&dyn Array> = chunks.iter().map(|c| c.as_ref()).collect();
                let whole = datafusion::arrow::compute::concat(&parts)?;
                Self::of(whole.as_ref(), byte_width)
            }
        }
    }

    /// Adds the byte slices to stage, one group per device array (values, then validity when
    /// present); a group's slices are staged back to back.
    pub(in crate::select) fn parts<'a>(&'a self, parts: &mut Vec<Vec<&'a [u8]>>) {
        parts.push(
            self.values
                .iter()
                .map(|(buffer, range)| &buffer.as_slice()[range.clone()])
                .collect(),
        );
        if let Some((bits, range, _)) = &self.validity {
            parts.push(vec![&bits.as_slice()[range.clone()]]);
        }
    }

    /// (values, value bit offset, validity or 0, validity bit offset) from the staged
    /// addresses, consuming them in the order of [`parts`](Self::parts).
    pub(in crate::select) fn addresses(&self, next: &mut impl Iterator<Item = u64>) -> [u64; 4] {
        let values = next.next().expect("one address per part");
        let (validity, validity_bit_offset) = match &self.validity {
            Some((_, _, bit_offset)) => (next.next().expect("one address per part"), *bit_offset),
            None => (0, 0),
        };
        [values, self.value_bit_offset, validity, validity_bit_offset]
    }
}

/// The error a generated program's flags stand for ([`crate::fusion::ERROR_NULL_KEY`] and
/// co.): a device error (the operator reruns the query on the host) where only the host
/// reproduces DataFusion's outcome, a query error for a NULL in a key declared not nullable.
pub(in crate::select) fn program_error(error: u32) -> Result<()> {
    if error & crate::fusion::ERROR_AMBIGUOUS_NAN != 0 {
        // Not a query error: the host path reproduces DataFusion's result, so rerun there.
        return Err(gpu_error(GpuError(
            "the generated program added or multiplied two different NaNs, whose result \
             only the host reproduces"
                .into(),
        )));
    }
    if error & crate::fusion::ERROR_HOST_ONLY != 0 {
        // DataFusion fails on a row, or would where it evaluates it: the host reruns the
        // query and reports exactly what DataFusion does.
        return Err(gpu_error(GpuError(
            "the generated program met a row DataFusion's evaluation fails on (sqrt of a \
             negative number, abs of a signed minimum, an integer division by zero or of \
             the minimum by -1), whose outcome only the host reproduces"
                .into(),
        )));
    }
    if error & crate::fusion::ERROR_NULL_KEY != 0 {
        return Err(exec_error(
            "a sort key declared not nullable evaluated to NULL".to_string(),
        ));
    }
    Ok(())
}

/// One key column, ready to stage: its raw Arrow buffers and its field in the composite.
pub(super) struct ColumnPlan {
    buffers: ColumnBuffers,
    native: NativeCode,
    shift: u32,
    xor: u128,
    flags: u32,
}

pub(in crate::select) fn exec_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

/// Checks the columns against the layout (as `KeyLayout::encode` does) and collects their
/// buffers.
pub(super) fn plan_columns(layout: &KeyLayout, columns: &[ArrayRef]) -> Result<Vec<ColumnPlan>> {
    let specs = layout.specs();
    if columns.len() != specs.len() {
        return Err(exec_error(format!(
            "key encoding expects {} columns, got {}",
            specs.len(),
            columns.len()
        )));
    }
    let n = columns.first().map_or(0, |c| c.len());
    let mut plans = Vec::with_capacity(columns.len());
    for (i, (column, spec)) in columns.iter().zip(specs).enumerate() {
        if column.len() != n {
            return Err(exec_error(format!(
                "key column {} has {} rows, key column 1 has {n}",
                i + 1,
                column.len()
            )));
        }
        if column.data_type() != &spec.data_type {
            return Err(exec_error(format!(
                "key column {} has type {}, the key layout expects {}",
                i + 1,
                column.data_type(),
                spec.data_type
            )));
        }
        let native = NativeCode::for_data_type(&spec.data_type)
            .filter(|native| Some(native.bits()) == spec.value_bits())
            .ok_or_else(|| {
                exec_error(format!(
                    "sort key {} has type {}, which the CUDA key encoder does not support",
                    i + 1,
                    spec.data_type
                ))
            })?;
        let nulls = column
            .logical_nulls()
            .filter(|nulls| nulls.null_count() > 0);
        if let Some(nulls) = &nulls
            && !spec.nullable
        {
            return Err(exec_error(format!(
                "key column {} holds {} NULLs but was declared not nullable",
                i + 1,
                nulls.null_count()
            )));
        }
        let buffers = ColumnBuffers::of(column.as_ref(), native.byte_width())?;
        let value_bits = native.bits();
        let value_mask = if value_bits == 128 {
            u128::MAX
        } else {
            (1u128 << value_bits) - 1
        };
        let mut flags = if i == 0 { ENCODE_FIRST } else { 0 };
        if spec.nullable {
            flags |= ENCODE_NULLABLE;
        }
        if spec.nulls_first {
            flags |= ENCODE_NULLS_FIRST;
        }
        plans.push(ColumnPlan {
            buffers,
            native,
            shift: layout.field_shift(i),
            xor: if spec.descending { value_mask } else { 0 },
            flags,
        });
    }
    Ok(plans)
}

/// Where a batch's encoded keys (and staged row ids) are on the device.
pub(super) struct EncodedBatch {
    pub(super) keys: u64,
    pub(super) ids: Option<u64>,
}

/// Stages the columns' buffers (and explicit row ids) with one upload and encodes them into
/// `keys_buffer` (grown as needed).
pub(super) fn encode_batch(
    engine: &mut TopKEngine,
    keys_buffer: &mut Option<PooledBuffer>,
    columns: &[ColumnPlan],
    n: usize,
    row_ids: &RowIds<'_>,
) -> GpuResult<EncodedBatch> {
    let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * columns.len() + 1);
    for column in columns {
        let mut groups = Vec::new();
        column.buffers.parts(&mut groups);
        parts.extend(groups.into_iter().flatten());
    }
    if let RowIds::Explicit(ids) = row_ids {
        if ids.len() < n {
            return Err(GpuError(format!("{} row ids for {n} rows", ids.len())));
        }
        // SAFETY: viewing initialised u64s as their bytes (no padding, alignment 1).
        parts.push(unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u8, n * 8) });
    }
    let addresses = engine.stage(&parts)?;

    let key_bytes = n * engine.kind().key_bytes();
    if keys_buffer.as_ref().is_none_or(|b| b.bytes() < key_bytes) {
        let device = Arc::clone(engine.device());
        *keys_buffer = Some(device.pool.alloc(key_bytes, engine.stream())?);
    }
    let keys = keys_buffer.as_ref().expect("allocated above").ptr();
    let mut next = addresses.iter().copied();
    for column in columns {
        let [values, value_bit_offset, validity, validity_bit_offset] =
            column.buffers.addresses(&mut next);
        engine.encode_column(
            &EncodeColumn {
                values,
                value_bit_offset,
                validity,
                validity_bit_offset,
                rows: n,
                native: column.native,
                value_bits: column.native.bits(),
                shift: column.shift,
                xor: column.xor,
                flags: column.flags,
            },
            keys,
        )?;
    }
    Ok(EncodedBatch {
        keys,
        ids: next.next(),
    })
}
