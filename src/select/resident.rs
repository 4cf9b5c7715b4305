//! [`ResidentColumns`]: the fused selection over a program's input columns uploaded once by
//! the caller, with the unfused variant beside it (a filter kernel, then top-k): the fusion
//! benchmark (`benches/fused.rs`) and the GPU tests compare both with DataFusion.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;

use super::cuda::{ColumnBuffers, exec_error, gpu_error, program_error};
use crate::device::{
    DeviceAlgorithm, DevicePairs, FusedReport, GeneratedKernel, PooledBuffer, TopKEngine,
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
                KernelInput::StringColumn(_) | KernelInput::StringCodes(_) => Err(exec_error(
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
