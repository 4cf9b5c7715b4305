//! What [`crate::SessionStateBuilderExt::with_gpu_topk`] installs in a session: the settings,
//! the rule, the analyzer rule that merges in-memory tables' small batches, the column cache's
//! table functions and the `GPU` table factory.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, BooleanArray, RecordBatch, StringArray, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::catalog::{TableFunction, TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::plan_err;
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::prelude::SessionConfig;

use crate::config::GpuTopKConfig;
use crate::device::column_cache::CacheListing;
use crate::input::compact::CompactTables;
use crate::input::gpu_table::GpuTableFactory;
use crate::rule::GpuTopKRule;

/// Names of the DataFusion rules [`GpuTopKRule`] goes before (the first present):
/// `PushdownSort` lets a Parquet scan read row groups in the sort's order, which would change
/// the input order that ties are broken by; `FilterPushdown(Post)` pushes dynamic filters (ours
/// included) into the scans, so our node must exist by then.
pub(crate) const INSERT_BEFORE_RULES: [&str; 2] = ["PushdownSort", "FilterPushdown(Post)"];

/// Adds the operator to `builder` ([`crate::SessionStateBuilderExt::with_gpu_topk`]).
pub(crate) fn with_gpu_topk(
    mut builder: SessionStateBuilder,
    config: GpuTopKConfig,
) -> SessionStateBuilder {
    let session_config = builder.config().take().unwrap_or_default();
    *builder.config() = Some(with_config_extension(session_config, config.clone()));

    let mut rules = builder
        .physical_optimizers()
        .take()
        .unwrap_or_default()
        .rules;
    rules.retain(|rule| rule.name() != GpuTopKRule::NAME);
    let at = rules
        .iter()
        .position(|rule| INSERT_BEFORE_RULES.contains(&rule.name()))
        .unwrap_or(rules.len());
    rules.insert(at, Arc::new(GpuTopKRule::new(config)));
    *builder.physical_optimizers() = Some(PhysicalOptimizer::with_rules(rules));
    // Added to DataFusion's own analyzer rules when the session is built; a builder made from
    // a session that has it already keeps one.
    if let Some(analyzer) = builder.analyzer() {
        analyzer
            .rules
            .retain(|rule| rule.name() != CompactTables::NAME);
    }
    let analyzers = builder
        .analyzer_rules()
        .get_or_insert_with(Default::default);
    analyzers.retain(|rule| rule.name() != CompactTables::NAME);
    analyzers.push(Arc::new(CompactTables));
    let factories = builder
        .table_factories()
        .get_or_insert_with(Default::default);
    factories.insert("GPU".into(), Arc::new(GpuTableFactory));
    let functions = builder
        .table_functions()
        .get_or_insert_with(Default::default);
    for (name, function) in [
        ("gpu_topk_cache", CacheFunction::List),
        ("gpu_topk_cache_clear", CacheFunction::Clear),
    ] {
        let function = TableFunction::new(name.into(), Arc::new(function));
        functions.insert(name.into(), Arc::new(function));
    }
    builder
}

/// The column cache's table functions.
#[derive(Debug, Clone, Copy)]
enum CacheFunction {
    List,
    Clear,
}

impl TableFunctionImpl for CacheFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        if !args.exprs().is_empty() {
            return plan_err!("gpu_topk_cache functions take no arguments");
        }
        // A device not started yet has an empty cache: listing it does not start it.
        let cache = crate::device::started_gpu();
        let batch = match self {
            CacheFunction::List => {
                let entries = cache.map(|d| d.column_cache.listing()).unwrap_or_default();
                let schema = Arc::new(Schema::new(vec![
                    Field::new("column", DataType::Utf8, false),
                    Field::new("chunks", DataType::UInt64, false),
                    Field::new("bytes", DataType::UInt64, false),
                    Field::new("last_use", DataType::UInt64, false),
                    Field::new("in_use", DataType::Boolean, false),
                    Field::new("pinned", DataType::Boolean, false),
                ]));
                let column = |f: &dyn Fn(&CacheListing) -> u64| {
                    Arc::new(UInt64Array::from_iter_values(entries.iter().map(f))) as ArrayRef
                };
                RecordBatch::try_new(
                    schema,
                    vec![
                        Arc::new(StringArray::from_iter_values(
                            entries.iter().map(|e| e.column.as_str()),
                        )),
                        column(&|e| e.chunks as u64),
                        column(&|e| e.bytes as u64),
                        column(&|e| e.last_use),
                        Arc::new(BooleanArray::from_iter(
                            entries.iter().map(|e| Some(e.in_use)),
                        )),
                        Arc::new(BooleanArray::from_iter(
                            entries.iter().map(|e| Some(e.pinned)),
                        )),
                    ],
                )?
            }
            CacheFunction::Clear => {
                let evicted = cache.as_ref().map_or(0, |d| d.column_cache.clear());
                let held = cache.as_ref().map_or(0, |d| d.column_cache.bytes());
                let schema = Arc::new(Schema::new(vec![
                    Field::new("evicted", DataType::UInt64, false),
                    Field::new("bytes_held", DataType::UInt64, false),
                ]));
                RecordBatch::try_new(
                    schema,
                    vec![
                        Arc::new(UInt64Array::from(vec![evicted as u64])),
                        Arc::new(UInt64Array::from(vec![held as u64])),
                    ],
                )?
            }
        };
        Ok(Arc::new(MemTable::try_new(
            batch.schema(),
            vec![vec![batch]],
        )?))
    }
}

/// Sets (or replaces) the `gpu_topk` extension of a session config.
pub(crate) fn with_config_extension(
    mut session: SessionConfig,
    config: GpuTopKConfig,
) -> SessionConfig {
    match session.options_mut().extensions.get_mut::<GpuTopKConfig>() {
        Some(existing) => *existing = config,
        None => session = session.with_option_extension(config),
    }
    session
}
