//! Binary operators and casts: three-valued logic, comparisons, wrapping and IEEE arithmetic,
//! numeric casts by arrow's ranges. Together because one set of rules keeps them exact:
//! fused.cuh's arithmetic, and a `host_only` guard wherever DataFusion would fail.

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::BinaryExpr;

use super::{CType, Declined, Emitter, Value};

impl Emitter<'_> {
    pub(super) fn binary(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        binary: &BinaryExpr,
    ) -> Result<Value, Declined> {
        // `fail_on_overflow` has no getter; a plain rebuild compares unequal when it is set.
        let plain = BinaryExpr::new(
            Arc::clone(binary.left()),
            *binary.op(),
            Arc::clone(binary.right()),
        );
        if *binary != plain {
            return Err(format!("{expr} fails on overflow"));
        }
        let op = *binary.op();
        // A string match on a dictionary column; an OR of them is one lookup per row, where
        // each side's own mask took one.
        if matches!(op, Operator::Eq | Operator::NotEq | Operator::Or)
            && let Some((c, codes, values, negated)) = self.dictionary_membership(expr)
        {
            return Ok(self.dictionary_in(c, codes, values, negated));
        }
        if matches!(op, Operator::Plus | Operator::Minus)
            && let Some(shifted) = self.timestamp_interval(expr, binary)?
        {
            return Ok(shifted);
        }
        let l = self.emit(binary.left())?;
        let r = self.emit(binary.right())?;
        match op {
            Operator::And | Operator::Or => self.logical(op, &l, &r),
            Operator::Eq
            | Operator::NotEq
            | Operator::Lt
            | Operator::LtEq
            | Operator::Gt
            | Operator::GtEq => self.comparison(op, &l, &r),
            Operator::Plus
            | Operator::Minus
            | Operator::Multiply
            | Operator::Divide
            | Operator::Modulo => self.arithmetic(op, &l, &r),
            _ => Err(format!("operator {op}")),
        }
    }

    /// `AND` / `OR` of two booleans in SQL's three-valued logic: FALSE AND NULL = FALSE,
    /// TRUE OR NULL = TRUE.
    fn logical(&mut self, op: Operator, l: &Value, r: &Value) -> Result<Value, Declined> {
        if l.ctype != CType::Bool || r.ctype != CType::Bool {
            return Err(format!("{op} of {} and {}", l.data_type, r.data_type));
        }
        let (lt, rt) = (
            format!("({} && {})", l.valid, l.value),
            format!("({} && {})", r.valid, r.value),
        );
        let (value, valid) = if op == Operator::And {
            let lf = format!("({} && !{})", l.valid, l.value);
            let rf = format!("({} && !{})", r.valid, r.value);
            (
                format!("{lt} && {rt}"),
                format!("({lt} && {rt}) || {lf} || {rf}"),
            )
        } else {
            let both_valid = format!("{} && {}", l.valid, r.valid);
            (
                format!("{lt} || {rt}"),
                format!("{lt} || {rt} || ({both_valid})"),
            )
        };
        Ok(self.define(DataType::Boolean, CType::Bool, value, valid))
    }

    /// A comparison of two values of one type; floats compare as DataFusion orders them.
    fn comparison(&mut self, op: Operator, l: &Value, r: &Value) -> Result<Value, Declined> {
        if l.data_type != r.data_type {
            return Err(format!("{op} of {} and {}", l.data_type, r.data_type));
        }
        let c = match op {
            Operator::Eq => "==",
            Operator::NotEq => "!=",
            Operator::Lt => "<",
            Operator::LtEq => "<=",
            Operator::Gt => ">",
            _ => ">=",
        };
        let value = if l.ctype.is_float() {
            // DataFusion compares floats in total order with −0.0 normalised to +0.0.
            let s = l.ctype.suffix();
            format!("cmp_{s}({}) {c} cmp_{s}({})", l.value, r.value)
        } else {
            format!("{} {c} {}", l.value, r.value)
        };
        let both_valid = format!("{} && {}", l.valid, r.valid);
        Ok(self.define(DataType::Boolean, CType::Bool, value, both_valid))
    }

    /// `+ - * / %` of two plain numbers of one type: IEEE operations as the host's for
    /// floats, wrapping ones for integers, and a guarded division where DataFusion fails.
    fn arithmetic(&mut self, op: Operator, l: &Value, r: &Value) -> Result<Value, Declined> {
        let t = l.ctype;
        let numeric = t.is_float() || t.is_signed() || t.is_unsigned();
        let plain_number = matches!(
            l.data_type,
            DataType::Int8
                | DataType::Int16
                | DataType::Int32
                | DataType::Int64
                | DataType::UInt8
                | DataType::UInt16
                | DataType::UInt32
                | DataType::UInt64
                | DataType::Float32
                | DataType::Float64
        );
        if l.data_type != r.data_type || !numeric || !plain_number {
            return Err(format!("{op} of {} and {}", l.data_type, r.data_type));
        }
        let both_valid = format!("{} && {}", l.valid, r.valid);
        let bound = finite_result_bound(op, t, l, r);
        let value = if let (true, Some(_)) = (t.is_float(), bound) {
            exact_float_arithmetic(op, t, l, r)
        } else if t.is_float() {
            float_arithmetic(op, t, l, r)
        } else if matches!(op, Operator::Plus | Operator::Minus | Operator::Multiply) {
            wrapping_arithmetic(op, t, l, r)
        } else {
            self.guarded_division(op, t, l, r, &both_valid)
        };
        let mut v = self.define(l.data_type.clone(), t, value, both_valid);
        v.finite_bound = bound.filter(|_| t.is_float());
        Ok(v)
    }

    /// An integer `/` or `%`. DataFusion errors on a zero divisor and on MIN / −1 (MIN % −1):
    /// such a row sends the query to the host (ERROR_HOST_ONLY), and the division itself is
    /// guarded so the device never traps.
    fn guarded_division(
        &mut self,
        op: Operator,
        t: CType,
        l: &Value,
        r: &Value,
        both_valid: &str,
    ) -> String {
        let c = if op == Operator::Divide { "/" } else { "%" };
        let name = t.name();
        let overflow = if t.is_signed() {
            let min = format!("(({name})((u64)1 << {}))", t.bits() - 1);
            format!(" || ({} == ({name})-1 && {} == {min})", r.value, l.value)
        } else {
            String::new()
        };
        let failing = format!("({} == 0{overflow})", r.value);
        self.line(format!("host_only |= {both_valid} && {failing};"));
        format!(
            "({name})({failing} ? ({name})0 : ({name})({} {c} {}))",
            l.value, r.value
        )
    }

    /// `CAST` (`safe` false) or `TRY_CAST` (`safe` true) among numeric types, as arrow's cast
    /// kernel: integers widen exactly and go to floats by rounding, f32 widens to f64, and a
    /// narrowing integer cast or a float-to-integer cast (truncating towards zero) takes the
    /// value only where it fits, by num-traits' `NumCast` ranges (for floats the exclusive
    /// range (MIN − 1, MAX + 1), or [MIN, MAX + 1) where the float cannot hold MIN − 1; NaN
    /// never fits). A value that does not fit is NULL under `TRY_CAST` and DataFusion's error
    /// under `CAST`: its row sets `host_only`, so the host reports that error.
    pub(super) fn cast(
        &mut self,
        input: &Arc<dyn PhysicalExpr>,
        to: &DataType,
        safe: bool,
    ) -> Result<Value, Declined> {
        let a = self.emit(input)?;
        let from = &a.data_type;
        if super::is_decimal(from) {
            return Err(format!("CAST of {from}"));
        }
        let to_c = CType::for_data_type(to).ok_or_else(|| format!("CAST to {to}"))?;
        let (f, t) = (a.ctype, to_c);
        let lossless_int = (f.is_signed() && t.is_signed() && t.bits() > f.bits())
            || (f.is_unsigned() && (t.is_signed() || t.is_unsigned()) && t.bits() > f.bits());
        let int_type = |d: &DataType| d.is_integer();
        let plain_float = |d: &DataType| matches!(d, DataType::Float32 | DataType::Float64);
        // Where the value must fit the target (a C condition on `a.value`), if anywhere.
        let fits = match (from, to) {
            _ if from == to => None,
            _ if int_type(from) && int_type(to) && !lossless_int => {
                Some(int_range_check(&a.value, f, t))
            }
            _ if plain_float(from) && int_type(to) => Some(float_range_check(&a.value, f, t)),
            _ => None,
        };
        let value = match (from, to) {
            _ if from == to => a.value.clone(),
            (DataType::Timestamp(u1, _), DataType::Timestamp(u2, _)) if u1 == u2 => a.value.clone(),
            _ if int_type(from) && int_type(to) && lossless_int => {
                format!("({})({})", t.name(), a.value)
            }
            _ if int_type(from) && t.is_float() => format!("({})({})", t.name(), a.value),
            (DataType::Float32, DataType::Float64) => format!("f32_to_f64({})", a.value),
            // The conversion only where the value fits (out of range it is undefined in C).
            _ if fits.is_some() => {
                let fits = fits.as_deref().expect("checked");
                format!("(({fits}) ? ({})({}) : ({})0)", t.name(), a.value, t.name())
            }
            _ => return Err(format!("CAST from {from} to {to}")),
        };
        let valid = match &fits {
            Some(fits) if safe => format!("({} && ({fits}))", a.valid),
            Some(fits) => {
                self.line(format!("host_only |= {} && !({fits});", a.valid));
                a.valid.clone()
            }
            None => a.valid.clone(),
        };
        let finite_bound = if int_type(from) && t.is_float() {
            Some(f.bits() as i32)
        } else if t.is_float() {
            a.finite_bound // f32 → f64 keeps the value
        } else {
            None
        };
        let mut v = self.define(to.clone(), t, value, valid);
        v.finite_bound = finite_bound;
        Ok(v)
    }
}

