//! The operator over a scan of Parquet files read as a whole table ([`crate::input::parquet`]):
//! the program's columns come from the column cache, or are read from the files for it
//! (their pages decoded on the device where it can, only the first rows where the row groups'
//! statistics rule out the rest), and only the winners' rows are read back from the files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array};
use datafusion::arrow::compute::{interleave, take};
use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;
use datafusion::object_store::ObjectStore;

use super::TopKRun;
use super::whole_table::{LoadAfter, WholeTable};
use crate::cost::policy;
use crate::device::EncodedColumn;
use crate::device::column_cache::{CacheKey, CacheUse};
use crate::fusion::{self, FusedProgram, KernelInput};
use crate::input::parquet::{
    ParquetColumnRows, ParquetInput, RowGroupLayout, file_column, global_codes, image_type,
    keep_dictionary, kept_dictionary, parquet_input, read_missing,
};
use crate::input::{ColumnImage, TableInput};
use crate::select::table::{TableSelection, TableSelector};

/// The program's per-row inputs over the files: a column's values, a string's prefix words or
/// bytes, or a dictionary column's codes, renumbered into one dictionary for all the row
/// groups (each has its own: [`global_codes`]); the programs' dictionary lookups are over that
/// dictionary.
struct ProgramColumns {
    columns: Vec<usize>,
    images: Vec<ColumnImage>,
    codes: Vec<bool>,
    types: Vec<DataType>,
}

impl ProgramColumns {
    /// `None` where an input is no column of the scan, or its image has no type.
    fn of(files: &ParquetInput, program: &FusedProgram) -> Option<Self> {
        let mut per_row = Vec::new();
        for input in &program.inputs {
            match input {
                KernelInput::DictionaryMatch { .. } => {}
                KernelInput::DictionaryCodes(c) if *c < files.columns.len() => {
                    per_row.push((*c, ColumnImage::Values, true));
                }
                input => per_row.push(
                    ColumnImage::of(input)
                        .filter(|(c, _)| *c < files.columns.len())
                        .map(|(c, image)| (c, image, false))?,
                ),
            }
        }
        let types = (per_row.iter())
            .map(|&(c, _, codes)| image_type(files.data_type(c)?, codes))
            .collect::<Result<Vec<_>>>()
            .ok()?;
        Some(Self {
            columns: per_row.iter().map(|&(c, _, _)| c).collect(),
            images: per_row.iter().map(|&(_, image, _)| image).collect(),
            codes: per_row.iter().map(|&(_, _, codes)| codes).collect(),
            types,
        })
    }
}

/// The columns a run reads from the files: those the cache misses, and codes whose
/// dictionary is not kept (read again: their dictionary comes out the same, and the cached
/// codes are read), with the dictionaries known so far by column.
struct MissingColumns {
    read_again: Vec<bool>,
    missing: Vec<usize>,
    dictionaries: HashMap<usize, ArrayRef>,
}

impl MissingColumns {
    fn of(program: &ProgramColumns, keys: &[CacheKey], held: &[Option<CacheUse>]) -> Self {
        let mut dictionaries = HashMap::new();
        let mut read_again = Vec::with_capacity(keys.len());
        for (((key, hit), &codes), &c) in keys
            .iter()
            .zip(held)
            .zip(&program.codes)
            .zip(&program.columns)
        {
            let kept = codes.then(|| kept_dictionary(key)).flatten();
            read_again.push(hit.is_none() || (codes && kept.is_none()));
            if let Some(kept) = kept {
                dictionaries.insert(c, kept);
            }
        }
        let missing = (program.columns.iter().zip(&read_again))
            .filter(|(_, read)| **read)
            .map(|(&c, _)| c)
            .collect();
        Self {
            read_again,
            missing,
            dictionaries,
        }
    }
}

/// The missing columns as read: decoded on the host (empty where read as pages), and pages
/// for the device to decode.
type ReadColumns = (Vec<Vec<ArrayRef>>, Vec<Option<Arc<EncodedColumn>>>);

