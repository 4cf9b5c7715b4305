//! The operator over a whole table on the GPU: when the input is a memory source (or a scan of
//! Parquet files, `exec::parquet`) and the generated program reads only its columns, the
//! program runs once over every row, its input columns read from the device's column cache
//! (uploaded into it on the first query), and the host touches only the winners. Nothing is
//! read from the scan: the batches come straight from the memory source (the files' columns
//! are decoded into the cache on a miss), and only the `k` winning rows' output columns are
//! evaluated, from those batches (or read from the files), as DataFusion evaluates a
//! projection above its TopK.
//!
//! Row ids are positions in the table, partition by partition, the streaming path's input
//! order: ties resolve the same way on both paths. The selection itself, with the column
//! cache, is the plan's [`TableSelector`]; this module reads the input and the winners' rows,
//! and decides only how the run goes on where the table path does not apply.

use std::borrow::Cow;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array, new_null_array};
use datafusion::arrow::compute::{interleave, take};
use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::row::RowConverter;
use datafusion::error::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::utils::collect_columns;

use super::{TopKRun, check_empty_batch};
use crate::cost::{SelectionPlan, policy};
use crate::fusion::{self, FusedProgram, KernelInput};
use crate::input::loader::{CacheLoader, load_inputs};
use crate::input::memory::{gather_rows, memory_input, table_inputs, table_starts};
use crate::input::parquet::{
    ParquetColumnRows, file_column, global_codes, image_type, keep_dictionary, kept_dictionary,
    parquet_input, read_missing,
};
use crate::input::{ColumnImage, TableInput};
use crate::select::table::{TableSelection, TableSelector};
use crate::select::{self, Selector};

/// Starts the background load of a run's columns when dropped ([`TopKRun::warm_up`]).
struct LoadAfter<'a>(Option<&'a TopKRun>);

impl Drop for LoadAfter<'_> {
    fn drop(&mut self) {
        // A run dropped outside a runtime (cancelled) leaves the load to the next run.
        if let Some(run) = self.0
            && tokio::runtime::Handle::try_current().is_ok()
        {
            run.warm_up();
        }
    }
}

/// How a run over a whole table ended.
pub(super) enum WholeTable {
    /// The result.
    Done(RecordBatch),
    /// The input cannot be read as a table, or its columns do not fit the cache: stream it.
    Stream,
    /// The device failed: stream the input on the CPU path.
    Cpu,
}

impl TopKRun {
    /// The run over the whole table with the selector of `plan` (see the module
    /// documentation).
    pub(super) async fn run_whole_table(&self, plan: &SelectionPlan) -> Result<WholeTable> {
        let Some(program) = &self.spec.fusion.program else {
            return Ok(WholeTable::Stream);
        };
        let selection = self.selection_spec(Some(Arc::clone(program)));
        let selector = match select::create_selector(&selection, plan) {
            Ok(Selector::WholeTable(selector)) => selector,
            Ok(Selector::Streamed(_)) => return Ok(WholeTable::Stream),
            Err(e) if self.fell_back("the GPU selection", &e) => return Ok(WholeTable::Cpu),
            Err(e) => return Err(e),
        };
        match self.run_memory(&selector, program)? {
            WholeTable::Stream => self.run_parquet(&selector, program).await,
            done => Ok(done),
        }
    }

