//! `PhysicalExpr` → CUDA C: one expression tree becomes straight-line device code, one
//! `const` value and one `const bool` validity per node (SQL NULL propagation and three-valued
//! logic spelled out), over typed reads of the input columns' Arrow buffers.
//!
//! Only what the device reproduces *exactly* is translated (see kernels/fused.cuh for the
//! arithmetic): columns and literals of boolean, integer, float and temporal types;
//! `+ − *` on integers (wrapping, as DataFusion's default) and floats, `/` and `%` (fmod) on
//! floats, integer `/` and `%`; comparisons of equal types (floats
//! in total order with −0.0 = 0.0, as DataFusion's `apply_cmp`); `AND`, `OR`, `NOT`,
//! `IS [NOT] NULL`; negation; `[NOT] IN` literal lists (floats by bit pattern, as DataFusion's
//! static filter); `CASE` (searched, or simple on a non-float value); `floor`, `ceil`, `round`,
//! `sqrt` and `abs` of floats, `abs` of integers; casts and `TRY_CAST`s among numeric types
//! (integer widening, integer → float, f32 → f64, narrowing integer and float → integer casts
//! by arrow's ranges) and timestamp time zone changes. `BETWEEN` arrives as two
//! comparisons. Operations DataFusion fails on for some inputs (integer `/` and `%`, `sqrt`,
//! signed `abs`, timestamp ± interval, a `CAST` whose value does not fit) are translated with
//! a guard: a row that would fail sets `host_only`, and the
//! query reruns on the host, where DataFusion reports its own error. Anything else is declined
//! with the reason (e.g. `ln`, whose last bit CUDA's libm does not promise), and the part of
//! the query it belongs to runs on the host.

use std::fmt::Write;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, Literal,
    NegativeExpr, NotExpr, TryCastExpr,
};

/// Why an expression is not translated (shown in EXPLAIN).
pub(crate) type Declined = String;

/// The device type of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CType {
    Bool,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F32,
    F64,
}

impl CType {
    /// The device representation of an Arrow type, when the device evaluates it.
    pub(crate) fn for_data_type(data_type: &DataType) -> Option<Self> {
        use DataType::*;
        Some(match data_type {
            Boolean => CType::Bool,
            Int8 => CType::I8,
            Int16 => CType::I16,
            Int32 | Date32 | Time32(_) => CType::I32,
            Int64 | Date64 | Time64(_) | Timestamp(_, _) | Duration(_) => CType::I64,
            UInt8 => CType::U8,
            UInt16 => CType::U16,
            UInt32 => CType::U32,
            UInt64 => CType::U64,
            Float32 => CType::F32,
            Float64 => CType::F64,
            _ => return None,
        })
    }

    /// The C type (typedefs of common.cuh).
    pub(crate) fn name(self) -> &'static str {
        match self {
            CType::Bool => "bool",
            CType::I8 => "i8",
            CType::I16 => "i16",
            CType::I32 => "i32",
            CType::I64 => "i64",
            CType::U8 => "u8",
            CType::U16 => "u16",
            CType::U32 => "u32",
            CType::U64 => "u64",
            CType::F32 => "float",
            CType::F64 => "double",
        }
    }

    /// Bytes of one value in device memory (`Bool`: bit-packed, 0).
    pub(crate) fn bytes(self) -> usize {
        if self == CType::Bool {
            0
        } else {
            self.bits() as usize / 8
        }
    }

    /// Suffix of the fused.cuh helpers (`ord_i32`, `add_f64`, …).
    fn suffix(self) -> &'static str {
        match self {
            CType::Bool => "bool",
            CType::F32 => "f32",
            CType::F64 => "f64",
            other => other.name(),
        }
    }

    /// The ascending value bits, as fused.cuh's `ord_*` (the key encoding's order).
    pub(crate) fn ordered(self, value: &str) -> String {
        format!("ord_{}({value})", self.suffix())
    }

    fn is_float(self) -> bool {
        matches!(self, CType::F32 | CType::F64)
    }

    fn is_signed(self) -> bool {
        matches!(self, CType::I8 | CType::I16 | CType::I32 | CType::I64)
    }

    fn is_unsigned(self) -> bool {
        matches!(self, CType::U8 | CType::U16 | CType::U32 | CType::U64)
    }

    fn bits(self) -> u32 {
        match self {
            CType::Bool => 1,
            CType::I8 | CType::U8 => 8,
            CType::I16 | CType::U16 => 16,
            CType::I32 | CType::U32 | CType::F32 => 32,
            CType::I64 | CType::U64 | CType::F64 => 64,
        }
    }

    /// The unsigned type wrapping arithmetic is done in (no C promotion to signed `int`).
    fn wrapping(self) -> &'static str {
        if self.bits() <= 32 { "u32" } else { "u64" }
    }
}