impl TopKRun {
    /// The run over a scan of Parquet files ([`crate::input::parquet`]).
    pub(super) async fn run_parquet(
        &self,
        selector: &TableSelector,
        program: &FusedProgram,
    ) -> Result<WholeTable> {
        let Some(files) = parquet_input(&self.input) else {
            return Ok(WholeTable::Stream);
        };
        let Some(per_row) = ProgramColumns::of(&files, program) else {
            return Ok(WholeTable::Stream);
        };
        // Whatever goes wrong reading the files as a table, the scan reads them as DataFusion
        // does (with its errors).
        let store = match self.context.runtime_env().object_store(files.store()) {
            Ok(store) => store,
            Err(_) => return Ok(WholeTable::Stream),
        };
        let layout = match files.layout(&store).await {
            Ok(layout) if layout.rows > 0 => layout,
            Ok(_) => return Ok(WholeTable::Stream),
            Err(e) => {
                log::debug!("gpu-topk: the files are streamed: {e}");
                return Ok(WholeTable::Stream);
            }
        };
        // Row groups past the last one whose statistics let a row pass are not read.
        let skip = (self.spec.filter.as_ref()).and_then(|filter| {
            let schema = self.input.schema();
            crate::input::zones::skip_row_groups(filter, &schema, &files, &layout)
        });
        if let Some(skip) = skip {
            self.metrics.chunks_skipped.add(skip.chunks);
            if skip.within == 0 {
                self.metrics.rows_in.add(layout.rows);
                return Ok(WholeTable::Done(RecordBatch::new_empty(Arc::clone(
                    &self.schema,
                ))));
            }
        }
        let within = skip.map(|s| s.within);
        let keys: Vec<_> = (per_row.columns.iter().zip(&per_row.images))
            .map(|(&c, &image)| image.key(files.key(c)))
            .collect();
        // Held while the selection runs: a column found here stays until it has read it.
        let held = selector.hold(&keys);
        let mut missing = MissingColumns::of(&per_row, &keys, &held);
        // Where the rows that may pass are at most a share of the table, the missing columns'
        // first rows are read for this selection only, and the whole columns are loaded into
        // the cache after it, in the background: the answer waits for the rows it needs.
        let prefix = within
            .filter(|&w| policy::reads_first_rows(w, layout.rows, !missing.missing.is_empty()));
        let prefix_layout = prefix.map(|w| layout.prefix(w));
        let read_layout = prefix_layout.as_ref().unwrap_or(&layout);
        if !self.missing_fit(selector, &per_row, &held, read_layout.rows) {
            return Ok(WholeTable::Stream);
        }
        // Pages are shipped as they are read where the selection can wait for the reads
        // without holding up the runtime that runs them (it leaves its worker to the others).
        let streaming = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let read = self
            .read_missing_columns(
                (&files, &store, read_layout),
                &per_row,
                &keys,
                &mut missing,
                prefix.is_none(),
                streaming,
            )
            .await;
        let Some((decoded, encoded)) = read else {
            return Ok(WholeTable::Stream);
        };
        self.metrics
            .device_decoded_columns
            .add(encoded.iter().flatten().count());
        // Decoded columns and pages held until uploaded; where the pool has no room, the
        // input streams.
        let host = self.reservation.new_empty();
        let decoded_bytes = (decoded.iter().flatten())
            .map(|a| a.get_array_memory_size())
            .chain(encoded.iter().flatten().map(|e| e.page_bytes))
            .sum();
        if host.try_grow(decoded_bytes).is_err() {
            return Ok(WholeTable::Stream);
        }
        // A missing column's first rows, read for this selection only.
        let rows = |at: Option<usize>| match (at, prefix) {
            (Some(_), Some(_)) => ParquetColumnRows::Prefix(read_layout.rows),
            _ => ParquetColumnRows::Whole(layout.rows),
        };
        let inputs = match self.program_inputs(
            &files,
            program,
            per_row,
            &missing,
            (&decoded, &encoded),
            rows,
        )? {
            Some(inputs) => inputs,
            None => return Ok(WholeTable::Stream),
        };
        let streamed = streaming && encoded.iter().any(Option::is_some);
        let selected = match streamed {
            true => tokio::task::block_in_place(|| {
                self.select(selector, &inputs, layout.rows, within, true)
            }),
            false => self.select(selector, &inputs, layout.rows, within, true),
        }?;
        drop((held, inputs, decoded, encoded, host));
        let selected = match selected {
            Ok(selected) => selected,
            Err(other) => return Ok(other),
        };
        // The whole columns are loaded once the answer is read: not while its rows are.
        let _load = LoadAfter(prefix.is_some().then_some(self));
        let _timer = self.metrics.gather_time.timer();
        self.winners_from_files(&files, &store, &layout, selected)
            .await
    }

