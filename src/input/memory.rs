//! In-memory inputs: a memory source (an in-memory table's scan) or a [`crate::GpuTable`]'s
//! scan, or a column projection of one, hands out the table's own batches, so the same buffers
//! come back on every query: what the device column cache keys its entries by (a `GpuTable`'s
//! by the table's identity).

use std::borrow::Cow;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch, make_array};
use datafusion::arrow::compute::interleave;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::source::{DataSource, DataSourceExec};
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::projection::ProjectionExec;

use crate::fusion::{self, FusedProgram, KernelInput};
use crate::input::gpu_table::{GpuTableExec, TableData};
use crate::input::{ColumnImage, TableInput};

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
        let image = ColumnImage::of(input).map_or(ColumnImage::Values, |(_, image)| image);
        let (chunks, lookup, name) = match input {
            KernelInput::HostPredicate => return Ok(None),
            KernelInput::Column(c)
            | KernelInput::StringPrefix(c)
            | KernelInput::StringColumn(c)
            | KernelInput::StringCodes(c) => {
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
            KernelInput::StringColumn(c) | KernelInput::StringCodes(c) => {
                let at = *columns.get(*c)?;
                // A dictionary column's chunks are its codes: no strings to read.
                table.columns[at].encoded.is_none().then_some(())?;
                Some(TableInput {
                    image: ColumnImage::of(input)?.1,
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
                    image: ColumnImage::Values,
                    encoded: None,
                })
            }
        })
        .collect()
}

/// The input columns `read` of an in-memory table at table positions `positions`, in their
/// order; `batches` and `rows` are [`table_starts`]'.
pub(crate) fn gather_rows(
    memory: &MemoryInput<'_>,
    batches: &[&RecordBatch],
    rows: &RowLocator<'_>,
    positions: &[u64],
    read: &[bool],
) -> Result<Vec<Option<ArrayRef>>> {
    // Each position's batch (numbered among the batches that hold one) and row.
    let mut slots = vec![usize::MAX; batches.len()];
    let mut holding: Vec<&RecordBatch> = Vec::new();
    let at: Vec<(usize, usize)> = positions
        .iter()
        .map(|&p| {
            let (b, row) = rows.locate(p);
            if slots[b] == usize::MAX {
                slots[b] = holding.len();
                holding.push(batches[b]);
            }
            (slots[b], row)
        })
        .collect();
    (memory.columns.iter().zip(read))
        .map(|(&c, &read)| {
            read.then(|| {
                let arrays: Vec<&dyn Array> =
                    holding.iter().map(|b| b.column(c).as_ref()).collect();
                Ok(interleave(&arrays, &at)?)
            })
            .transpose()
        })
        .collect()
}

/// The batch and row of a table position, from the position of each batch's first row: a
/// bucket of 2^`shift` positions (at most the average batch) names the batches that start in
/// it, so a lookup searches a few starts instead of all of them (tens of millions of kept rows
/// are located this way, each at random).
pub(crate) struct RowLocator<'a> {
    starts: std::borrow::Cow<'a, [u64]>,
    shift: u32,
    /// For each bucket, the batch that holds its first position.
    buckets: Vec<u32>,
}

impl<'a> RowLocator<'a> {
    /// Over batches starting at `starts` (ascending, the first at 0) and holding `rows` rows.
    pub(crate) fn new(starts: std::borrow::Cow<'a, [u64]>, rows: u64) -> Self {
        let average = (rows / starts.len().max(1) as u64).max(1);
        let shift = average.ilog2();
        let count = (rows >> shift) as usize + 1;
        let mut buckets = Vec::with_capacity(count);
        let mut b = 0usize;
        for bucket in 0..count as u64 {
            let first = bucket << shift;
            while b + 1 < starts.len() && starts[b + 1] <= first {
                b += 1;
            }
            buckets.push(b as u32);
        }
        Self {
            starts,
            shift,
            buckets,
        }
    }

    /// The batch holding table position `p`, and `p`'s row in it.
    pub(crate) fn locate(&self, p: u64) -> (usize, usize) {
        let bucket = ((p >> self.shift) as usize).min(self.buckets.len() - 1);
        let lo = self.buckets[bucket] as usize;
        let hi = match self.buckets.get(bucket + 1) {
            Some(&next) => next as usize + 1,
            None => self.starts.len(),
        };
        let b = lo + self.starts[lo..hi].partition_point(|&s| s <= p) - 1;
        (b, (p - self.starts[b]) as usize)
    }
}

/// The table's non-empty batches and the locator of their rows (a `GpuTable` worked out the
/// batches' starts once).
pub(crate) fn table_starts<'a>(memory: &MemoryInput<'a>) -> (Vec<&'a RecordBatch>, RowLocator<'a>) {
    let batches: Vec<&RecordBatch> = match memory.table {
        Some(table) => table.batches.iter().collect(),
        None => memory.batches().filter(|b| b.num_rows() > 0).collect(),
    };
    let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
    let starts = match memory.table {
        Some(table) => std::borrow::Cow::Borrowed(table.starts.as_slice()),
        None => {
            let mut starts = Vec::with_capacity(batches.len());
            let mut next = 0u64;
            for batch in &batches {
                starts.push(next);
                next += batch.num_rows() as u64;
            }
            std::borrow::Cow::Owned(starts)
        }
    };
    (batches, RowLocator::new(starts, rows))
}

#[cfg(test)]
mod tests {
    use super::RowLocator;

    /// Every position of batches of uneven sizes (empty buckets, a batch inside one bucket,
    /// one spanning many) is found in its batch, as a search of all the starts finds it.
    #[test]
    fn the_locator_finds_every_positions_batch() {
        let cases: [&[u64]; 5] = [
            &[8192, 8192, 100, 8192, 3],
            &[1],
            &[5, 1, 1, 1, 1, 1, 1, 1, 1, 1000, 2, 2],
            &[
                1000, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
            ],
            &[3, 7, 64, 64, 65, 1, 127, 128, 129],
        ];
        for sizes in cases {
            let mut starts = Vec::new();
            let mut rows = 0u64;
            for &n in sizes {
                starts.push(rows);
                rows += n;
            }
            let locator = RowLocator::new(std::borrow::Cow::Borrowed(&starts), rows);
            for p in 0..rows {
                let b = starts.partition_point(|&s| s <= p) - 1;
                assert_eq!(
                    locator.locate(p),
                    (b, (p - starts[b]) as usize),
                    "{sizes:?} at {p}"
                );
            }
        }
    }
}
