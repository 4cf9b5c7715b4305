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
//! comparisons. A `Decimal128` column is read as the i64 its values fit (a row whose value does
//! not fit reruns the query on the host): its comparisons with equal decimal types, `IN` lists
//! and its sort key translate, its arithmetic and casts do not. A plain string or binary column
//! as a prefix layout's byte key is read as its prefix words (`KernelInput::StringPrefix`).
//! Over a whole table, predicates on plain string columns read each row's bytes
//! (`KernelInput::StringColumn`): comparisons with literals, `IN` lists, `LIKE`,
//! `starts_with`, `ends_with`, `IS [NOT] NULL` and the lengths (`strings`); over a streamed
//! input they are declined. Operations DataFusion fails on for some inputs (integer `/` and
//! `%`, `sqrt`, signed `abs`, timestamp ± interval, a `CAST` whose value does not fit) are
//! translated with a guard: a row that would fail sets `host_only`, and the
//! query reruns on the host, where DataFusion reports its own error. Anything else is declined
//! with the reason (e.g. `ln`, whose last bit CUDA's libm does not promise), and the part of
//! the query it belongs to runs on the host.
//!
//! The translation goes by expression family: here the values, the input reads, the dispatch
//! over node types, columns, literals and the unary nodes; in `arithmetic` the binary
//! operators and casts; in `membership` the `IN` lists and dictionary string matches; in
//! `strings` the predicates on plain string columns; in `functions` `CASE`, the math
//! functions and timestamp ± interval.

use std::fmt::Write;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::ScalarValue;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, Literal,
    NegativeExpr, NotExpr, TryCastExpr,
};

// The `Emitter`'s methods by expression family (each adds to `impl Emitter`).
mod arithmetic;
mod functions;
mod membership;
mod strings;

pub(crate) use strings::is_device_string;

use arithmetic::{exponent_bound, literal_bits};

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

    pub(crate) fn is_float(self) -> bool {
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
    /// Each row's first 16 bytes of a string or binary column, by index, big-endian as one
    /// 128-bit value (`keys::prefix_words`): what a prefix layout's byte field reads. The
    /// column cache holds this image, not the strings.
    StringPrefix(usize),
    /// The bytes of a plain string column, by index, for the string predicates: each row's
    /// end offset (i64) as the values, the bytes' address as the second parameter
    /// (fused.cuh `load_str`). Only whole tables have this image (the column cache's).
    StringColumn(usize),
    /// Each row's order-preserving code of a plain string column, by index, as an i64
    /// (`input::codes`): what a string group key is aggregated by.
    StringCodes(usize),
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
    /// Whether string columns may be read whole ([`KernelInput::StringColumn`]): the input
    /// is a whole table.
    strings: bool,
    /// Device constants the code refers to (string literals), placed before the kernel.
    pub globals: String,
    constants: usize,
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
            strings: false,
            globals: String::new(),
            constants: 0,
        }
    }

    /// An emitter whose programs may read string columns whole (for a whole-table input).
    pub fn with_strings(schema: &'a Schema) -> Self {
        Self {
            strings: true,
            ..Self::new(schema)
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

    /// The prefix words (`StringPrefix`) of `expr`, a plain column of strings or binary: the
    /// C names of the row's `U128` (first bytes in `hi`) and its validity.
    pub(crate) fn string_prefix(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Result<(String, String), Declined> {
        let column = expr
            .downcast_ref::<Column>()
            .ok_or_else(|| format!("{expr}: the device reads string keys of plain columns only"))?;
        let field = self
            .schema
            .fields()
            .get(column.index())
            .ok_or_else(|| format!("column {column} is out of the schema"))?;
        if !crate::keys::has_prefix_words(field.data_type()) {
            return Err(format!(
                "column {} has type {}",
                field.name(),
                field.data_type()
            ));
        }
        let p = self.input(KernelInput::StringPrefix(column.index()));
        Ok(self.read_words(p))
    }

    /// Reads kernel input `p`, 16 bytes a row, at row `i` as a `U128` (its C name and
    /// validity's).
    fn read_words(&mut self, p: usize) -> (String, String) {
        let (words, valid) = (format!("x{p}"), format!("x{p}v"));
        if !self.loaded.contains(&p) {
            self.loaded.push(p);
            self.loads.push(Load {
                ctype: "U128".to_string(),
                value: words.clone(),
                valid: valid.clone(),
                read: format!("((const U128 *)c{p})[i]"),
                valid_read: format!(
                    "c{p}_valid == nullptr || get_bit(c{p}_valid, c{p}_valid_bit + i)"
                ),
                vector: Some((p, 16)),
            });
        }
        (words, valid)
    }

    /// Column `c`, a `Decimal128`, as the i64 its values fit in the common case (precision 18
    /// or less always): a row whose value does not fit sets `host_only`, and the query reruns
    /// on the host. Only comparisons of equal decimal types, `IN` lists, `CASE` and sort keys
    /// take such a value; decimal arithmetic, casts and functions are declined.
    fn decimal_column(&mut self, c: usize, data_type: DataType) -> Value {
        let p = self.input(KernelInput::Column(c));
        let (words, valid) = self.read_words(p);
        let value = self.define(
            data_type,
            CType::I64,
            format!("(i64){words}.lo"),
            valid.clone(),
        );
        self.line(format!(
            "host_only = host_only || ({valid} && {words}.hi != (u64)((i64){words}.lo >> 63));"
        ));
        value
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
        if let Some(string) = self.string_node(expr) {
            return string;
        }
        let any = expr.as_ref();
        if let Some(column) = any.downcast_ref::<Column>() {
            let field = self
                .schema
                .fields()
                .get(column.index())
                .ok_or_else(|| format!("column {column} is out of the schema"))?;
            let data_type = field.data_type().clone();
            if is_decimal(&data_type) {
                return Ok(self.decimal_column(column.index(), data_type));
            }
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
            if is_decimal(&a.data_type) {
                return Err(format!("negation of {}", a.data_type));
            }
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

    fn literal(&mut self, scalar: &ScalarValue) -> Result<Value, Declined> {
        let data_type = scalar.data_type();
        let ctype = match &data_type {
            d if is_decimal(d) => CType::I64,
            d => CType::for_data_type(d)
                .ok_or_else(|| format!("literal {scalar} has type {data_type}"))?,
        };
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
}

/// Whether the device holds values of `data_type` as i64s standing for `Decimal128`s.
pub(crate) fn is_decimal(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Decimal128(..))
}

/// C source text of a `Decimal128` key field from its value as an i64 (`value`, see
/// `Emitter::decimal_column`): the 128-bit field of the keys module, sign-extended and with
/// the sign bit flipped, DESC flipping every value bit, the null bit as [`emit_key_field`].
/// `dropped` low bits are left out where the layout keeps only the high ones.
pub(crate) fn emit_decimal_field(
    out: &mut String,
    value: &Value,
    (shift, dropped): (u32, u32),
    descending: bool,
    nullable: bool,
    nulls_first: bool,
) {
    let (v, valid) = (&value.value, &value.valid);
    let xor = if descending { u64::MAX } else { 0 };
    let null_bit = if nullable {
        format!("{valid} == {nulls_first}")
    } else {
        "false".into()
    };
    let hi = format!("(((u64)({v} >> 63) ^ 0x8000000000000000ull) ^ 0x{xor:x}ull)");
    let lo = format!("((u64){v} ^ 0x{xor:x}ull)");
    let top = shift + 128 - dropped;
    if dropped >= 64 {
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? ({hi} >> {}) : 0ull, {shift}, {null_bit}, {top});",
            dropped - 64
        );
    } else {
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? ({hi} >> {dropped}) : 0ull, {}, {null_bit}, {top});",
            shift + 64 - dropped
        );
        let low = if dropped == 0 {
            lo
        } else {
            format!("(({lo} >> {dropped}) | ({hi} << {}))", 64 - dropped)
        };
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? {low} : 0ull, {shift}, false, 0);"
        );
    }
    if !nullable {
        let _ = writeln!(out, "        bad = bad || !{valid};");
    }
}