    /// Whether the missing columns' images of `rows` rows fit the column cache's budget.
    fn missing_fit(
        &self,
        selector: &TableSelector,
        per_row: &ProgramColumns,
        held: &[Option<CacheUse>],
        rows: usize,
    ) -> bool {
        let mut missing_bytes = 0;
        for ((data_type, hit), &image) in per_row.types.iter().zip(held).zip(&per_row.images) {
            if hit.is_none() {
                // A strings image's bytes are not known before they are read: the check
                // counts its row ends, and the upload reserves the rest.
                let width = image.row_bytes(data_type);
                missing_bytes += width.map_or(rows.div_ceil(8), |w| w * rows);
            }
        }
        policy::table_fits_cache(missing_bytes, selector.cache_budget())
    }

    /// Reads the missing columns of `layout`'s row groups (timed as `read_time`): pages for the
    /// device where it decodes them, the others decoded here, dictionary codes renumbered into
    /// one dictionary (kept for the next queries where `whole`: a prefix's is this query's
    /// alone, the whole column's has more entries). `None` where the files cannot be read so.
    async fn read_missing_columns(
        &self,
        (files, store, layout): (&ParquetInput, &Arc<dyn ObjectStore>, &RowGroupLayout),
        per_row: &ProgramColumns,
        keys: &[CacheKey],
        missing: &mut MissingColumns,
        whole: bool,
        streaming: bool,
    ) -> Option<ReadColumns> {
        let _timer = self.metrics.read_time.timer();
        // Pages go to the device for the values image only.
        let on_device: Vec<bool> = (missing.read_again.iter())
            .zip(&per_row.images)
            .zip(&per_row.codes)
            .filter(|((read, _), _)| **read)
            .map(|((_, &image), &codes)| {
                let setting = self.spec.settings.decode_parquet_on_device;
                policy::decode_pages_on_device(setting, image == ColumnImage::Values, codes)
            })
            .collect();
        let (host_decoded, encoded) = read_missing(
            files,
            store,
            layout,
            &missing.missing,
            &on_device,
            streaming,
        )
        .await;
        let renumbered = host_decoded.and_then(|mut decoded| {
            for (i, &c) in missing.missing.iter().enumerate() {
                let at = (per_row.columns.iter())
                    .position(|&m| m == c)
                    .expect("a program column");
                if per_row.codes[at] {
                    let (renumbered, dictionary) = global_codes(&decoded[i])?;
                    if whole {
                        keep_dictionary(&keys[at], Arc::clone(&dictionary));
                    }
                    missing.dictionaries.insert(c, dictionary);
                    decoded[i] = renumbered;
                }
            }
            Ok(decoded)
        });
        match renumbered {
            Ok(decoded) => Some((decoded, encoded)),
            Err(e) => {
                log::debug!("gpu-topk: the files are streamed: {e}");
                None
            }
        }
    }

