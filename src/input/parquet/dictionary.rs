//! Dictionary-encoded columns cached as codes of one dictionary for all row groups, and the
//! dictionaries kept beside their entries.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};

use crate::device::column_cache::CacheKey;

/// The dictionaries of dictionary-encoded columns whose codes the column cache holds, by the
/// codes' cache key: a query reading the codes looks its entries up in them. Process-wide, as
/// the column cache whose entries they belong to is.
static DICTIONARIES: LazyLock<Mutex<HashMap<CacheKey, ArrayRef>>> = LazyLock::new(Default::default);
/// Dictionaries kept at most (a new one past this starts the map afresh).
const MAX_DICTIONARIES: usize = 1024;

/// Keeps `values`, the dictionary of the codes cached under `key`.
pub(crate) fn keep_dictionary(key: &CacheKey, values: ArrayRef) {
    if let Ok(mut kept) = DICTIONARIES.lock() {
        if kept.len() >= MAX_DICTIONARIES {
            kept.clear();
        }
        kept.insert(key.clone(), values);
    }
}

/// The dictionary of the codes cached under `key`, if kept.
pub(crate) fn kept_dictionary(key: &CacheKey) -> Option<ArrayRef> {
    DICTIONARIES.lock().ok()?.get(key).cloned()
}

/// A dictionary-encoded string column's row groups (each with its own dictionary) as codes
/// into one dictionary for all of them: each chunk's keys renumbered (their type and NULLs
/// kept), and the dictionary, its entries in the order they first appear in the row groups'
/// dictionaries (so reading the same files again numbers them alike). An error where the
/// chunks are not string dictionaries or the entries outnumber the key type.
pub(crate) fn global_codes(chunks: &[ArrayRef]) -> Result<(Vec<ArrayRef>, ArrayRef)> {
    use datafusion::arrow::array::{Array, AsArray, PrimitiveArray, StringArray};
    use datafusion::arrow::datatypes::{
        ArrowDictionaryKeyType, ArrowNativeType, Int8Type, Int16Type, Int32Type, Int64Type,
        UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    /// `chunk`'s keys as the codes `table` gives its entries.
    fn renumber<K: ArrowDictionaryKeyType>(chunk: &ArrayRef, table: &[usize]) -> Result<ArrayRef> {
        let keys = chunk.as_dictionary::<K>().keys();
        let codes: Vec<K::Native> = (table.iter())
            .map(|&code| K::Native::from_usize(code))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                DataFusionError::Execution(format!(
                    "{} dictionary entries do not fit {} keys",
                    table.iter().max().map_or(0, |m| m + 1),
                    K::DATA_TYPE
                ))
            })?;
        let renumbered: PrimitiveArray<K> =
            keys.unary_opt(|k| k.to_usize().and_then(|k| codes.get(k).copied()));
        if renumbered.null_count() != keys.null_count() {
            return Err(DataFusionError::Execution(
                "a dictionary key outside its dictionary".into(),
            ));
        }
        Ok(Arc::new(renumbered))
    }
    // Each row group's entries numbered in the order they first appear (dictionaries are
    // small), then every row's key renumbered, the row groups spread over the cores.
    let (mut entries, mut order) = (HashMap::new(), Vec::new());
    let mut tables = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        let Some(dictionary) = chunk.as_any_dictionary_opt() else {
            return Err(DataFusionError::Execution(format!(
                "codes of a {} column",
                chunk.data_type()
            )));
        };
        let values = datafusion::arrow::compute::cast(dictionary.values(), &DataType::Utf8)?;
        let table: Vec<usize> = (values.as_string::<i32>().iter())
            .map(|entry| {
                let next = order.len();
                *entries.entry(entry.map(str::to_string)).or_insert_with(|| {
                    order.push(entry.map(str::to_string));
                    next
                })
            })
            .collect();
        tables.push(table);
    }
    let work: Vec<(&ArrayRef, Vec<usize>)> = chunks.iter().zip(tables).collect();
    let codes = crate::input::strings::on_cores(work, |(chunk, table)| {
        let DataType::Dictionary(key, _) = chunk.data_type() else {
            unreachable!("checked above");
        };
        let renumbered = match key.as_ref() {
            DataType::Int8 => renumber::<Int8Type>(chunk, &table),
            DataType::Int16 => renumber::<Int16Type>(chunk, &table),
            DataType::Int32 => renumber::<Int32Type>(chunk, &table),
            DataType::Int64 => renumber::<Int64Type>(chunk, &table),
            DataType::UInt8 => renumber::<UInt8Type>(chunk, &table),
            DataType::UInt16 => renumber::<UInt16Type>(chunk, &table),
            DataType::UInt32 => renumber::<UInt32Type>(chunk, &table),
            DataType::UInt64 => renumber::<UInt64Type>(chunk, &table),
            other => Err(DataFusionError::Execution(format!(
                "{other} dictionary keys"
            ))),
        };
        renumbered.map_err(|e| crate::device::GpuError(e.to_string()))
    })
    .map_err(|e| DataFusionError::Execution(e.0))?;
    let values: StringArray = order.into_iter().collect();
    Ok((codes, Arc::new(values)))
}