/// For `op` on floats of type `t` with both operands finite and bounded: a bound on the
/// result, where it stays far enough from overflow that no NaN or infinity can occur.
fn finite_result_bound(op: Operator, t: CType, l: &Value, r: &Value) -> Option<i32> {
    match (op, l.finite_bound, r.finite_bound) {
        (Operator::Plus | Operator::Minus, Some(a), Some(b)) => Some(a.max(b) + 1),
        (Operator::Multiply, Some(a), Some(b)) => Some(a + b),
        _ => None,
    }
    .filter(|&e| e < if t == CType::F32 { 120 } else { 1000 })
}

/// `+ - *` of finite, bounded floats (see [`finite_result_bound`]): the plain IEEE operation,
/// rounded to nearest, is exact.
fn exact_float_arithmetic(op: Operator, t: CType, l: &Value, r: &Value) -> String {
    let f = match op {
        Operator::Plus => "add",
        Operator::Minus => "sub",
        _ => "mul",
    };
    let p = if t == CType::F32 { "f" } else { "d" };
    format!("__{p}{f}_rn({}, {})", l.value, r.value)
}

/// Float arithmetic by fused.cuh's functions, which produce the host's NaNs (and flag the
/// additions and products of two NaNs whose result only the host can reproduce).
fn float_arithmetic(op: Operator, t: CType, l: &Value, r: &Value) -> String {
    let f = match op {
        Operator::Plus => "add",
        Operator::Minus => "sub",
        Operator::Multiply => "mul",
        Operator::Divide => "div",
        // fmod: exact on both sides (the host's Rust `%` calls libm's fmod).
        _ => "rem",
    };
    let flag = if matches!(op, Operator::Plus | Operator::Multiply) {
        ", ambiguous"
    } else {
        ""
    };
    format!("{f}_{}({}, {}{flag})", t.suffix(), l.value, r.value)
}

