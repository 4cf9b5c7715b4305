//! Predicates on plain string columns: comparisons with literals, `[NOT] IN` lists,
//! `[NOT] LIKE`, `starts_with`, `ends_with`, `IS [NOT] NULL`, `character_length` and
//! `octet_length`, over each row's bytes (a [`KernelInput::StringColumn`]: the column's row
//! ends and bytes, which the column cache holds for whole tables). Byte-wise, as arrow
//! compares UTF-8. Strings are no device values of their own: each node here takes a string
//! column and literals and gives a boolean or an integer, and any other use of a string
//! column (a cast, `lower`, a comparison of two columns) is declined.
//!
//! A `LIKE` pattern is compiled on the host as arrow reads it (`\` escapes the next
//! character, a trailing `\` is itself; `%` any characters, `_` one character) into bytes
//! with two marks (fused.cuh `LIKE_ANY`, `LIKE_ONE`); the common shapes (`'abc'`, `'abc%'`,
//! `'%abc'`, `'%abc%'`) get their direct tests.

use std::fmt::Write;
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{
    BinaryExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr, Literal,
};

use super::{CType, Declined, Emitter, KernelInput, Value};

/// `LIKE`'s `%` and `_` in a compiled pattern (fused.cuh).
const LIKE_ANY: u8 = 0xFF;
const LIKE_ONE: u8 = 0xFE;

