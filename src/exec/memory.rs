//! In-memory inputs: a memory source (an in-memory table's scan) or a [`crate::GpuTable`]'s
//! scan, or a column projection of one, hands out the table's own batches, so the same buffers
//! come back on every query: what the device column cache keys its entries by (a `GpuTable`'s
//! by the table's identity).

use std::borrow::Cow;
use std::sync::Arc;

use datafusion::arrow::array::{AsArray, RecordBatch, make_array};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::source::{DataSource, DataSourceExec};
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::projection::ProjectionExec;

use crate::fusion::{self, FusedProgram, KernelInput};
use crate::select::table::{Image, TableInput};
use crate::table::{GpuTableExec, TableData};

/// An in-memory input: the table's batches, per partition, and for each of the input's
/// columns the column of those batches it is.
pub(crate) struct MemoryInput<'a> {
    pub partitions: &'a [Vec<RecordBatch>],
    pub columns: Vec<usize>,
    /// The `GpuTable` the batches are, if they are one's (the column cache knows its columns
    /// by its identity, and it worked out what the generated code reads once).
    pub table: Option<&'a TableData>,
}

impl<'a> MemoryInput<'a> {
    /// Every batch, partition by partition: the input's order.
    pub fn batches(&self) -> impl Iterator<Item = &'a RecordBatch> + use<'a> {
        self.partitions.iter().flatten()
    }

    /// `batch` as the input hands it out (its columns projected).
    pub fn project(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        Ok(batch.project(&self.columns)?)
    }
}

/// `input` as an in-memory input, when it is one whose every row reaches the operator (no
/// fetch limit).
pub(crate) fn memory_input(input: &Arc<dyn ExecutionPlan>) -> Option<MemoryInput<'_>> {
    if let Some(cooperative) = input.downcast_ref::<CooperativeExec>() {
        return memory_input(cooperative.input());
    }
    if let Some(projection) = input.downcast_ref::<ProjectionExec>() {
        let inner = memory_input(projection.input())?;
        let columns = projection
            .expr()
            .iter()
            .map(|e| {
                e.expr
                    .downcast_ref::<Column>()
                    .map(|c| inner.columns[c.index()])
            })
            .collect::<Option<Vec<_>>>()?;
        return Some(MemoryInput {
            partitions: inner.partitions,
            columns,
            table: inner.table,
        });
    }
    if let Some(table) = input.downcast_ref::<GpuTableExec>() {
        return Some(MemoryInput {
            partitions: &table.data().partitions,
            columns: table.columns(),
            table: Some(table.data()),
        });
    }
    let source = input.downcast_ref::<DataSourceExec>()?;
    let memory = source.data_source().downcast_ref::<MemorySourceConfig>()?;
    if memory.fetch().is_some() {
        return None;
    }
    let partitions = memory.partitions();
    let columns = match memory.projection() {
        Some(projection) => projection.clone(),
        None => {
            let width = partitions
                .iter()
                .flatten()
                .next()
                .map_or(0, |b| b.num_columns());
            (0..width).collect()
        }
    };
    Some(MemoryInput {
        partitions,
        columns,
        table: None,
    })
}

