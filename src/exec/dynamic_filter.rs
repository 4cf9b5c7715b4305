//! The threshold our operator publishes to the scans below (DataFusion's dynamic filters).
//!
//! Once `k` candidates exist, a row whose first sort key is worse than the k-th candidate's can
//! never win. The published predicate is **non-strict** (`key <= v` for ASC, `key >= v` for
//! DESC): a row *equal* to the threshold may still win its tie on row id (an earlier partition
//! read later), so only strictly worse rows may be pruned. Only the first key is used: it is
//! what row-group statistics can prune on, and it keeps the predicate obviously correct.

use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, is_null, lit};
use datafusion::physical_expr::{PhysicalExpr, PhysicalSortExpr};

/// The predicate that keeps every row that can still win, given the k-th candidate's first
/// key value; `None` when every row can (nothing to publish).
pub(crate) fn threshold_predicate(
    key: &PhysicalSortExpr,
    value: &ScalarValue,
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let nulls_first = key.options.nulls_first;
    if value.is_null() {
        // The k-th candidate is NULL: with NULLS FIRST only NULLs can still win; with NULLS
        // LAST every row is at least as good.
        return nulls_first
            .then(|| is_null(Arc::clone(&key.expr)))
            .transpose();
    }
    let op = if key.options.descending {
        Operator::GtEq
    } else {
        Operator::LtEq
    };
    let comparison: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
        Arc::clone(&key.expr),
        op,
        lit(value.clone()),
    ));
    Ok(Some(if nulls_first {
        Arc::new(BinaryExpr::new(
            is_null(Arc::clone(&key.expr))?,
            Operator::Or,
            comparison,
        ))
    } else {
        // NULL compares to NULL, which a filter drops: right, NULLs sort after `value`.
        comparison
    }))
}
