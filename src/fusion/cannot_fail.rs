//! Expressions no row can make fail, by the two rules the operator needs. A row whose sort
//! key or predicate fails (an overflow, a division by zero, a failing cast) must reach the
//! operator, which then fails with DataFusion's error; where nothing can fail, rows may be
//! skipped or evaluated elsewhere:
//! - [`arithmetic`]: the value expressions the rule absorbs from a projection below the sort,
//!   and that a Parquet scan computes for the column cache;
//! - [`predicate`]: the filters under which the scans below may skip the rows the threshold
//!   rules out.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;

/// Columns, literals, casts of numbers to floating point, and floating-point `+`, `-`, `*`
/// and negation of those: no row makes them fail (floating point overflows to infinity).
pub(crate) fn arithmetic(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> bool {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Literal, NegativeExpr};
    if expr.is::<Column>() || expr.is::<Literal>() {
        return true;
    }
    let floating = |e: &Arc<dyn PhysicalExpr>| e.data_type(schema).is_ok_and(|t| t.is_floating());
    if !floating(expr) {
        return false;
    }
    if let Some(cast) = expr.downcast_ref::<CastExpr>() {
        let from = cast.expr().data_type(schema);
        return from.is_ok_and(|t| t.is_numeric()) && arithmetic(cast.expr(), schema);
    }
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        let plus_minus_times = matches!(
            binary.op(),
            Operator::Plus | Operator::Minus | Operator::Multiply
        );
        return plus_minus_times
            && [binary.left(), binary.right()]
                .into_iter()
                .all(|e| floating(e) && arithmetic(e, schema));
    }
    if let Some(negative) = expr.downcast_ref::<NegativeExpr>() {
        return arithmetic(negative.arg(), schema);
    }
    false
}

/// An expression that cannot fail on any row: columns, literals, comparisons, `AND`, `OR`,
/// `NOT`, `IS [NOT] NULL` and `IN` lists of those.
pub(crate) fn predicate(expr: &Arc<dyn PhysicalExpr>) -> bool {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{
        BinaryExpr, InListExpr, IsNotNullExpr, IsNullExpr, Literal, NotExpr,
    };
    let children_cannot_fail = || expr.children().into_iter().all(predicate);
    if expr.downcast_ref::<Column>().is_some() || expr.downcast_ref::<Literal>().is_some() {
        return true;
    }
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        let safe = matches!(
            binary.op(),
            Operator::Eq
                | Operator::NotEq
                | Operator::Lt
                | Operator::LtEq
                | Operator::Gt
                | Operator::GtEq
                | Operator::And
                | Operator::Or
                | Operator::IsDistinctFrom
                | Operator::IsNotDistinctFrom
        );
        return safe && children_cannot_fail();
    }
    let logical = expr.downcast_ref::<NotExpr>().is_some()
        || expr.downcast_ref::<IsNullExpr>().is_some()
        || expr.downcast_ref::<IsNotNullExpr>().is_some()
        || expr.downcast_ref::<InListExpr>().is_some();
    logical && children_cannot_fail()
}