    /// The run over an in-memory table.
    fn run_memory(&self, selector: &TableSelector, program: &FusedProgram) -> Result<WholeTable> {
        let Some(memory) = memory_input(&self.input) else {
            return Ok(WholeTable::Stream);
        };
        let schema = self.input.schema();
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let Some(inputs) = table_inputs(&memory, program, &names)? else {
            return Ok(WholeTable::Stream);
        };
        // DataFusion evaluates the filter, or the keys, on empty batches too.
        for batch in memory.batches().filter(|b| b.num_rows() == 0) {
            check_empty_batch(&self.spec, &memory.project(batch)?)?;
        }
        let rows: usize = memory.batches().map(|b| b.num_rows()).sum();
        if rows == 0 {
            return Ok(WholeTable::Done(RecordBatch::new_empty(Arc::clone(
                &self.schema,
            ))));
        }
        // Chunks past the last one whose zones let a row pass are not read.
        let skip = (self.spec.filter.as_ref()).and_then(|filter| {
            let slot = self.spec.device.unwrap_or_default();
            crate::input::zones::skip(filter, &schema, program, &inputs, slot)
        });
        if let Some(skip) = skip {
            self.metrics.chunks_skipped.add(skip.chunks);
            if skip.within == 0 {
                self.metrics.rows_in.add(rows);
                return Ok(WholeTable::Done(RecordBatch::new_empty(Arc::clone(
                    &self.schema,
                ))));
            }
        }
        let within = skip.map(|s| s.within);
        let selected = match self.select(selector, &inputs, rows, within)? {
            Ok(selected) => selected,
            Err(other) => return Ok(other),
        };
        let _timer = self.metrics.gather_time.timer();
        if selected.positions.is_empty() {
            return Ok(WholeTable::Done(RecordBatch::new_empty(Arc::clone(
                &self.schema,
            ))));
        }
        let (batches, located) = table_starts(&memory);
        let gather = |positions: &[u64], read: &[bool]| {
            gather_rows(&memory, &batches, &located, positions, read)
        };
        let positions = if selected.refine {
            let candidates = &selected.positions;
            let rows = self.input_rows(gather(candidates, &self.key_reads())?, candidates.len())?;
            let order = self.rank(candidates, &rows, selected.tied)?;
            order.iter().map(|&i| candidates[i as usize]).collect()
        } else {
            selected.positions
        };
        let columns = gather(&positions, &self.output_reads())?;
        self.output(columns, positions.len()).map(WholeTable::Done)
    }