/// Whether the device reads columns of `data_type` as strings.
pub(crate) fn is_device_string(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

impl Emitter<'_> {
    /// The string predicate `expr` is, translated; `None` where `expr` is none of this
    /// module's shapes.
    pub(super) fn string_node(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Option<Result<Value, Declined>> {
        let any = expr.as_ref();
        if let Some(binary) = any.downcast_ref::<BinaryExpr>() {
            return self.string_comparison(binary);
        }
        if let Some(in_list) = any.downcast_ref::<InListExpr>() {
            self.string_column_index(in_list.expr())?;
            return Some(self.string_in(in_list));
        }
        if let Some(like) = any.downcast_ref::<LikeExpr>() {
            self.string_column_index(like.expr())?;
            return Some(self.string_like(expr, like));
        }
        if let Some(is_null) = any.downcast_ref::<IsNullExpr>() {
            self.string_column_index(is_null.arg())?;
            return Some(self.string_column(is_null.arg()).map(|(_, valid)| {
                self.define(
                    DataType::Boolean,
                    CType::Bool,
                    format!("!{valid}"),
                    "true".into(),
                )
            }));
        }
        if let Some(is_not_null) = any.downcast_ref::<IsNotNullExpr>() {
            self.string_column_index(is_not_null.arg())?;
            return Some(self.string_column(is_not_null.arg()).map(|(_, valid)| {
                self.define(DataType::Boolean, CType::Bool, valid, "true".into())
            }));
        }
        if let Some(function) = any.downcast_ref::<ScalarFunctionExpr>() {
            let first = function.args().first()?;
            self.string_column_index(first)?;
            return Some(self.string_function(expr, function));
        }
        None
    }

    /// The input index of `expr` where it is a plain string column.
    fn string_column_index(&self, expr: &Arc<dyn PhysicalExpr>) -> Option<usize> {
        let column = expr.downcast_ref::<Column>()?;
        let field = self.schema.fields().get(column.index())?;
        is_device_string(field.data_type()).then_some(column.index())
    }

    /// The index of `expr`, a plain string column of a whole table (the only input whose
    /// strings the device reads), or why the device cannot: it `does` nothing else.
    fn whole_string_column(
        &self,
        expr: &Arc<dyn PhysicalExpr>,
        does: &str,
    ) -> Result<usize, Declined> {
        let Some(c) = self.string_column_index(expr) else {
            return Err(format!("{expr} is no plain string column"));
        };
        if !self.strings {
            return Err(format!(
                "{expr}: the device {does} of whole tables only (in memory or Parquet)"
            ));
        }
        Ok(c)
    }

    /// The row's string (`Str`) of the string column `expr`, and its validity: C names.
    pub(crate) fn string_column(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Result<(String, String), Declined> {
        let c = self.whole_string_column(expr, "reads strings")?;
        let p = self.input(KernelInput::StringColumn(c));
        let (value, valid) = (format!("x{p}"), format!("x{p}v"));
        if !self.loaded.contains(&p) {
            self.loaded.push(p);
            self.loads.push(super::Load {
                ctype: "Str".to_string(),
                value: value.clone(),
                valid: valid.clone(),
                read: format!("load_str(c{p}, c{p}_bit, i)"),
                valid_read: format!(
                    "c{p}_valid == nullptr || get_bit(c{p}_valid, c{p}_valid_bit + i)"
                ),
                vector: None,
            });
        }
        Ok((value, valid))
    }

    /// The row's order-preserving code (`StringCodes`, an `i64`) of the string column `expr`,
    /// and its validity: C names. What a group key of strings is aggregated by.
    pub(crate) fn string_codes(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Result<(String, String), Declined> {
        let c = self.whole_string_column(expr, "groups by strings")?;
        let p = self.input(KernelInput::StringCodes(c));
        Ok(self.read_input(p, CType::I64))
    }

    /// A boolean NULL: what a comparison with a NULL literal gives.
    fn null_boolean(&mut self) -> Value {
        self.define(
            DataType::Boolean,
            CType::Bool,
            "false".into(),
            "false".into(),
        )
    }

    /// A device array holding `bytes`: its C name.
    fn string_constant(&mut self, bytes: &[u8]) -> String {
        let name = format!("s{}", self.constants);
        self.constants += 1;
        let mut list = String::new();
        for (i, b) in bytes.iter().enumerate() {
            if i > 0 {
                list.push(',');
            }
            let _ = write!(list, "{b}");
        }
        if bytes.is_empty() {
            list.push('0');
        }
        let _ = writeln!(self.globals, "__device__ const u8 {name}[] = {{{list}}};");
        name
    }

    /// `column op literal` (either side first) for the six comparisons.
    fn string_comparison(&mut self, binary: &BinaryExpr) -> Option<Result<Value, Declined>> {
        let op = *binary.op();
        let (column, literal, op) = if self.string_column_index(binary.left()).is_some() {
            (binary.left(), binary.right(), op)
        } else if self.string_column_index(binary.right()).is_some() {
            (binary.right(), binary.left(), op.swap()?)
        } else {
            return None;
        };
        let cmp = match op {
            Operator::Eq => "==",
            Operator::NotEq => "!=",
            Operator::Lt => "<",
            Operator::LtEq => "<=",
            Operator::Gt => ">",
            Operator::GtEq => ">=",
            _ => return None,
        };
        Some((|| {
            let text = string_literal(literal)
                .ok_or_else(|| format!("{op} of a string column and {literal}"))?;
            let (s, valid) = self.string_column(column)?;
            let Some(text) = text else {
                return Ok(self.null_boolean());
            };
            let lit = self.string_constant(text.as_bytes());
            let n = text.len();
            let value = match op {
                Operator::Eq => format!("str_eq({s}, {lit}, {n})"),
                Operator::NotEq => format!("!str_eq({s}, {lit}, {n})"),
                _ => format!("str_cmp({s}, {lit}, {n}) {cmp} 0"),
            };
            Ok(self.define(DataType::Boolean, CType::Bool, value, valid))
        })())
    }

    /// `column [NOT] IN (literals)`: NULL where the value is NULL, or where it is not found
    /// and the list holds a NULL.
    fn string_in(&mut self, in_list: &InListExpr) -> Result<Value, Declined> {
        let (s, valid) = self.string_column(in_list.expr())?;
        let mut found = Vec::new();
        let mut list_has_null = false;
        for item in in_list.list() {
            match string_literal(item) {
                None => return Err(format!("IN list item {item} is no string literal")),
                Some(None) => list_has_null = true,
                Some(Some(text)) => {
                    let lit = self.string_constant(text.as_bytes());
                    found.push(format!("str_eq({s}, {lit}, {})", text.len()));
                }
            }
        }
        let found = if found.is_empty() {
            "false".to_string()
        } else {
            format!("({})", found.join(" || "))
        };
        let found = self.define(DataType::Boolean, CType::Bool, found, "true".into());
        Ok(self.in_result(&found.value, &valid, in_list.negated(), list_has_null))
    }

    /// `column [NOT] LIKE 'pattern'` (case-sensitive; `ILIKE` is declined).
    fn string_like(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        like: &LikeExpr,
    ) -> Result<Value, Declined> {
        if like.case_insensitive() {
            return Err(format!("{expr}: no device translation of ILIKE"));
        }
        let pattern = string_literal(like.pattern())
            .ok_or_else(|| format!("{expr}: the pattern is no string literal"))?;
        let (s, valid) = self.string_column(like.expr())?;
        let Some(pattern) = pattern else {
            return Ok(self.null_boolean());
        };
        let compiled = compile_like(&pattern);
        let test = match like_shape(&compiled) {
            Some((function, literal)) => {
                let lit = self.string_constant(literal);
                format!("{function}({s}, {lit}, {})", literal.len())
            }
            None => {
                let pat = self.string_constant(&compiled);
                format!("str_like({s}, {pat}, {})", compiled.len())
            }
        };
        let value = if like.negated() {
            format!("!{test}")
        } else {
            test
        };
        Ok(self.define(DataType::Boolean, CType::Bool, value, valid))
    }

    /// `starts_with`, `ends_with` (with a literal), `character_length` (`length`,
    /// `char_length`) and `octet_length` of a string column.
    fn string_function(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        function: &ScalarFunctionExpr,
    ) -> Result<Value, Declined> {
        let args = function.args();
        let name = function.fun().name();
        match (name, args) {
            ("starts_with" | "ends_with", [column, literal]) => {
                let text = string_literal(literal)
                    .ok_or_else(|| format!("{expr}: the second argument is no string literal"))?;
                let (s, valid) = self.string_column(column)?;
                let Some(text) = text else {
                    return Ok(self.null_boolean());
                };
                let lit = self.string_constant(text.as_bytes());
                let test = if name == "starts_with" {
                    "str_starts"
                } else {
                    "str_ends"
                };
                let value = format!("{test}({s}, {lit}, {})", text.len());
                Ok(self.define(DataType::Boolean, CType::Bool, value, valid))
            }
            ("character_length" | "octet_length", [column]) => {
                let data_type = function.return_type().clone();
                let ctype = match data_type {
                    DataType::Int32 => CType::I32,
                    DataType::Int64 => CType::I64,
                    _ => return Err(format!("{expr} has type {data_type}")),
                };
                let (s, valid) = self.string_column(column)?;
                let count = if name == "octet_length" {
                    format!("{s}.n")
                } else {
                    format!("str_chars({s})")
                };
                Ok(self.define(
                    data_type,
                    ctype,
                    format!("({})({count})", ctype.name()),
                    valid,
                ))
            }
            _ => Err(format!(
                "{expr}: no device translation of this string function"
            )),
        }
    }
}

/// A string literal's text (`Some(None)`: a NULL string); `None` where `expr` is no string
/// literal.
fn string_literal(expr: &Arc<dyn PhysicalExpr>) -> Option<Option<String>> {
    match expr.downcast_ref::<Literal>()?.value() {
        ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) | ScalarValue::Utf8View(v) => {
            Some(v.clone())
        }
        _ => None,
    }
}

/// A `LIKE` pattern as fused.cuh's `str_like` reads it: literal bytes, `LIKE_ANY` for `%`
/// (runs of them as one), `LIKE_ONE` for `_`; `\` takes the next character literally, and a
/// trailing `\` is a literal `\` (arrow's reading of the pattern).
pub(crate) fn compile_like(pattern: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    let mut utf8 = [0u8; 4];
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let literal = chars.next().unwrap_or('\\');
                out.extend_from_slice(literal.encode_utf8(&mut utf8).as_bytes());
            }
            '%' => {
                if out.last() != Some(&LIKE_ANY) {
                    out.push(LIKE_ANY);
                }
            }
            '_' => out.push(LIKE_ONE),
            c => out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes()),
        }
    }
    out
}