/// Integer `+ - *`, wrapping as DataFusion's do (computed in the type's unsigned wrapping
/// type, where C defines overflow).
fn wrapping_arithmetic(op: Operator, t: CType, l: &Value, r: &Value) -> String {
    let c = match op {
        Operator::Plus => "+",
        Operator::Minus => "-",
        _ => "*",
    };
    let w = t.wrapping();
    format!("({})(({w}){} {c} ({w}){})", t.name(), l.value, r.value)
}

/// C condition: integer `x` of type `from` lies in the range of integer type `to`.
fn int_range_check(x: &str, from: CType, to: CType) -> String {
    let to_max: u64 = if to.is_signed() {
        (1u64 << (to.bits() - 1)) - 1
    } else if to.bits() == 64 {
        u64::MAX
    } else {
        (1u64 << to.bits()) - 1
    };
    if from.is_signed() {
        let to_min: i64 = if to.is_signed() {
            -(1i64 << (to.bits() - 1))
        } else {
            0
        };
        let hi = to_max.min(i64::MAX as u64);
        // (i64::MIN's literal is no C literal: 9223372036854775808 does not fit a long long.)
        let lo = if to_min == i64::MIN {
            "(-9223372036854775807ll - 1)".to_string()
        } else {
            format!("{to_min}ll")
        };
        format!("((i64)({x}) >= {lo} && (i64)({x}) <= {hi}ll)")
    } else {
        format!("((u64)({x}) <= {to_max}ull)")
    }
}