    /// The run over a scan of Parquet files (`exec::parquet`).
    async fn run_parquet(
        &self,
        selector: &TableSelector,
        program: &FusedProgram,
    ) -> Result<WholeTable> {
        let Some(files) = parquet_input(&self.input) else {
            return Ok(WholeTable::Stream);
        };
        // Per-row inputs: a column's values, a string's prefix words or bytes, or a dictionary
        // column's codes, renumbered into one dictionary for all the row groups (each has its
        // own: [`global_codes`]); the programs' dictionary lookups are over that dictionary.
        let mut per_row = Vec::new();
        for input in &program.inputs {
            match input {
                KernelInput::DictionaryMatch { .. } => {}
                KernelInput::DictionaryCodes(c) if *c < files.columns.len() => {
                    per_row.push((*c, ColumnImage::Values, true));
                }
                input => match ColumnImage::of(input).filter(|(c, _)| *c < files.columns.len()) {
                    Some((c, image)) => per_row.push((c, image, false)),
                    None => return Ok(WholeTable::Stream),
                },
            }
        }
        let columns: Vec<usize> = per_row.iter().map(|&(c, _, _)| c).collect();
        let images: Vec<ColumnImage> = per_row.iter().map(|&(_, image, _)| image).collect();
        let codes: Vec<bool> = per_row.iter().map(|&(_, _, codes)| codes).collect();
        let Ok(types) = (per_row.iter())
            .map(|&(c, _, codes)| image_type(files.data_type(c)?, codes))
            .collect::<Result<Vec<_>>>()
        else {
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
        let schema = self.input.schema();
        // Row groups past the last one whose statistics let a row pass are not read.
        let skip = (self.spec.filter.as_ref()).and_then(|filter| {
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
        let keys: Vec<_> = (columns.iter().zip(&images))
            .map(|(&c, &image)| image.key(files.key(c)))
            .collect();
        // Held while the selection runs: a column found here stays until it has read it.
        let held = selector.hold(&keys);
        // Codes whose dictionary is not kept are read again: their dictionary comes out the
        // same, and the cached codes are read.
        let mut dictionaries = std::collections::HashMap::new();
        let mut read_again = Vec::with_capacity(keys.len());
        for (((key, hit), &codes), &c) in keys.iter().zip(&held).zip(&codes).zip(&columns) {
            let kept = codes.then(|| kept_dictionary(key)).flatten();
            read_again.push(hit.is_none() || (codes && kept.is_none()));
            if let Some(kept) = kept {
                dictionaries.insert(c, kept);
            }
        }
        let missing: Vec<usize> = (columns.iter().zip(&read_again))
            .filter(|(_, read)| **read)
            .map(|(&c, _)| c)
            .collect();
        // Where the rows that may pass are at most a share of the table, the missing columns'
        // first rows are read for this selection only, and the whole columns are loaded into
        // the cache after it, in the background: the answer waits for the rows it needs.
        let prefix =
            within.filter(|&w| policy::reads_first_rows(w, layout.rows, !missing.is_empty()));
        let prefix_layout = prefix.map(|w| layout.prefix(w));
        let read_layout = prefix_layout.as_ref().unwrap_or(&layout);
        let read_rows = read_layout.rows;
        let mut missing_bytes = 0;
        for ((data_type, hit), &image) in types.iter().zip(&held).zip(&images) {
            if hit.is_none() {
                // A strings image's bytes are not known before they are read: the check
                // counts its row ends, and the upload reserves the rest.
                let width = image.row_bytes(data_type);
                missing_bytes += width.map_or(read_rows.div_ceil(8), |w| w * read_rows);
            }
        }
        if !policy::table_fits_cache(missing_bytes, selector.cache_budget()) {
            return Ok(WholeTable::Stream);
        }
        // Pages are shipped as they are read where the selection can wait for the reads
        // without holding up the runtime that runs them (it leaves its worker to the others).
        let streaming = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let (decoded, encoded) = {
            let _timer = self.metrics.read_time.timer();
            // Pages go to the device for the values image only.
            let on_device: Vec<bool> = (read_again.iter().zip(&images).zip(&codes))
                .filter(|((read, _), _)| **read)
                .map(|((_, &image), &codes)| {
                    let setting = self.spec.settings.decode_parquet_on_device;
                    policy::decode_pages_on_device(setting, image == ColumnImage::Values, codes)
                })
                .collect();
            let (host_decoded, encoded) =
                read_missing(&files, &store, read_layout, &missing, &on_device, streaming).await;
            let renumbered = host_decoded.and_then(|mut decoded| {
                for (i, &c) in missing.iter().enumerate() {
                    let at = columns
                        .iter()
                        .position(|&m| m == c)
                        .expect("a program column");
                    if codes[at] {
                        let (renumbered, dictionary) = global_codes(&decoded[i])?;
                        // A prefix's dictionary is this query's alone: the whole column's
                        // has more entries.
                        if prefix.is_none() {
                            keep_dictionary(&keys[at], Arc::clone(&dictionary));
                        }
                        dictionaries.insert(c, dictionary);
                        decoded[i] = renumbered;
                    }
                }
                Ok(decoded)
            });
            match renumbered {
                Ok(decoded) => (decoded, encoded),
                Err(e) => {
                    log::debug!("gpu-topk: the files are streamed: {e}");
                    return Ok(WholeTable::Stream);
                }
            }
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
        let mut per_row_inputs =
            (columns.iter().zip(&images).zip(types)).map(|((&c, &image), data_type)| {
                let at = missing.iter().position(|&m| m == c);
                let chunks = at.map(|i| decoded[i].clone()).unwrap_or_default();
                let pages = at.and_then(|i| encoded[i].clone());
                // A missing column's first rows, read for this selection only.
                let rows = match (at, prefix) {
                    (Some(_), Some(_)) => ParquetColumnRows::Prefix(read_rows),
                    _ => ParquetColumnRows::Whole(layout.rows),
                };
                let key = files.key(c);
                file_column(key, data_type, rows, (chunks, pages), &schema, c, image)
            });
        // In the program's order, each dictionary lookup over its codes' dictionary.
        let mut inputs: Vec<TableInput<'_>> = Vec::with_capacity(program.inputs.len());
        for input in &program.inputs {
            let KernelInput::DictionaryMatch { column, values } = input else {
                inputs.push(per_row_inputs.next().expect("one per per-row input"));
                continue;
            };
            let Some(entries) = dictionaries.get(column) else {
                return Ok(WholeTable::Stream);
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
        drop(per_row_inputs);
        let streamed = streaming && encoded.iter().any(Option::is_some);
        let selected = match streamed {
            true => {
                tokio::task::block_in_place(|| self.select(selector, &inputs, layout.rows, within))
            }
            false => self.select(selector, &inputs, layout.rows, within),
        }?;
        drop((held, inputs, decoded, encoded, host));
        let selected = match selected {
            Ok(selected) => selected,
            Err(other) => return Ok(other),
        };
        // The whole columns are loaded once the answer is read: not while its rows are.
        let _load = LoadAfter(prefix.is_some().then_some(self));
        let _timer = self.metrics.gather_time.timer();
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
                files.read_rows(&store, &layout, positions, &wanted).await?
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

    /// Compiles the generated program and loads the columns it reads into the column cache,
    /// in the background, after a run on the CPU path whose plan says so
    /// ([`SelectionPlan::warm_up`]), or a first run over Parquet files that read only their
    /// first rows. One load at a time; a load that does not fit the budget,
    /// or fails, leaves the cache as it was.
    pub(super) fn warm_up(&self) {
        let Some(program) = self.spec.fusion.program.clone() else {
            return;
        };
        let input = Arc::clone(&self.input);
        let context = Arc::clone(&self.context);
        let on_device = self.spec.settings.decode_parquet_on_device;
        CacheLoader::spawn(
            self.spec.device.unwrap_or_default(),
            move |loader| async move {
                // The next run's plan counts a compile the program still needs.
                if let Err(e) = loader.compile(&program) {
                    log::debug!("gpu-topk: the generated program did not compile: {e}");
                }
                if let Err(e) = load_inputs(&input, &context, &program, &loader, on_device).await {
                    log::debug!("gpu-topk: the columns were not loaded into the cache: {e}");
                }
            },
        );
    }

    /// The selection over the whole table; `Err` with how the run goes on where it does not
    /// select (the columns do not fit, or the device failed).
    fn select(
        &self,
        selector: &TableSelector,
        inputs: &[TableInput<'_>],
        rows: usize,
        within: Option<usize>,
    ) -> Result<std::result::Result<TableSelection, WholeTable>> {
        let selected = {
            let _timer = self.metrics.select_time.timer();
            selector.select(inputs, within)
        };
        let selected = match selected {
            Ok(Some(selected)) => selected,
            Ok(None) => return Ok(Err(WholeTable::Stream)),
            Err(e) if self.fell_back("the GPU selection", &e) => return Ok(Err(WholeTable::Cpu)),
            Err(e) => return Err(e),
        };
        if !selected.compile_time.is_zero() {
            self.metrics
                .compile_time
                .add_duration(selected.compile_time);
        }
        self.metrics.rows_in.add(rows);
        self.metrics.rows_passed_filter.add(selected.passed);
        Ok(Ok(selected))
    }

    /// Which of the input's columns the output expressions read.
    fn output_reads(&self) -> Vec<bool> {
        self.reads(&self.spec.output_exprs)
    }

    /// Which of the input's columns the sort keys read.
    fn key_reads(&self) -> Vec<bool> {
        let keys: Vec<_> = self
            .spec
            .sort_exprs
            .iter()
            .map(|s| Arc::clone(&s.expr))
            .collect();
        self.reads(&keys)
    }

    fn reads(&self, exprs: &[Arc<dyn PhysicalExpr>]) -> Vec<bool> {
        let mut read = vec![false; self.input.schema().fields().len()];
        for expr in exprs {
            for column in collect_columns(expr) {
                if let Some(r) = read.get_mut(column.index()) {
                    *r = true;
                }
            }
        }
        read
    }

    /// `n` rows of the input from the columns read (`None`: a column nothing reads, NULLs).
    fn input_rows(&self, columns: Vec<Option<ArrayRef>>, n: usize) -> Result<RecordBatch> {
        let input = self.input.schema();
        let columns: Vec<ArrayRef> = (columns.into_iter().zip(input.fields()))
            .map(|(column, field)| column.unwrap_or_else(|| new_null_array(field.data_type(), n)))
            .collect();
        let fields = input
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true));
        Ok(RecordBatch::try_new(
            Arc::new(Schema::new(fields.collect::<Vec<_>>())),
            columns,
        )?)
    }

    /// A prefix layout's candidates (`rows`: theirs, in `candidates`' order) ranked by their
    /// whole keys as DataFusion's TopK compares them (arrow's row format), ties by position:
    /// the first k, in output order, as indices into `candidates`. `tied` rows tied the k-th
    /// composite.
    fn rank(&self, candidates: &[u64], rows: &RecordBatch, tied: usize) -> Result<Vec<u64>> {
        let keys = (self.spec.sort_exprs.iter())
            .map(|s| s.expr.evaluate(rows)?.into_array(rows.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let converter = RowConverter::new(self.spec.layout.sort_fields())?;
        let encoded = converter.convert_columns(&keys)?;
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_unstable_by(|&a, &b| {
            (encoded.row(a).cmp(&encoded.row(b))).then(candidates[a].cmp(&candidates[b]))
        });
        order.truncate(self.spec.k);
        self.metrics.rows_refined.add(tied);
        Ok(order.into_iter().map(|i| i as u64).collect())
    }

    /// The output from the winners' input columns (`None`: not read by the output), in
    /// output order, `OFFSET` rows included. The k-th winner's first key goes to the dynamic
    /// filter, as the streaming path publishes its threshold.
    fn output(&self, columns: Vec<Option<ArrayRef>>, k: usize) -> Result<RecordBatch> {
        if k == 0 {
            return Ok(RecordBatch::new_empty(Arc::clone(&self.schema)));
        }
        let rows = self.input_rows(columns, k)?;
        // The winners' rows are the operator's memory, as DataFusion's TopK reserves its heap.
        self.reservation.try_grow(rows.get_array_memory_size())?;
        if k == self.spec.k {
            self.publish_final_threshold(&rows.slice(k - 1, 1))?;
        }
        let skip = self.spec.skip.min(k);
        let rows = rows.slice(skip, k - skip);
        let columns: Vec<ArrayRef> = self
            .spec
            .output_exprs
            .iter()
            .map(|e| e.evaluate(&rows)?.into_array(rows.num_rows()))
            .collect::<Result<_>>()?;
        let output = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        self.reservation.try_grow(output.get_array_memory_size())?;
        Ok(output)
    }

    /// Publishes the k-th winner's first key to the dynamic filter (nothing below reads the
    /// table again, but operators that share the filter see where the answer ends).
    fn publish_final_threshold(&self, last: &RecordBatch) -> Result<()> {
        let first = self.spec.sort_exprs.first();
        let key = first.expr.evaluate(last)?.into_array(1)?;
        // Not for floats, as on the streaming path (Parquet statistics leave NaNs out).
        if key.data_type().is_floating() || !self.spec.scans_may_skip_rows() {
            return Ok(());
        }
        let value = datafusion::common::ScalarValue::try_from_array(&key, 0)?;
        self.publisher.publish(first, value)
    }
}
