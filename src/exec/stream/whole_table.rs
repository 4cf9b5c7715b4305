//! The operator over a whole table on the GPU: when the input is a memory source (or a scan of
//! Parquet files, [`crate::input::parquet`], run by `parquet_table`) and the generated program reads only its columns, the
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

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, new_null_array};
use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::row::RowConverter;
use datafusion::error::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::utils::collect_columns;

use super::{TopKRun, check_empty_batch};
use crate::cost::{SelectionPlan, policy};
use crate::fusion::FusedProgram;
use crate::input::TableInput;
use crate::input::loader::{CacheLoader, load_inputs};
use crate::input::memory::{gather_rows, memory_input, table_inputs, table_starts};
use crate::select::table::{TableSelection, TableSelector};
use crate::select::{self, Selector};

/// Starts the background load of a run's columns when dropped ([`TopKRun::warm_up`]).
pub(super) struct LoadAfter<'a>(pub(super) Option<&'a TopKRun>);

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
    /// A prefix layout's k-th composite tied more rows than the host ranks at less cost than
    /// the CPU path ([`policy::host_ranked_candidates`]): stream the input on it.
    Ties,
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
        let selected = match self.select(selector, &inputs, rows, within, false)? {
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

    /// Compiles the generated program and loads the columns it reads into the column cache,
    /// in the background, after a run on the CPU path whose plan says so
    /// ([`SelectionPlan::warm_up`]), or a first run over Parquet files that read only their
    /// first rows. One load at a time; a load that does not fit the budget,
    /// or fails, leaves the cache as it was.
    ///
    /// A prefix layout's byte keys may turn out exact once their prefix images are cached
    /// ([`crate::input::columns::resident_layout`]), which changes the layout and the program:
    /// every key column is loaded first, and the program of the layout the next run will plan
    /// is the one compiled and loaded, so that run can take the device.
    pub(super) fn warm_up(&self) {
        let Some(mut program) = self.spec.fusion.program.clone() else {
            return;
        };
        let keys =
            crate::input::columns::key_columns_program(&self.spec.sort_exprs, &self.spec.layout);
        let replan = {
            let spec = &self.spec;
            let (sort_exprs, filter) = (spec.sort_exprs.clone(), spec.filter.clone());
            let (specs, layout) = (spec.layout.specs().to_vec(), spec.layout.clone());
            let input = Arc::clone(&self.input);
            let slot = spec.device;
            move || -> Option<Arc<FusedProgram>> {
                let next = crate::input::columns::resident_layout(&input, &sort_exprs, specs, slot)
                    .ok()
                    .filter(|next| *next != layout)?;
                let schema = input.schema();
                let fusion =
                    crate::fusion::plan(filter.as_ref(), &sort_exprs, &next, &schema, true);
                fusion.program
            }
        };
        let input = Arc::clone(&self.input);
        let context = Arc::clone(&self.context);
        let on_device = self.spec.settings.decode_parquet_on_device;
        CacheLoader::spawn(
            self.spec.device.unwrap_or_default(),
            move |loader| async move {
                if let Some(keys) = &keys {
                    match load_inputs(&input, &context, keys, &loader, on_device).await {
                        Ok(()) => program = replan().unwrap_or(program),
                        Err(e) => log::debug!("gpu-topk: the key columns were not loaded: {e}"),
                    }
                }
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
    /// select (the columns do not fit, the device failed, or a prefix layout's ties are more
    /// than the host ranks for less than the CPU path costs; `from_files`: the candidates
    /// would be read back from Parquet files).
    pub(super) fn select(
        &self,
        selector: &TableSelector,
        inputs: &[TableInput<'_>],
        rows: usize,
        within: Option<usize>,
        from_files: bool,
    ) -> Result<std::result::Result<TableSelection, WholeTable>> {
        let model = (self.spec.prediction.as_ref()).and_then(|p| p.model.as_ref());
        let read = within.map_or(rows, |w| w.min(rows));
        let limit = policy::host_ranked_candidates(self.spec.k, read, model, from_files);
        let selected = {
            let _timer = self.metrics.select_time.timer();
            selector.select(inputs, within, limit)
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
        if selected.unranked {
            // The CPU path counts the rows it reads.
            self.metrics.tie_fallbacks.add(1);
            return Ok(Err(WholeTable::Ties));
        }
        self.metrics.rows_in.add(rows);
        self.metrics.rows_passed_filter.add(selected.passed);
        Ok(Ok(selected))
    }

    /// Which of the input's columns the output expressions read.
    pub(super) fn output_reads(&self) -> Vec<bool> {
        self.reads(&self.spec.output_exprs)
    }

    /// Which of the input's columns the sort keys read.
    pub(super) fn key_reads(&self) -> Vec<bool> {
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
    pub(super) fn input_rows(
        &self,
        columns: Vec<Option<ArrayRef>>,
        n: usize,
    ) -> Result<RecordBatch> {
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
    pub(super) fn rank(
        &self,
        candidates: &[u64],
        rows: &RecordBatch,
        tied: usize,
    ) -> Result<Vec<u64>> {
        let keys = (self.spec.sort_exprs.iter())
            .map(|s| s.expr.evaluate(rows)?.into_array(rows.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let converter = RowConverter::new(self.spec.layout.sort_fields())?;
        let encoded = converter.convert_columns(&keys)?;
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        let by_key_then_position = |&a: &usize, &b: &usize| {
            (encoded.row(a).cmp(&encoded.row(b))).then(candidates[a].cmp(&candidates[b]))
        };
        // Only the first k are sorted: the rest need no order among themselves.
        let k = self.spec.k;
        if k > 0 && k < order.len() {
            order.select_nth_unstable_by(k - 1, by_key_then_position);
        }
        order.truncate(k);
        order.sort_unstable_by(by_key_then_position);
        self.metrics.rows_refined.add(tied);
        Ok(order.into_iter().map(|i| i as u64).collect())
    }

    /// The output from the winners' input columns (`None`: not read by the output), in
    /// output order, `OFFSET` rows included. The k-th winner's first key goes to the dynamic
    /// filter, as the streaming path publishes its threshold.
    pub(super) fn output(&self, columns: Vec<Option<ArrayRef>>, k: usize) -> Result<RecordBatch> {
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
