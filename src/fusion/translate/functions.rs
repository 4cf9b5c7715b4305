//! `CASE`, math functions and timestamp ± interval: the nodes that are not plain operators,
//! each translated only where the device matches DataFusion bit for bit.

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, CaseExpr, Literal};

use super::{CType, Declined, Emitter, Value};

impl Emitter<'_> {
    /// `CASE [x] WHEN … THEN … [ELSE …] END`: the first branch whose condition is TRUE (or
    /// whose value equals x, neither NULL), else the ELSE value, else NULL. Every branch is
    /// evaluated on every row, which is exact because no translated operation can fail.
    pub(super) fn case(&mut self, case: &CaseExpr) -> Result<Value, Declined> {
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
    pub(super) fn function(
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
            "date_trunc" => return self.date_trunc(expr, args),
            _ => return declined("no device translation of this function"),
        }
        let a = match args {
            [x] | [x, _] => self.emit(x)?,
            _ => return declined("unexpected arguments"),
        };
        if super::is_decimal(&a.data_type) {
            return declined("no device translation of decimal functions");
        }
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

    /// `date_trunc(granularity, timestamp)` where DataFusion truncates by arithmetic
    /// (`v - v.rem_euclid(unit)`, or `v` where the unit is the timestamp's own or finer):
    /// `microsecond` to `minute` in any time zone, `hour` and `day` without one. A literal
    /// granularity only; the calendar's (`week` and longer, or `hour`/`day` in a zone) are
    /// declined.
    fn date_trunc(
        &mut self,
        expr: &Arc<dyn PhysicalExpr>,
        args: &[Arc<dyn PhysicalExpr>],
    ) -> Result<Value, Declined> {
        use datafusion::arrow::datatypes::TimeUnit;
        let declined = |why: &str| Err(format!("{expr}: {why}"));
        let [granularity, timestamp] = args else {
            return declined("unexpected arguments");
        };
        let granularity = match granularity.downcast_ref::<Literal>().map(Literal::value) {
            Some(ScalarValue::Utf8(Some(g)) | ScalarValue::LargeUtf8(Some(g)))
            | Some(ScalarValue::Utf8View(Some(g))) => g.to_lowercase(),
            _ => return declined("a granularity other than a string literal"),
        };
        let t = self.emit(timestamp)?;
        let DataType::Timestamp(unit, tz) = &t.data_type else {
            return declined(&format!("date_trunc of {}", t.data_type));
        };
        // The timestamp's unit and the granularity, in nanoseconds.
        let unit_ns: i64 = match unit {
            TimeUnit::Second => 1_000_000_000,
            TimeUnit::Millisecond => 1_000_000,
            TimeUnit::Microsecond => 1_000,
            TimeUnit::Nanosecond => 1,
        };
        let granularity_ns: i64 = match (granularity.as_str(), tz) {
            ("microsecond", _) => 1_000,
            ("millisecond", _) => 1_000_000,
            ("second", _) => 1_000_000_000,
            ("minute", _) => 60_000_000_000,
            ("hour", None) => 3_600_000_000_000,
            ("day", None) => 86_400_000_000_000,
            _ => return declined(&format!("'{granularity}' truncation follows the calendar")),
        };
        let value = match granularity_ns / unit_ns {
            // The unit itself or a finer one: the value as it is.
            0 | 1 => t.value.clone(),
            step => format!("trunc_step_i64({}, {step}ll)", t.value),
        };
        Ok(self.define(t.data_type.clone(), CType::I64, value, t.valid.clone()))
    }

    /// `timestamp ± interval literal` (`interval + timestamp` too), as arrow's
    /// `add_month_day_nano`: for intervals without months, and days only in UTC or a fixed
    /// offset (a named zone's days follow its daylight-saving rules), the shift is a constant
    /// number of the timestamp's units. Arrow fails (and DataFusion with it) where the
    /// timestamp or the result is outside chrono's range (about ±262 000 years) or i64: such a
    /// row sets `host_only`. `None`: not this shape (the caller goes on); declined: this shape,
    /// but not translatable.
    pub(super) fn timestamp_interval(
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
}
