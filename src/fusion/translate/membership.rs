//! `[NOT] IN` and string matches: literal lists compared in the kernel, and matches on a
//! dictionary-encoded string column looked up in a mask the host builds per dictionary entry.
//! Apart because only these add kernel inputs of their own.

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Column, InListExpr, Literal};

use super::{CType, Declined, Emitter, KernelInput, Value, literal_bits};

impl Emitter<'_> {
    /// `x [NOT] IN (literals)`, as DataFusion's static filter: NULL when x is NULL, or when x
    /// is not found and the list holds a NULL; floats match by bit pattern (its hash set's
    /// equality: −0.0 ≠ 0.0, a NaN matches only its own bits).
    pub(super) fn in_list(&mut self, in_list: &InListExpr) -> Result<Value, Declined> {
        let a = self.emit(in_list.expr())?;
        let mut found = Vec::new();
        let mut list_has_null = false;
        for item in in_list.list() {
            let literal = item
                .downcast_ref::<Literal>()
                .ok_or_else(|| format!("IN list item {item} is not a literal"))?;
            if literal.value().data_type() != a.data_type {
                return Err(format!(
                    "IN list item {item} of type {} for {}",
                    literal.value().data_type(),
                    a.data_type
                ));
            }
            match literal_bits(literal.value()) {
                None => return Err(format!("IN list of {}", a.data_type)),
                Some(None) => list_has_null = true,
                Some(Some(bits)) => found.push(match a.ctype {
                    CType::F32 => format!("__float_as_uint({}) == 0x{:08x}u", a.value, bits as u32),
                    CType::F64 => {
                        format!("(u64)__double_as_longlong({}) == 0x{bits:016x}ull", a.value)
                    }
                    CType::Bool => format!("{} == {}", a.value, bits != 0),
                    t => format!("{} == ({})0x{bits:x}ull", a.value, t.name()),
                }),
            }
        }
        let found = if found.is_empty() {
            "false".to_string()
        } else {
            format!("({})", found.join(" || "))
        };
        let found = self.define(DataType::Boolean, CType::Bool, found, "true".into());
        Ok(self.in_result(&found.value, &a.valid, in_list.negated(), list_has_null))
    }

    /// A dictionary-encoded string column (or its cast to the value type): its index and the
    /// type of its codes.
    fn dictionary_column(&self, expr: &Arc<dyn PhysicalExpr>) -> Option<(usize, CType)> {
        let expr = match expr.downcast_ref::<CastExpr>() {
            Some(cast) if matches!(cast.cast_type(), DataType::Utf8 | DataType::LargeUtf8) => {
                cast.expr()
            }
            _ => expr,
        };
        let column = expr.downcast_ref::<Column>()?;
        match self.schema.fields().get(column.index())?.data_type() {
            DataType::Dictionary(key, value)
                if matches!(value.as_ref(), DataType::Utf8 | DataType::LargeUtf8)
                    && key.is_integer() =>
            {
                Some((column.index(), CType::for_data_type(key)?))
            }
            _ => None,
        }
    }

    /// `column [NOT] IN ('literals')`, `column = 'literal'`, `column <> 'literal'`, or an `OR`
    /// of the non-negated ones, on one dictionary-encoded string column: the column, its codes'
    /// type, the values and whether the match is negated. Such an `OR` is exactly
    /// `column IN (all the values)` in SQL's three-valued logic: TRUE where the row's value is
    /// one of them, else NULL where it or a listed value is NULL, else FALSE.
    pub(super) fn dictionary_membership(
        &self,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Option<(usize, CType, Vec<Option<String>>, bool)> {
        if let Some(in_list) = expr.downcast_ref::<InListExpr>() {
            let (c, codes) = self.dictionary_column(in_list.expr())?;
            let values = in_list
                .list()
                .iter()
                .map(string_literal)
                .collect::<Option<Vec<_>>>()?;
            return Some((c, codes, values, in_list.negated()));
        }
        let binary = expr.downcast_ref::<BinaryExpr>()?;
        match *binary.op() {
            op @ (Operator::Eq | Operator::NotEq) => [
                (binary.left(), binary.right()),
                (binary.right(), binary.left()),
            ]
            .into_iter()
            .find_map(|(column, literal)| {
                let (c, codes) = self.dictionary_column(column)?;
                Some((
                    c,
                    codes,
                    vec![string_literal(literal)?],
                    op == Operator::NotEq,
                ))
            }),
            Operator::Or => {
                let (c, codes, mut values, negated) = self.dictionary_membership(binary.left())?;
                let (c2, _, more, negated2) = self.dictionary_membership(binary.right())?;
                (c == c2 && !negated && !negated2).then(|| {
                    values.extend(more);
                    (c, codes, values, false)
                })
            }
            _ => None,
        }
    }

    /// `column [NOT] IN (values)` (also `=` and `<>` with one value) on a dictionary-encoded
    /// string column: the row's code looked up in the host's per-entry match mask. NULL when
    /// the code or its entry is NULL, or when nothing matched and a value is NULL (SQL's IN).
    pub(super) fn dictionary_in(
        &mut self,
        column: usize,
        codes: CType,
        values: Vec<Option<String>>,
        negated: bool,
    ) -> Value {
        let has_null = values.iter().any(Option::is_none);
        let mut values: Vec<String> = values.into_iter().flatten().collect();
        values.sort_unstable();
        values.dedup();
        let p = self.input(KernelInput::DictionaryCodes(column));
        let (code, code_valid) = self.read_input(p, codes);
        let q = self.input(KernelInput::DictionaryMatch { column, values });
        let found = self.define(
            DataType::Boolean,
            CType::Bool,
            format!("{code_valid} && get_bit(c{q}, c{q}_bit + (u64){code})"),
            format!(
                "{code_valid} && (c{q}_valid == nullptr || get_bit(c{q}_valid, c{q}_valid_bit + (u64){code}))"
            ),
        );
        self.in_result(&found.value, &found.valid, negated, has_null)
    }

    /// SQL's `[NOT] IN` from whether the value was found: NULL where `valid` is false (a NULL
    /// value), or where nothing was found and the list holds a NULL.
    pub(super) fn in_result(
        &mut self,
        found: &str,
        valid: &str,
        negated: bool,
        list_has_null: bool,
    ) -> Value {
        let value = if negated {
            format!("!{found}")
        } else {
            found.to_string()
        };
        let valid = if list_has_null {
            format!("{valid} && {found}")
        } else {
            valid.to_string()
        };
        self.define(DataType::Boolean, CType::Bool, value, valid)
    }
}

/// A string literal (plain or dictionary-typed): `Some(None)` for a NULL string.
fn string_literal(expr: &Arc<dyn PhysicalExpr>) -> Option<Option<String>> {
    fn of(scalar: &ScalarValue) -> Option<Option<String>> {
        match scalar {
            ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) | ScalarValue::Utf8View(v) => {
                Some(v.clone())
            }
            ScalarValue::Dictionary(_, inner) => of(inner),
            _ => None,
        }
    }
    of(expr.downcast_ref::<Literal>()?.value())
}