/// C source text of a byte key's prefix field: its first `bytes` bytes (≤ 16) from the row's
/// prefix words `words` (a `U128`, first bytes in `hi`), as [`emit_key_field`] writes a value
/// (DESC flips them; NULL rows get zero bits and the null bit per NULLS FIRST/LAST).
pub(crate) fn emit_prefix_field(
    out: &mut String,
    (words, valid): (&str, &str),
    shift: u32,
    bytes: u32,
    spec: &crate::keys::KeySpec,
) {
    let (descending, nullable, nulls_first) = (spec.descending, spec.nullable, spec.nulls_first);
    let bits = 8 * bytes;
    let null_bit = if nullable {
        format!("{valid} == {nulls_first}")
    } else {
        "false".into()
    };
    let mask = |bits: u32| {
        if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        }
    };
    if bits <= 64 {
        let xor = if descending { mask(bits) } else { 0 };
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? (({words}.hi >> {}) ^ 0x{xor:x}ull) : 0ull, {shift}, {null_bit}, {});",
            64 - bits,
            shift + bits
        );
    } else {
        // The first 8 bytes above the next ones.
        let low = bits - 64;
        let (xor_hi, xor_lo) = if descending {
            (u64::MAX, mask(low))
        } else {
            (0, 0)
        };
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? ({words}.hi ^ 0x{xor_hi:x}ull) : 0ull, {}, {null_bit}, {});",
            shift + low,
            shift + bits
        );
        let _ = writeln!(
            out,
            "        or_field(key, {valid} ? (({words}.lo >> {}) ^ 0x{xor_lo:x}ull) : 0ull, {shift}, false, 0);",
            128 - bits
        );
    }
    if !nullable {
        let _ = writeln!(out, "        bad = bad || !{valid};");
    }
}

/// C source text of a key field: ORs the encoded `value` into `key` (see the keys module and
/// encode.cu: DESC flips the value bits, NULL rows get zero value bits and the null bit per
/// NULLS FIRST/LAST); a NULL in a key declared not nullable sets `bad`. `dropped` low bits
/// are left out where the layout keeps only the high ones.
pub(crate) fn emit_key_field(
    out: &mut String,
    value: &Value,
    (shift, dropped): (u32, u32),
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
    let encoded = match dropped {
        0 => format!("({ordered} ^ 0x{xor:x}ull)"),
        _ => format!("(({ordered} ^ 0x{xor:x}ull) >> {dropped})"),
    };
    let _ = writeln!(
        out,
        "        or_field(key, {v} ? {encoded} : 0ull, {shift}, {}, {});",
        if nullable {
            format!("{v} == {nulls_first}")
        } else {
            "false".into()
        },
        shift + value_bits - dropped
    );
    if !nullable {
        let _ = writeln!(out, "        bad = bad || !{v};");
    }
}
