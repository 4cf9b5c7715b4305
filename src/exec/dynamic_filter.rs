//! The threshold our operator publishes to the scans below (DataFusion's dynamic filters).
//!
//! Once `k` candidates exist, a row whose first sort key is worse than the k-th candidate's can
//! never win. The published predicate is **non-strict** (`key <= v` for ASC, `key >= v` for
//! DESC): a row *equal* to the threshold may still win its tie on row id (an earlier partition
//! read later), so only strictly worse rows may be pruned. Only the first key is used: it is
//! what row-group statistics can prune on, and it keeps the predicate obviously correct.
//!
//! The parts of a top-k split between devices share one threshold ([`SharedThreshold`]): the
//! best k-th key of any part goes to every part's scans.

use std::sync::{Arc, Mutex};

use datafusion::arrow::compute::SortOptions;
use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, DynamicFilterPhysicalExpr, is_null, lit};
use datafusion::physical_expr::{PhysicalExpr, PhysicalSortExpr};

/// The threshold of operators whose rows one merge ranks (the parts of a top-k split between
/// devices, each over a share of the same scan). A part's k-th first key `v` is the bound of k
/// rows of the whole input, so a row strictly worse than `v` cannot win in any part: every
/// part publishes its threshold here, and the best so far goes to every part's dynamic filter.
#[derive(Debug)]
pub(crate) struct SharedThreshold {
    filters: Vec<Arc<DynamicFilterPhysicalExpr>>,
    best: Mutex<Option<ScalarValue>>,
}

impl SharedThreshold {
    /// A threshold shared by the operators that publish to `filters` (theirs, one each).
    pub(crate) fn new(filters: Vec<Arc<DynamicFilterPhysicalExpr>>) -> Self {
        Self {
            filters,
            best: Mutex::new(None),
        }
    }

    /// Offers one part's k-th first key; when it is the best so far, every part's filter
    /// is tightened to it.
    pub(crate) fn publish(&self, key: &PhysicalSortExpr, value: ScalarValue) -> Result<()> {
        let mut best = self.best.lock().unwrap_or_else(|e| e.into_inner());
        if best
            .as_ref()
            .is_some_and(|best| !sorts_before(&value, best, key.options))
        {
            return Ok(());
        }
        if let Some(predicate) = threshold_predicate(key, &value)? {
            for filter in &self.filters {
                filter.update(Arc::clone(&predicate))?;
            }
        }
        *best = Some(value);
        Ok(())
    }

    /// Forgets the best threshold, for the next execution (each part resets its own filter).
    pub(crate) fn reset(&self) {
        *self.best.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Where an operator publishes its threshold: its own dynamic filter, or the threshold it
/// shares with the other parts of a split top-k.
#[derive(Clone)]
pub(crate) struct Publisher {
    pub own: Arc<DynamicFilterPhysicalExpr>,
    pub shared: Option<Arc<SharedThreshold>>,
}

impl Publisher {
    /// Publishes the k-th candidate's first key `value` to the scans below.
    pub(crate) fn publish(&self, key: &PhysicalSortExpr, value: ScalarValue) -> Result<()> {
        match &self.shared {
            Some(shared) => shared.publish(key, value),
            None => match threshold_predicate(key, &value)? {
                Some(predicate) => self.own.update(predicate),
                None => Ok(()),
            },
        }
    }
}

/// Whether first-key value `a` sorts strictly before `b` under `options` (values that do not
/// compare, never).
fn sorts_before(a: &ScalarValue, b: &ScalarValue, options: SortOptions) -> bool {
    match (a.is_null(), b.is_null()) {
        (true, true) => false,
        (true, false) => options.nulls_first,
        (false, true) => !options.nulls_first,
        (false, false) => a
            .partial_cmp(b)
            .is_some_and(|order| match options.descending {
                true => order.is_gt(),
                false => order.is_lt(),
            }),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::expressions::col;

    fn key(descending: bool, nulls_first: bool) -> PhysicalSortExpr {
        let schema = Schema::new(vec![Field::new("v", DataType::Int64, true)]);
        let options = SortOptions {
            descending,
            nulls_first,
        };
        PhysicalSortExpr::new(col("v", &schema).unwrap(), options)
    }

    fn filter(key: &PhysicalSortExpr) -> Arc<DynamicFilterPhysicalExpr> {
        Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::clone(&key.expr)],
            lit(true),
        ))
    }

    fn text(filter: &DynamicFilterPhysicalExpr) -> String {
        filter.current().unwrap().to_string()
    }

    #[test]
    fn every_part_gets_the_best_threshold_of_all() {
        let key = key(true, false);
        let (a, b) = (filter(&key), filter(&key));
        let shared = SharedThreshold::new(vec![Arc::clone(&a), Arc::clone(&b)]);
        shared.publish(&key, ScalarValue::Int64(Some(10))).unwrap();
        assert_eq!(
            (text(&a), text(&b)),
            ("v@0 >= 10".into(), "v@0 >= 10".into())
        );
        // A looser threshold (DESC: smaller) changes nothing; a tighter one moves both.
        shared.publish(&key, ScalarValue::Int64(Some(7))).unwrap();
        assert_eq!(text(&b), "v@0 >= 10");
        shared.publish(&key, ScalarValue::Int64(Some(12))).unwrap();
        assert_eq!(
            (text(&a), text(&b)),
            ("v@0 >= 12".into(), "v@0 >= 12".into())
        );
        // A NULL k-th key under NULLS LAST rules nothing out: looser than any value.
        shared.publish(&key, ScalarValue::Int64(None)).unwrap();
        assert_eq!(text(&a), "v@0 >= 12");
        shared.reset();
        shared.publish(&key, ScalarValue::Int64(Some(3))).unwrap();
        assert_eq!(text(&a), "v@0 >= 3");
    }

    #[test]
    fn ascending_and_nulls_first_thresholds_tighten_the_right_way() {
        let asc = key(false, true);
        let a = filter(&asc);
        let shared = SharedThreshold::new(vec![Arc::clone(&a)]);
        shared.publish(&asc, ScalarValue::Int64(Some(5))).unwrap();
        shared.publish(&asc, ScalarValue::Int64(Some(9))).unwrap();
        assert_eq!(text(&a), "v@0 IS NULL OR v@0 <= 5");
        // NULLs first: a NULL k-th key leaves only NULLs, the tightest bound.
        shared.publish(&asc, ScalarValue::Int64(None)).unwrap();
        assert_eq!(text(&a), "v@0 IS NULL");
        shared.publish(&asc, ScalarValue::Int64(Some(1))).unwrap();
        assert_eq!(text(&a), "v@0 IS NULL");
    }
}