/// C condition: float `x` of type `from` converts to integer type `to` by arrow's cast
/// (num-traits' `NumCast`): truncation towards zero where the result is in range, NaN never.
fn float_range_check(x: &str, from: CType, to: CType) -> String {
    let bits = to.bits() as i32;
    // 2^e, exactly, as a C double literal (every bound below is exact in both float types).
    let pow2 = |e: i32| format!("{:?}", 2f64.powi(e));
    let float_bits = from.bits();
    if to.is_unsigned() {
        // (−1, MAX + 1) = (−1, 2^bits).
        return format!("((double)({x}) > -1.0 && (double)({x}) < {})", pow2(bits));
    }
    let max_plus_one = pow2(bits - 1);
    // (MIN − 1, MAX + 1), exact in a wider float; else [MIN, MAX + 1): MIN − 1 is not a float
    // of this width, and no fraction is left there.
    let low = if float_bits > to.bits() {
        format!("> -{max_plus_one} - 1.0")
    } else {
        format!(">= -{max_plus_one}")
    };
    format!("((double)({x}) {low} && (double)({x}) < {max_plus_one})")
}

/// The smallest e with |x| ≤ 2^e, for a finite x.
pub(super) fn exponent_bound(x: f64) -> i32 {
    if x == 0.0 {
        0
    } else {
        x.abs().log2().ceil() as i32 + 1
    }
}

/// The raw bits of a literal (`Some(None)`: NULL); `None` when the type is not handled.
pub(super) fn literal_bits(scalar: &ScalarValue) -> Option<Option<u64>> {
    use ScalarValue::*;
    Some(match scalar {
        Boolean(v) => v.map(u64::from),
        Int8(v) => v.map(|x| x as u64),
        Int16(v) => v.map(|x| x as u64),
        Int32(v) | Date32(v) | Time32Second(v) | Time32Millisecond(v) => v.map(|x| x as u64),
        Int64(v)
        | Date64(v)
        | Time64Microsecond(v)
        | Time64Nanosecond(v)
        | TimestampSecond(v, _)
        | TimestampMillisecond(v, _)
        | TimestampMicrosecond(v, _)
        | TimestampNanosecond(v, _)
        | DurationSecond(v)
        | DurationMillisecond(v)
        | DurationMicrosecond(v)
        | DurationNanosecond(v) => v.map(|x| x as u64),
        UInt8(v) => v.map(u64::from),
        UInt16(v) => v.map(u64::from),
        UInt32(v) => v.map(u64::from),
        UInt64(v) => *v,
        // A decimal the device holds as an i64 (see `Emitter::decimal_column`).
        Decimal128(v, _, _) => match v {
            None => None,
            Some(x) => Some(i64::try_from(*x).ok()? as u64),
        },
        Float32(v) => v.map(|x| u64::from(x.to_bits())),
        Float64(v) => v.map(f64::to_bits),
        _ => return None,
    })
}