/// A translated node: C names of its value and validity, and its Arrow type.
#[derive(Debug, Clone)]
pub(crate) struct Value {
    pub data_type: DataType,
    pub ctype: CType,
    pub value: String,
    pub valid: String,
    /// For floats known to be finite: e with |value| ≤ 2^e (an integer cast to a float, a
    /// finite literal, and + − * of such values while the bound stays far from overflow).
    /// Arithmetic on two such values cannot meet a NaN, so it skips the NaN handling.
    pub finite_bound: Option<i32>,
}

/// An input of a generated kernel: four parameters each (values, their bit offset for
/// booleans, validity bitmap or null, its bit offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelInput {
    /// A column of the operator's input, by index.
    Column(usize),
    /// The predicate, evaluated on the host by DataFusion (NULL as false, no validity).
    HostPredicate,
    /// The codes (keys array) of a dictionary-encoded string column, by index.
    DictionaryCodes(usize),
    /// Per dictionary entry of a string column (one dictionary per push: batches with another
    /// dictionary start a new push), whether it is one of `values`, NULL where the entry is
    /// NULL: the host maps the literals to codes, the kernel looks each row's code up.
    DictionaryMatch { column: usize, values: Vec<String> },
}

impl KernelInput {
    /// Whether the input has one value per dictionary entry rather than one per row.
    pub fn per_dictionary_entry(&self) -> bool {
        matches!(self, KernelInput::DictionaryMatch { .. })
    }
}

/// Emits device code for expressions over one input schema. Columns are read where first
/// used; statements go to `code`, which the caller places in the kernel body.
pub(crate) struct Emitter<'a> {
    schema: &'a Schema,
    pub inputs: Vec<KernelInput>,
    loaded: Vec<usize>,
    pub code: String,
    /// The per-row input reads, apart from `code`: the kernel issues them all, for all its
    /// rows of a round, before evaluating anything (no load waits on another row or on a
    /// predicate's outcome).
    pub loads: Vec<Load>,
    next: usize,
}

/// One per-row input read: `const {ctype} {value} = {read};` and its validity.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub ctype: String,
    pub value: String,
    pub valid: String,
    /// The read of row `i`.
    pub read: String,
    pub valid_read: String,
    /// For a plain column read: its kernel input and element bytes, so that a thread's
    /// consecutive rows come in one vector load (fused.cuh `load_rows`).
    pub vector: Option<(usize, usize)>,
}

impl<'a> Emitter<'a> {
    pub fn new(schema: &'a Schema) -> Self {
        Self {
            schema,
            inputs: Vec::new(),
            loaded: Vec::new(),
            code: String::new(),
            loads: Vec::new(),
            next: 0,
        }
    }

    /// The kernel parameter index of an input, registering it on first use.
    pub(crate) fn input(&mut self, input: KernelInput) -> usize {
        match self.inputs.iter().position(|i| *i == input) {
            Some(p) => p,
            None => {
                self.inputs.push(input);
                self.inputs.len() - 1
            }
        }
    }

    fn fresh(&mut self) -> (String, String) {
        let n = self.next;
        self.next += 1;
        (format!("e{n}"), format!("e{n}v"))
    }