/// The direct test a compiled pattern amounts to, with its literal: equality, a prefix, a
/// suffix or an infix; `None` where it needs `str_like`.
fn like_shape(compiled: &[u8]) -> Option<(&'static str, &[u8])> {
    let plain = |bytes: &[u8]| !bytes.iter().any(|&b| b == LIKE_ANY || b == LIKE_ONE);
    let lead = compiled.first() == Some(&LIKE_ANY);
    let trail = compiled.len() > usize::from(lead) && compiled.last() == Some(&LIKE_ANY);
    let inner = &compiled[usize::from(lead)..compiled.len() - usize::from(trail)];
    if !plain(inner) {
        return None;
    }
    Some(match (lead, trail) {
        (false, false) => ("str_eq", inner),
        (false, true) => ("str_starts", inner),
        (true, false) => ("str_ends", inner),
        (true, true) => ("str_contains", inner),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_patterns_compile_as_arrow_reads_them() {
        assert_eq!(compile_like("a%%b_"), vec![b'a', LIKE_ANY, b'b', LIKE_ONE]);
        assert_eq!(compile_like(r"\%\_\\x\"), b"%_\\x\\".to_vec());
        assert_eq!(compile_like("é_"), vec![0xC3, 0xA9, LIKE_ONE]);
        assert_eq!(
            like_shape(&compile_like("abc")),
            Some(("str_eq", &b"abc"[..]))
        );
        assert_eq!(
            like_shape(&compile_like("ab%")),
            Some(("str_starts", &b"ab"[..]))
        );
        assert_eq!(
            like_shape(&compile_like("%ab")),
            Some(("str_ends", &b"ab"[..]))
        );
        assert_eq!(
            like_shape(&compile_like("%ab%")),
            Some(("str_contains", &b"ab"[..]))
        );
        assert_eq!(like_shape(&compile_like("%")), Some(("str_ends", &b""[..])));
        assert_eq!(like_shape(&compile_like("")), Some(("str_eq", &b""[..])));
        assert_eq!(
            like_shape(&compile_like(r"%\%%")),
            Some(("str_contains", &b"%"[..]))
        );
        assert_eq!(like_shape(&compile_like("a%b")), None);
        assert_eq!(like_shape(&compile_like("_")), None);
    }
}
