//! How a result prints in a `.slt` file: shared by the sqllogictest runner and the
//! differential fuzzer, which writes the cases it minimises as `.slt` files.

use datafusion::arrow::array::{Array, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::error::DataFusionError;
use sqllogictest::DefaultColumnType;

pub fn column_type(dt: &DataType) -> DefaultColumnType {
    match dt {
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64 => DefaultColumnType::Integer,
        DataType::Float16 | DataType::Float32 | DataType::Float64 | DataType::Decimal128(..) => {
            DefaultColumnType::FloatingPoint
        }
        _ => DefaultColumnType::Text,
    }
}

pub fn format_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, DataFusionError> {
    let options = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        for r in 0..batch.num_rows() {
            let mut row = Vec::with_capacity(formatters.len());
            for (c, f) in formatters.iter().enumerate() {
                let text = if batch.column(c).is_null(r) {
                    "NULL".to_string()
                } else {
                    f.value(r).to_string()
                };
                row.push(if text.is_empty() {
                    "(empty)".into()
                } else {
                    text
                });
            }
            // Multi-line cells (EXPLAIN plans) become one row per line.
            if row.iter().any(|cell| cell.contains('\n')) {
                for cell in row {
                    rows.extend(cell.lines().map(|l| vec![l.to_string()]));
                }
            } else {
                rows.push(row);
            }
        }
    }
    Ok(rows)
}