    fn line(&mut self, text: String) {
        self.code.push_str("        ");
        self.code.push_str(&text);
        self.code.push('\n');
    }

    /// Reads kernel input `p` of type `ctype` at row `i`.
    pub(crate) fn read_input(&mut self, p: usize, ctype: CType) -> (String, String) {
        let (value, valid) = (format!("x{p}"), format!("x{p}v"));
        if !self.loaded.contains(&p) {
            self.loaded.push(p);
            let (read, vector) = match ctype {
                CType::Bool => (format!("get_bit(c{p}, c{p}_bit + i)"), None),
                t => (
                    format!("((const {} *)c{p})[i]", t.name()),
                    Some((p, t.bytes())),
                ),
            };
            self.loads.push(Load {
                ctype: ctype.name().to_string(),
                value: value.clone(),
                valid: valid.clone(),
                read,
                valid_read: format!(
                    "c{p}_valid == nullptr || get_bit(c{p}_valid, c{p}_valid_bit + i)"
                ),
                vector,
            });
        }
        (value, valid)
    }

    fn define(&mut self, data_type: DataType, ctype: CType, value: String, valid: String) -> Value {
        let (v, nv) = self.fresh();
        self.line(format!("const {} {v} = {value};", ctype.name()));
        self.line(format!("const bool {nv} = {valid};"));
        Value {
            data_type,
            ctype,
            value: v,
            valid: nv,
            finite_bound: None,
        }
    }

    /// Translates `expr`, or says why it cannot be.
    pub(crate) fn emit(&mut self, expr: &Arc<dyn PhysicalExpr>) -> Result<Value, Declined> {
        let value = self.emit_node(expr)?;
        // The node must have the type DataFusion gives it (a safety net for coercions).
        match expr.data_type(self.schema) {
            Ok(t) if t == value.data_type => Ok(value),
            Ok(t) => Err(format!(
                "{expr}: DataFusion types it {t}, the translation {}",
                value.data_type
            )),
            Err(e) => Err(format!("{expr}: {e}")),
        }
    }

    fn emit_node(&mut self, expr: &Arc<dyn PhysicalExpr>) -> Result<Value, Declined> {
        let any = expr.as_ref();
        if let Some(column) = any.downcast_ref::<Column>() {
            let field = self
                .schema
                .fields()
                .get(column.index())
                .ok_or_else(|| format!("column {column} is out of the schema"))?;
            let data_type = field.data_type().clone();
            let ctype = CType::for_data_type(&data_type)
                .ok_or_else(|| format!("column {} has type {data_type}", field.name()))?;
            let p = self.input(KernelInput::Column(column.index()));
            let (value, valid) = self.read_input(p, ctype);
            return Ok(Value {
                data_type,
                ctype,
                value,
                valid,
                finite_bound: None,
            });
        }
        if let Some(literal) = any.downcast_ref::<Literal>() {
            return self.literal(literal.value());
        }
        if let Some(binary) = any.downcast_ref::<BinaryExpr>() {
            return self.binary(expr, binary);
        }
        if let Some(not) = any.downcast_ref::<NotExpr>() {
            let a = self.emit(not.arg())?;
            if a.ctype != CType::Bool {
                return Err(format!("NOT of {}", a.data_type));
            }
            return Ok(self.define(
                DataType::Boolean,
                CType::Bool,
                format!("!{}", a.value),
                a.valid,
            ));
        }
        if let Some(is_null) = any.downcast_ref::<IsNullExpr>() {
            let a = self.emit(is_null.arg())?;
            return Ok(self.define(
                DataType::Boolean,
                CType::Bool,
                format!("!{}", a.valid),
                "true".into(),
            ));
        }
        if let Some(is_not_null) = any.downcast_ref::<IsNotNullExpr>() {
            let a = self.emit(is_not_null.arg())?;
            return Ok(self.define(
                DataType::Boolean,
                CType::Bool,
                a.valid.clone(),
                "true".into(),
            ));
        }
        if let Some(negative) = any.downcast_ref::<NegativeExpr>() {
            let a = self.emit(negative.arg())?;
            let value = match a.ctype {
                CType::F32 | CType::F64 => format!("neg_{}({})", a.ctype.suffix(), a.value),
                t if t.is_signed() => {
                    format!("({})(0u - ({}){})", t.name(), t.wrapping(), a.value)
                }
                _ => return Err(format!("negation of {}", a.data_type)),
            };
            return Ok(self.define(a.data_type, a.ctype, value, a.valid));
        }
        if let Some(cast) = any.downcast_ref::<CastExpr>() {
            return self.cast(cast.expr(), cast.cast_type(), false);
        }
        if let Some(cast) = any.downcast_ref::<TryCastExpr>() {
            return self.cast(cast.expr(), cast.cast_type(), true);
        }
        if let Some(in_list) = any.downcast_ref::<InListExpr>() {
            if let Some((c, codes, values, negated)) = self.dictionary_membership(expr) {
                return Ok(self.dictionary_in(c, codes, values, negated));
            }
            return self.in_list(in_list);
        }
        if let Some(case) = any.downcast_ref::<CaseExpr>() {
            return self.case(case);
        }
        if let Some(function) = any.downcast_ref::<ScalarFunctionExpr>() {
            return self.function(expr, function);
        }
        Err(format!("{expr} has no device translation"))
    }