    /// The program's inputs in its order: each per-row column as read (or known by its key
    /// where the cache holds it), each dictionary lookup over its codes' dictionary. `None`
    /// where a lookup's dictionary is not known.
    fn program_inputs(
        &self,
        files: &ParquetInput,
        program: &FusedProgram,
        per_row: ProgramColumns,
        missing: &MissingColumns,
        (decoded, encoded): (&[Vec<ArrayRef>], &[Option<Arc<EncodedColumn>>]),
        rows: impl Fn(Option<usize>) -> ParquetColumnRows,
    ) -> Result<Option<Vec<TableInput<'static>>>> {
        let schema = self.input.schema();
        let ProgramColumns {
            columns,
            images,
            types,
            ..
        } = per_row;
        let mut per_row_inputs =
            (columns.iter().zip(&images).zip(types)).map(|((&c, &image), data_type)| {
                let at = missing.missing.iter().position(|&m| m == c);
                let chunks = at.map(|i| decoded[i].clone()).unwrap_or_default();
                let pages = at.and_then(|i| encoded[i].clone());
                let key = files.key(c);
                file_column(key, data_type, rows(at), (chunks, pages), &schema, c, image)
            });
        let mut inputs: Vec<TableInput<'static>> = Vec::with_capacity(program.inputs.len());
        for input in &program.inputs {
            let KernelInput::DictionaryMatch { column, values } = input else {
                inputs.push(per_row_inputs.next().expect("one per per-row input"));
                continue;
            };
            let Some(entries) = missing.dictionaries.get(column) else {
                return Ok(None);
            };
            inputs.push(TableInput {
                chunks: Cow::Owned(Vec::new()),
                lookup: Some(fusion::dictionary_entries_match(entries, values)?),
                name: schema.field(*column).name().clone(),
                identity: None,
                image: ColumnImage::Values,
                encoded: None,
            });
        }
        Ok(Some(inputs))
    }

    /// The output of the selection's winners, their rows read from the files: the candidates'
    /// rows ranked by their whole keys first where the selection was over a prefix layout.
    async fn winners_from_files(
        &self,
        files: &ParquetInput,
        store: &Arc<dyn ObjectStore>,
        layout: &RowGroupLayout,
        selected: TableSelection,
    ) -> Result<WholeTable> {
        if selected.positions.is_empty() {
            return Ok(WholeTable::Done(RecordBatch::new_empty(Arc::clone(
                &self.schema,
            ))));
        }
        // The input columns `read` at table positions `positions`, in their order, read from
        // the pages that hold them.
        let gather = async |positions: &[u64], read: &[bool]| -> Result<Vec<Option<ArrayRef>>> {
            let wanted: Vec<usize> = (0..read.len()).filter(|&c| read[c]).collect();
            let (batches, at) = if wanted.is_empty() {
                (Vec::new(), Vec::new())
            } else {
                files.read_rows(store, layout, positions, &wanted).await?
            };
            let mut next = 0;
            read.iter()
                .map(|&read| {
                    if !read {
                        return Ok(None);
                    }
                    let arrays: Vec<&dyn Array> =
                        batches.iter().map(|b| b[next].as_ref()).collect();
                    next += 1;
                    Ok(Some(interleave(&arrays, &at)?))
                })
                .collect()
        };
        let output_reads = self.output_reads();
        let (columns, n) = if selected.refine {
            // One read of the candidates' rows, of the columns their keys or the output read:
            // the winners' output comes from it.
            let candidates = &selected.positions;
            let read: Vec<bool> = (self.key_reads().iter().zip(&output_reads))
                .map(|(&key, &output)| key || output)
                .collect();
            let gathered = gather(candidates, &read).await?;
            let rows = self.input_rows(gathered.clone(), candidates.len())?;
            let order = UInt64Array::from(self.rank(candidates, &rows, selected.tied)?);
            let columns = (gathered.into_iter().zip(&output_reads))
                .map(|(column, &output)| match column {
                    Some(column) if output => Ok(Some(take(&column, &order, None)?)),
                    _ => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            (columns, order.len())
        } else {
            let positions = &selected.positions;
            (gather(positions, &output_reads).await?, positions.len())
        };
        self.output(columns, n).map(WholeTable::Done)
    }
}