/// A generated program's inputs over the whole of an in-memory input, its batches back to
/// back (empty ones left out), for a device selection over the table at once
/// ([`crate::select::TableSelector`]). `None` where the program cannot run so: its
/// predicate is left to the host, or the batches' dictionaries differ where it looks entries
/// up. `names`: the input's column names.
pub(crate) fn table_inputs<'a>(
    memory: &MemoryInput<'a>,
    program: &FusedProgram,
    names: &[String],
) -> Result<Option<Vec<TableInput<'a>>>> {
    if let Some(table) = memory.table {
        return Ok(gpu_table_inputs(table, &memory.columns, program, names));
    }
    let batches: Vec<&'a RecordBatch> = memory
        .partitions
        .iter()
        .flatten()
        .filter(|b| b.num_rows() > 0)
        .collect();
    let column = |c: usize| -> Result<usize> {
        memory.columns.get(c).copied().ok_or_else(|| {
            DataFusionError::Internal(format!(
                "the program reads input column {c}, beyond the input"
            ))
        })
    };
    let mut inputs = Vec::with_capacity(program.inputs.len());
    for input in &program.inputs {
        let image = Image::of(input).map_or(Image::Values, |(_, image)| image);
        let (chunks, lookup, name) = match input {
            KernelInput::HostPredicate => return Ok(None),
            KernelInput::Column(c)
            | KernelInput::StringPrefix(c)
            | KernelInput::StringColumn(c) => {
                let at = column(*c)?;
                let chunks = batches.iter().map(|b| Arc::clone(b.column(at))).collect();
                (chunks, None, names.get(*c))
            }
            KernelInput::DictionaryCodes(c) => {
                let at = column(*c)?;
                let chunks = batches
                    .iter()
                    .map(|b| {
                        b.column(at)
                            .as_any_dictionary_opt()
                            .map(|d| make_array(d.keys().to_data()))
                            .ok_or_else(|| {
                                DataFusionError::Internal(format!(
                                    "input column {c} is not dictionary-encoded"
                                ))
                            })
                    })
                    .collect::<Result<_>>()?;
                (chunks, None, names.get(*c))
            }
            KernelInput::DictionaryMatch { column: c, values } => {
                let at = column(*c)?;
                let Some(first) = batches.first() else {
                    return Ok(None);
                };
                let dictionary = |b: &RecordBatch| {
                    b.column(at)
                        .as_any_dictionary_opt()
                        .map(|d| Arc::clone(d.values()))
                };
                let Some(shared) = dictionary(first) else {
                    return Ok(None);
                };
                let same = batches.iter().all(|b| {
                    dictionary(b).is_some_and(|d| {
                        Arc::ptr_eq(&d, &shared) || d.to_data() == shared.to_data()
                    })
                });
                if !same {
                    return Ok(None);
                }
                let lookup = fusion::dictionary_match(first.column(at), values)?;
                (Vec::new(), Some(lookup), names.get(*c))
            }
        };
        inputs.push(TableInput {
            chunks: Cow::Owned(chunks),
            lookup,
            name: name.cloned().unwrap_or_default(),
            identity: None,
            image,
            encoded: None,
        });
    }
    Ok(Some(inputs))
}

/// [`table_inputs`] over a `GpuTable`, from what the table worked out of its columns once.
fn gpu_table_inputs<'a>(
    table: &'a TableData,
    columns: &[usize],
    program: &FusedProgram,
    names: &[String],
) -> Option<Vec<TableInput<'a>>> {
    let name = |c: usize| names.get(c).map_or("", String::as_str);
    program
        .inputs
        .iter()
        .map(|input| match input {
            KernelInput::HostPredicate => None,
            KernelInput::Column(c) | KernelInput::DictionaryCodes(c) => {
                Some(table.input(*columns.get(*c)?, name(*c)))
            }
            KernelInput::StringPrefix(c) => Some(table.prefix_input(*columns.get(*c)?, name(*c))),
            KernelInput::StringColumn(c) => {
                let at = *columns.get(*c)?;
                // A dictionary column's chunks are its codes: no strings to read.
                table.columns[at].encoded.is_none().then_some(())?;
                Some(TableInput {
                    image: Image::Strings,
                    ..table.input(at, name(*c))
                })
            }
            KernelInput::DictionaryMatch { column: c, values } => {
                let at = *columns.get(*c)?;
                // Every batch has this dictionary (else the table path does not apply).
                table.columns[at].dictionary.as_ref()?;
                let first = table.batches.first()?.column(at);
                Some(TableInput {
                    chunks: Cow::Owned(Vec::new()),
                    lookup: Some(fusion::dictionary_match(first, values).ok()?),
                    name: name(*c).to_string(),
                    identity: None,
                    image: Image::Values,
                    encoded: None,
                })
            }
        })
        .collect()
}