    /// `x [NOT] IN (literals)`, as DataFusion's static filter: NULL when x is NULL, or when x
    /// is not found and the list holds a NULL; floats match by bit pattern (its hash set's
    /// equality: −0.0 ≠ 0.0, a NaN matches only its own bits).
    fn in_list(&mut self, in_list: &InListExpr) -> Result<Value, Declined> {
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

    /// `timestamp ± interval literal` (`interval + timestamp` too), as arrow's
    /// `add_month_day_nano`: for intervals without months, and days only in UTC or a fixed
    /// offset (a named zone's days follow its daylight-saving rules), the shift is a constant
    /// number of the timestamp's units. Arrow fails (and DataFusion with it) where the
    /// timestamp or the result is outside chrono's range (about ±262 000 years) or i64: such a
    /// row sets `host_only`. `None`: not this shape (the caller goes on); declined: this shape,
    /// but not translatable.
    fn timestamp_interval(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        binary: &BinaryExpr,
    ) -> Result<Option<Value>, Declined> {
        let op = *binary.op();
        let interval_of = |e: &Arc<dyn PhysicalExpr>| -> Option<ScalarValue> {
            let value = e.downcast_ref::<Literal>()?.value();
            matches!(value.data_type(), DataType::Interval(_)).then(|| value.clone())
        };
        let is_timestamp = |e: &Arc<dyn PhysicalExpr>| {
            matches!(e.data_type(self.schema), Ok(DataType::Timestamp(_, _)))
        };
        let (timestamp, interval) = match (interval_of(binary.left()), interval_of(binary.right()))
        {
            (None, Some(i)) if is_timestamp(binary.left()) => (binary.left(), i),
            (Some(i), None) if op == Operator::Plus && is_timestamp(binary.right()) => {
                (binary.right(), i)
            }
            _ => return Ok(None),
        };
        let declined = |why: &str| Err(format!("{expr}: {why}"));
        let (months, days, nanos): (i64, i64, i128) = match interval {
            ScalarValue::IntervalMonthDayNano(Some(v)) => (
                i64::from(v.months),
                i64::from(v.days),
                i128::from(v.nanoseconds),
            ),
            ScalarValue::IntervalDayTime(Some(v)) => {
                (0, i64::from(v.days), i128::from(v.milliseconds) * 1_000_000)
            }
            _ => return declined("an interval other than days and time"),
        };
        if months != 0 {
            return declined("an interval of months (calendar arithmetic)");
        }
        let t = self.emit(timestamp)?;
        let DataType::Timestamp(unit, tz) = &t.data_type else {
            return declined("not a timestamp");
        };
        let fixed_offset = tz.as_deref().is_none_or(|tz| {
            matches!(tz, "UTC" | "Z" | "utc") || tz.starts_with('+') || tz.starts_with('-')
        });
        if days != 0 && !fixed_offset {
            return declined("days in a named time zone (daylight saving)");
        }
        use datafusion::arrow::datatypes::TimeUnit;
        let per_unit: i128 = match unit {
            TimeUnit::Second => 1_000_000_000,
            TimeUnit::Millisecond => 1_000_000,
            TimeUnit::Microsecond => 1_000,
            TimeUnit::Nanosecond => 1,
        };
        let mut delta_ns = i128::from(days) * 86_400_000_000_000 + nanos;
        if op == Operator::Minus {
            delta_ns = -delta_ns;
        }
        if delta_ns % per_unit != 0 {
            return declined("an interval finer than the timestamp's unit (arrow truncates)");
        }
        let Ok(delta) = i64::try_from(delta_ns / per_unit) else {
            return declined("an interval beyond the timestamp's range");
        };
        // chrono's range, conservatively: ±8·10^12 s (about year ±253 000).
        let bound = (8_000_000_000_000_000_000_000i128 / per_unit).min(i128::from(i64::MAX));
        let (x, xv) = (t.value.clone(), t.valid.clone());
        let shifted = self.define(
            t.data_type.clone(),
            CType::I64,
            format!("(i64)((u64){x} + (u64)({delta}ll))"),
            xv.clone(),
        );
        let r = &shifted.value;
        self.line(format!(
            "host_only |= {xv} && ((({x} ^ {r}) & (({delta}ll) ^ {r})) < 0 \
             || {x} < -{bound}ll || {x} > {bound}ll || {r} < -{bound}ll || {r} > {bound}ll);"
        ));
        Ok(Some(shifted))
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
    fn dictionary_membership(
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
    fn dictionary_in(
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
    fn in_result(&mut self, found: &str, valid: &str, negated: bool, list_has_null: bool) -> Value {
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

    /// `CASE [x] WHEN … THEN … [ELSE …] END`: the first branch whose condition is TRUE (or
    /// whose value equals x, neither NULL), else the ELSE value, else NULL. Every branch is
    /// evaluated on every row, which is exact because no translated operation can fail.
    fn case(&mut self, case: &CaseExpr) -> Result<Value, Declined> {
        let base = case.expr().map(|e| self.emit(e)).transpose()?;
        if let Some(base) = &base
            && base.ctype.is_float()
        {
            return Err(format!(
                "CASE on a {} value (compared by arrow's float equality)",
                base.data_type
            ));
        }
        let mut branches = Vec::new();
        for (when, then) in case.when_then_expr() {
            let w = self.emit(when)?;
            let condition = match &base {
                None if w.ctype == CType::Bool => format!("({} && {})", w.valid, w.value),
                None => return Err(format!("CASE WHEN of type {}", w.data_type)),
                Some(b) if b.data_type == w.data_type => {
                    format!("({} && {} && {} == {})", b.valid, w.valid, b.value, w.value)
                }
                Some(b) => {
                    return Err(format!("CASE of {} WHEN {}", b.data_type, w.data_type));
                }
            };
            branches.push((condition, self.emit(then)?));
        }
        let otherwise = case.else_expr().map(|e| self.emit(e)).transpose()?;
        let result_type = branches
            .first()
            .map(|(_, t)| t.data_type.clone())
            .ok_or_else(|| "CASE without branches".to_string())?;
        let ctype = branches[0].1.ctype;
        if branches.iter().any(|(_, t)| t.data_type != result_type)
            || otherwise
                .as_ref()
                .is_some_and(|e| e.data_type != result_type)
        {
            return Err("CASE branches of different types".into());
        }
        let (mut value, mut valid) = match &otherwise {
            Some(e) => (e.value.clone(), e.valid.clone()),
            None => (format!("({})0", ctype.name()), "false".to_string()),
        };
        for (condition, then) in branches.iter().rev() {
            value = format!("({condition} ? {} : {value})", then.value);
            valid = format!("({condition} ? {} : {valid})", then.valid);
        }
        Ok(self.define(result_type, ctype, value, valid))
    }

    /// The math functions the device computes bit for bit as DataFusion does: `floor`,
    /// `ceil`, `round` (to a literal number of places), `sqrt` and `abs` of floats (NaN
    /// operands propagate quieted, as the host's libm; `abs` clears the sign bit, NaN or not),
    /// and `abs` of integers. Rows DataFusion fails on (`sqrt` of a negative number, `abs` of a
    /// signed minimum) set `host_only`. The others are declined with the reason.
    fn function(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        function: &ScalarFunctionExpr,
    ) -> Result<Value, Declined> {
        let name = function.name();
        let args = function.args();
        let declined = |why: &str| Err(format!("{expr}: {why}"));
        match name {
            "ln" | "log" | "log2" | "log10" | "exp" | "power" | "pow" | "cbrt" | "sin" | "cos"
            | "tan" => {
                return declined(
                    "CUDA's libm may differ from the host's in the last place, and DataFusion \
                     orders by exact bits",
                );
            }
            "abs" | "floor" | "ceil" | "round" | "sqrt" => {}
            _ => return declined("no device translation of this function"),
        }
        let a = match args {
            [x] | [x, _] => self.emit(x)?,
            _ => return declined("unexpected arguments"),
        };
        let t = a.ctype;
        let value = match (name, t) {
            ("abs", CType::F32) => format!(
                "__uint_as_float(__float_as_uint({}) & 0x7fffffffu)",
                a.value
            ),
            ("abs", CType::F64) => format!(
                "__longlong_as_double(__double_as_longlong({}) & 0x7fffffffffffffffll)",
                a.value
            ),
            ("abs", t) if t.is_unsigned() => a.value.clone(),
            ("abs", t) if t.is_signed() => {
                // DataFusion fails on the minimum: that row sends the query to the host.
                let name = t.name();
                let min = format!("(({name})((u64)1 << {}))", t.bits() - 1);
                self.line(format!("host_only |= {} && {} == {min};", a.valid, a.value));
                format!(
                    "({name})({v} < 0 ? ({name})(0u - ({w}){v}) : {v})",
                    v = a.value,
                    w = t.wrapping()
                )
            }
            ("sqrt", CType::F32 | CType::F64) => {
                // DataFusion fails on a negative argument (not on −0.0 or NaN): that row sends
                // the query to the host. The square root is IEEE's, correctly rounded.
                let (s, f) = if t == CType::F32 {
                    ("f32", "__fsqrt_rn")
                } else {
                    ("f64", "__dsqrt_rn")
                };
                self.line(format!("host_only |= {} && {} < 0;", a.valid, a.value));
                format!("(isnan({v}) ? quiet_{s}({v}) : {f}({v}))", v = a.value)
            }
            ("floor" | "ceil", CType::F32 | CType::F64) if args.len() == 1 => {
                let f = if t == CType::F32 {
                    format!("{name}f")
                } else {
                    name.to_string()
                };
                let s = t.suffix();
                format!("(isnan({v}) ? quiet_{s}({v}) : {f}({v}))", v = a.value)
            }
            ("round", CType::F32 | CType::F64) => {
                let s = t.suffix();
                let f = if t == CType::F32 { "roundf" } else { "round" };
                let rounded = |v: &str| format!("(isnan({v}) ? quiet_{s}({v}) : {f}({v}))");
                match args.get(1) {
                    None => rounded(&a.value),
                    Some(places) => {
                        // (x · 10^d).round() / 10^d, with DataFusion's factor (10f64.powi(d)).
                        let places = match places.downcast_ref::<Literal>() {
                            Some(l) => match l.value() {
                                &ScalarValue::Int32(Some(d)) if d.abs() <= 15 => d,
                                _ => {
                                    return declined(
                                        "decimal places other than a literal within ±15",
                                    );
                                }
                            },
                            None => return declined("decimal places other than a literal"),
                        };
                        let factor = 10_f64.powi(places);
                        let factor = if t == CType::F32 {
                            format!("__uint_as_float(0x{:08x}u)", (factor as f32).to_bits())
                        } else {
                            format!("__longlong_as_double((i64)0x{:016x}ull)", factor.to_bits())
                        };
                        let scaled = self.define(
                            a.data_type.clone(),
                            t,
                            format!("mul_{s}({}, {factor}, ambiguous)", a.value),
                            "true".into(),
                        );
                        let rounded = self.define(
                            a.data_type.clone(),
                            t,
                            rounded(&scaled.value),
                            "true".into(),
                        );
                        format!("div_{s}({}, {factor})", rounded.value)
                    }
                }
            }
            _ => return declined(&format!("{name} of {}", a.data_type)),
        };
        Ok(self.define(a.data_type.clone(), t, value, a.valid.clone()))
    }

    fn literal(&mut self, scalar: &ScalarValue) -> Result<Value, Declined> {
        let data_type = scalar.data_type();
        let ctype = CType::for_data_type(&data_type)
            .ok_or_else(|| format!("literal {scalar} has type {data_type}"))?;
        let bits = literal_bits(scalar).ok_or_else(|| format!("literal {scalar}"))?;
        let (value, valid) = match bits {
            None => (format!("({})0", ctype.name()), "false"),
            Some(bits) => {
                let value = match ctype {
                    CType::Bool => (if bits != 0 { "true" } else { "false" }).to_string(),
                    CType::F32 => format!("__uint_as_float(0x{:08x}u)", bits as u32),
                    CType::F64 => format!("__longlong_as_double((i64)0x{bits:016x}ull)"),
                    t => format!("({})0x{bits:x}ull", t.name()),
                };
                (value, "true")
            }
        };
        let finite_bound = match (scalar, ctype) {
            (ScalarValue::Float32(Some(x)), _) if x.is_finite() => {
                Some(exponent_bound(f64::from(*x)))
            }
            (ScalarValue::Float64(Some(x)), _) if x.is_finite() => Some(exponent_bound(*x)),
            _ => None,
        };
        let mut v = self.define(data_type, ctype, value, valid.into());
        v.finite_bound = finite_bound;
        Ok(v)
    }

    fn binary(
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
        let both_valid = format!("{} && {}", l.valid, r.valid);
        match op {
            Operator::And | Operator::Or => {
                if l.ctype != CType::Bool || r.ctype != CType::Bool {
                    return Err(format!("{op} of {} and {}", l.data_type, r.data_type));
                }
                // Three-valued logic: FALSE AND NULL = FALSE, TRUE OR NULL = TRUE.
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
                    (
                        format!("{lt} || {rt}"),
                        format!("{lt} || {rt} || ({both_valid})"),
                    )
                };
                Ok(self.define(DataType::Boolean, CType::Bool, value, valid))
            }
            Operator::Eq
            | Operator::NotEq
            | Operator::Lt
            | Operator::LtEq
            | Operator::Gt
            | Operator::GtEq => {
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
                Ok(self.define(DataType::Boolean, CType::Bool, value, both_valid))
            }
            Operator::Plus
            | Operator::Minus
            | Operator::Multiply
            | Operator::Divide
            | Operator::Modulo => {
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
                // Both operands finite and bounded: the result is too (no overflow below the
                // limit), and no NaN can occur, so the plain IEEE operation is exact.
                let bound = match (op, l.finite_bound, r.finite_bound) {
                    (Operator::Plus | Operator::Minus, Some(a), Some(b)) => Some(a.max(b) + 1),
                    (Operator::Multiply, Some(a), Some(b)) => Some(a + b),
                    _ => None,
                }
                .filter(|&e| e < if t == CType::F32 { 120 } else { 1000 });
                let value = if let (true, Some(_)) = (t.is_float(), bound) {
                    let f = match op {
                        Operator::Plus => "add",
                        Operator::Minus => "sub",
                        _ => "mul",
                    };
                    let p = if t == CType::F32 { "f" } else { "d" };
                    format!("__{p}{f}_rn({}, {})", l.value, r.value)
                } else if t.is_float() {
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
                } else {
                    match op {
                        Operator::Plus | Operator::Minus | Operator::Multiply => {
                            let c = match op {
                                Operator::Plus => "+",
                                Operator::Minus => "-",
                                _ => "*",
                            };
                            let w = t.wrapping();
                            format!("({})(({w}){} {c} ({w}){})", t.name(), l.value, r.value)
                        }
                        _ => {
                            // DataFusion errors on a zero divisor and on MIN / −1 (MIN % −1):
                            // such a row sends the query to the host (ERROR_HOST_ONLY), and
                            // the division itself is guarded so the device never traps.
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
                    }
                };
                let mut v = self.define(l.data_type.clone(), t, value, both_valid);
                v.finite_bound = bound.filter(|_| t.is_float());
                Ok(v)
            }
            _ => Err(format!("operator {op}")),
        }
    }

    /// `CAST` (`safe` false) or `TRY_CAST` (`safe` true) among numeric types, as arrow's cast
    /// kernel: integers widen exactly and go to floats by rounding, f32 widens to f64, and a
    /// narrowing integer cast or a float-to-integer cast (truncating towards zero) takes the
    /// value only where it fits, by num-traits' `NumCast` ranges (for floats the exclusive
    /// range (MIN − 1, MAX + 1), or [MIN, MAX + 1) where the float cannot hold MIN − 1; NaN
    /// never fits). A value that does not fit is NULL under `TRY_CAST` and DataFusion's error
    /// under `CAST`: its row sets `host_only`, so the host reports that error.
    fn cast(
        &mut self,
        input: &Arc<dyn PhysicalExpr>,
        to: &DataType,
        safe: bool,
    ) -> Result<Value, Declined> {
        let a = self.emit(input)?;
        let from = &a.data_type;
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
fn exponent_bound(x: f64) -> i32 {
    if x == 0.0 {
        0
    } else {
        x.abs().log2().ceil() as i32 + 1
    }
}

/// The raw bits of a literal (`Some(None)`: NULL); `None` when the type is not handled.
fn literal_bits(scalar: &ScalarValue) -> Option<Option<u64>> {
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
        Float32(v) => v.map(|x| u64::from(x.to_bits())),
        Float64(v) => v.map(f64::to_bits),
        _ => return None,
    })
}

/// The value of an integer literal divisor.
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

/// C source text of a key field: ORs the encoded `value` into `key` (see the keys module and
/// encode.cu: DESC flips the value bits, NULL rows get zero value bits and the null bit per
/// NULLS FIRST/LAST); a NULL in a key declared not nullable sets `bad`.
pub(crate) fn emit_key_field(
    out: &mut String,
    value: &Value,
    shift: u32,
    value_bits: u32,
    descending: bool,
    nullable: bool,
    nulls_first: bool,
) {
    let mask: u64 = if value_bits >= 64 {
        u64::MAX
    } else {
        (1u64 << value_bits) - 1
    };
    let xor = if descending { mask } else { 0 };
    let ordered = value.ctype.ordered(&value.value);
    let v = &value.valid;
    let _ = writeln!(
        out,
        "        or_field(key, {v} ? ({ordered} ^ 0x{xor:x}ull) : 0ull, {shift}, {}, {});",
        if nullable {
            format!("{v} == {nulls_first}")
        } else {
            "false".into()
        },
        shift + value_bits
    );
    if !nullable {
        let _ = writeln!(out, "        bad = bad || !{v};");
    }
}
