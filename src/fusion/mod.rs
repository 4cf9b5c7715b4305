//! Fusion: the query's `WHERE` predicate and `ORDER BY` expressions as one generated CUDA
//! kernel, so that the GPU reads the raw input columns once and only candidate rows leave it.
//!
//! [`plan`] decides, per part of the query, where it is evaluated:
//! - the **ranking keys** run on the GPU when every sort expression translates
//!   ([`translate`]); otherwise the whole query keeps the host path (DataFusion evaluates the
//!   keys on the filtered rows and the key columns are shipped, see [`crate::exec`]);
//! - the **predicate** runs on the GPU when it translates; otherwise DataFusion evaluates it on
//!   the host and its result is shipped as one boolean column. (Keys are then evaluated on
//!   every row, which is safe: translated expressions cannot fail.)
//!
//! The generated kernel (one per distinct program text; NVRTC-compiled and cached like the
//! static kernels, see [`crate::device`], with a minimum of resident blocks a SM unless that
//! spills, and its full pass pipelined where that still fits,
//! [`crate::device::kernels::compile_generated`]) takes each input column's Arrow buffers as
//! they are (values, validity bitmap, bit offsets), and for each row: evaluates the predicate;
//! if it holds, builds the composite key field by field (bit for bit [`crate::keys`]); appends
//! the (key, row id) pair to the candidate buffer when it beats the threshold; and records in a
//! bitmap which rows it appended, so the host keeps only those rows' output columns.
//! Pipelined, a thread issues the loads of its next round of rows before it evaluates and
//! appends the current one, so its loads stay in flight while it computes.
//!
//! On columns already in device memory ([`crate::select::resident`]) the same program is the
//! first pass of a sampled selection: run on a strided sample it sets the threshold, then its
//! full pass appends only the rows that beat it ([`crate::device::TopKEngine::fused_select`]);
//! for a large k that pass also ORs its appended keys into the key span words that decide how
//! they are packed for their sort.

pub(crate) mod aggregate;
pub(crate) mod cannot_fail;
pub(crate) mod translate;

use std::fmt;
use std::fmt::Write;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch, make_array};
use datafusion::arrow::datatypes::Schema;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};

use crate::device::KeyWidth;
use crate::keys::KeyLayout;
pub use translate::KernelInput;
pub(crate) use translate::is_device_string;
use translate::{Declined, Emitter, emit_key_field};

/// Name of the generated kernel's entry point.
pub const ENTRY: &str = crate::device::kernels::GENERATED_ENTRY;

/// Error flags the generated kernel reports: a NULL in a sort key declared not nullable …
pub(crate) const ERROR_NULL_KEY: u32 = 1;
/// … and two different NaNs added or multiplied, whose result the host makes depend on the
/// row's position in its batch (see kernels/fused.cuh): only the host can reproduce it.
pub(crate) const ERROR_AMBIGUOUS_NAN: u32 = 2;
/// … and a row on which DataFusion's evaluation fails (`sqrt` of a negative number, `abs` of
/// a signed minimum, an integer division by zero or of the minimum by −1): the query reruns on
/// the host, where DataFusion reports its own error (or, where it never evaluates that row, its
/// result).
pub(crate) const ERROR_HOST_ONLY: u32 = 4;

/// Where one part of the query is evaluated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Gpu,
    /// On the host, by DataFusion, for this reason.
    Host(String),
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Gpu => write!(f, "gpu"),
            Part::Host(_) => write!(f, "host"),
        }
    }
}

/// The fusion decision for one query.
#[derive(Debug, Clone)]
pub struct FusionPlan {
    /// The predicate's placement (`None`: the query has none).
    pub filter: Option<Part>,
    pub keys: Part,
    /// The generated program, when the keys run on the GPU.
    pub program: Option<Arc<FusedProgram>>,
}

impl FusionPlan {
    /// Everything on the host, for `why`.
    pub fn host(why: &str, has_filter: bool) -> Self {
        Self {
            filter: has_filter.then(|| Part::Host(why.to_string())),
            keys: Part::Host(why.to_string()),
            program: None,
        }
    }

    /// For EXPLAIN: `filter=gpu, keys=gpu`, with the reasons for host parts when `verbose`.
    pub fn describe(&self, verbose: bool) -> String {
        let part = |name: &str, part: &Part| match part {
            Part::Host(why) if verbose => format!("{name}=host ({why})"),
            other => format!("{name}={other}"),
        };
        let mut parts = Vec::new();
        if let Some(filter) = &self.filter {
            parts.push(part("filter", filter));
        }
        parts.push(part("keys", &self.keys));
        parts.join(", ")
    }
}

/// A generated kernel and what to hand it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedProgram {
    /// CUDA C source (includes fused.cuh); its text is the cache key.
    pub source: String,
    /// The kernel's inputs, in parameter order.
    pub inputs: Vec<KernelInput>,
    /// The composite key type the kernel writes.
    pub key_kind: KeyWidth,
    /// Whether its composite is a prefix layout's (monotone, not exact): the rows that tie
    /// the k-th composite are then ranked on the host.
    pub refines: bool,
}

impl FusedProgram {
    /// Whether the predicate is evaluated on the host and shipped.
    pub fn host_predicate(&self) -> bool {
        self.inputs.contains(&KernelInput::HostPredicate)
    }

    /// Whether the program reads string columns whole ([`KernelInput::StringColumn`]), which
    /// only a selection over the whole table gives it.
    pub fn reads_strings(&self) -> bool {
        (self.inputs.iter()).any(|input| matches!(input, KernelInput::StringColumn(_)))
    }

    /// Whether two batches have the same dictionaries in the columns whose entries the
    /// program looks up (the same array, or equal contents): only such batches share a push.
    pub fn same_dictionaries(&self, a: &RecordBatch, b: &RecordBatch) -> bool {
        self.inputs.iter().all(|input| match input {
            KernelInput::DictionaryMatch { column, .. } => {
                match (
                    a.column(*column).as_any_dictionary_opt(),
                    b.column(*column).as_any_dictionary_opt(),
                ) {
                    (Some(x), Some(y)) => {
                        Arc::ptr_eq(x.values(), y.values())
                            || x.values().to_data() == y.values().to_data()
                    }
                    _ => false,
                }
            }
            _ => true,
        })
    }
}

/// The codes of a dictionary-encoded column (a [`KernelInput::DictionaryCodes`] input), as a
/// plain integer array.
pub fn dictionary_codes(column: &ArrayRef) -> Result<ArrayRef> {
    let dictionary = column.as_any_dictionary_opt().ok_or_else(|| {
        DataFusionError::Internal(format!(
            "expected a dictionary column, got {}",
            column.data_type()
        ))
    })?;
    Ok(make_array(dictionary.keys().to_data()))
}

/// Per entry of a string column's dictionary: whether it is one of `values` (NULL where the
/// entry is NULL); the lookup table of a [`KernelInput::DictionaryMatch`] input.
pub fn dictionary_match(column: &ArrayRef, values: &[String]) -> Result<ArrayRef> {
    let dictionary = column.as_any_dictionary_opt().ok_or_else(|| {
        DataFusionError::Internal(format!(
            "expected a dictionary column, got {}",
            column.data_type()
        ))
    })?;
    dictionary_entries_match(dictionary.values(), values)
}

/// [`dictionary_match`] given the dictionary's entries (strings).
pub fn dictionary_entries_match(entries: &ArrayRef, values: &[String]) -> Result<ArrayRef> {
    let matches = |s: Option<&str>| s.map(|s| values.iter().any(|v| v == s));
    let mask: BooleanArray = if let Some(strings) = entries.as_string_opt::<i32>() {
        strings.iter().map(matches).collect()
    } else if let Some(strings) = entries.as_string_opt::<i64>() {
        strings.iter().map(matches).collect()
    } else {
        return Err(DataFusionError::Internal(format!(
            "dictionary values of type {}",
            entries.data_type()
        )));
    };
    Ok(Arc::new(mask))
}

/// Decides what runs where and generates the program (see the module documentation).
/// Expressions are over `schema`; `layout` is the sort keys' layout.
/// `whole_table`: the input is read as a whole table (in memory or Parquet), so the program
/// may read string columns whole for the string predicates.
pub(crate) fn plan(
    filter: Option<&Arc<dyn PhysicalExpr>>,
    sort_exprs: &LexOrdering,
    layout: &KeyLayout,
    schema: &Schema,
    whole_table: bool,
) -> FusionPlan {
    let mut emitter = match whole_table {
        true => Emitter::with_strings(schema),
        false => Emitter::new(schema),
    };
    // The predicate first: its statements come first in the kernel.
    let predicate = filter.map(|f| emitter.emit(f));
    let filter_code = std::mem::take(&mut emitter.code);
    let (filter_part, pass) = match &predicate {
        None => (None, "true".to_string()),
        Some(Ok(v)) => (Some(Part::Gpu), format!("{} && {}", v.valid, v.value)),
        Some(Err(why)) => {
            let p = emitter.input(KernelInput::HostPredicate);
            let (value, _) = emitter.read_input(p, translate::CType::Bool);
            (Some(Part::Host(why.clone())), value)
        }
    };
    let host_filter_code = std::mem::take(&mut emitter.code);

    let keys = translate_keys(&mut emitter, sort_exprs, layout);
    let (keys_part, program) = match keys {
        Err(why) => (Part::Host(why), None),
        Ok(key_code) => {
            let kind = KeyWidth::for_total_bits(layout.total_bits());
            let source = kernel_source(
                &emitter.inputs,
                &emitter.globals,
                kind,
                &emitter.loads,
                &format!("{filter_code}{host_filter_code}"),
                &pass,
                &key_code,
            );
            let program = FusedProgram {
                source,
                inputs: emitter.inputs.clone(),
                key_kind: kind,
                refines: !layout.exact(),
            };
            (Part::Gpu, Some(Arc::new(program)))
        }
    };
    FusionPlan {
        filter: filter_part,
        keys: keys_part,
        program,
    }
}

/// Statements that evaluate every sort expression and OR its field into `key`.
fn translate_keys(
    emitter: &mut Emitter<'_>,
    sort_exprs: &LexOrdering,
    layout: &KeyLayout,
) -> Result<String, Declined> {
    let mut fields = String::new();
    // A prefix layout's composite holds only its leading keys: the rest are compared on the
    // host, among the rows that tie the k-th composite.
    let composite = layout.composite_keys();
    for (i, (sort, spec)) in (sort_exprs.iter().zip(layout.specs()))
        .enumerate()
        .take(composite)
    {
        if let Some(bytes) = layout.prefix_bytes(i) {
            let (words, valid) = emitter.string_prefix(&sort.expr)?;
            let code = std::mem::take(&mut emitter.code);
            fields.push_str(&code);
            translate::emit_prefix_field(
                &mut fields,
                (&words, &valid),
                layout.field_shift(i),
                bytes,
                spec,
            );
            continue;
        }
        // A key cut to its high bits (keys past 256 bits) keeps them; ties are refined.
        let dropped = layout.dropped_bits(i);
        let value = emitter.emit(&sort.expr)?;
        if translate::is_decimal(&spec.data_type) && value.data_type == spec.data_type {
            let code = std::mem::take(&mut emitter.code);
            fields.push_str(&code);
            translate::emit_decimal_field(
                &mut fields,
                &value,
                (layout.field_shift(i), dropped),
                spec.descending,
                spec.nullable,
                spec.nulls_first,
            );
            continue;
        }
        let value_bits = spec
            .value_bits()
            .ok_or_else(|| format!("sort key {} has type {}", i + 1, spec.data_type))?;
        if value.data_type != spec.data_type || value_bits > 64 {
            return Err(format!("sort key {} has type {}", i + 1, spec.data_type));
        }
        let code = std::mem::take(&mut emitter.code);
        fields.push_str(&code);
        emit_key_field(
            &mut fields,
            &value,
            (layout.field_shift(i), dropped),
            value_bits,
            spec.descending,
            spec.nullable,
            spec.nulls_first,
        );
    }
    // The keys after the composite's are compared on the host for the candidates only, but
    // DataFusion evaluates them on every row: one that may fail is evaluated here too, for
    // its guards (a row where it would fail sends the query to the host), its value unused.
    for (i, sort) in sort_exprs.iter().enumerate().skip(composite) {
        let expr = &sort.expr;
        if expr.downcast_ref::<Column>().is_some() || expr.downcast_ref::<Literal>().is_some() {
            continue;
        }
        emitter.emit(expr).map_err(|why| {
            format!(
                "sort key {} follows a string key, may fail on rows the device leaves out, \
                 and has no device translation ({why})",
                i + 1
            )
        })?;
        let code = std::mem::take(&mut emitter.code);
        fields.push_str(&code);
    }
    Ok(fields)
}

/// The host's NaN bits for `0.0 / 0.0` (x86: sign set; ARM: sign clear), which the device must
/// produce for invalid operations to match DataFusion's results bit for bit.
#[allow(clippy::eq_op)] // 0/0 is the point: the host's invalid-operation NaN
pub fn host_default_nan() -> (u32, u64) {
    let zero32 = std::hint::black_box(0.0f32);
    let zero64 = std::hint::black_box(0.0f64);
    ((zero32 / zero32).to_bits(), (zero64 / zero64).to_bits())
}

/// CUDA C source of the fused kernel: a header of macros, the row loop `fused_rows` (its
/// input fetch, its rounds, the block's totals) and the entry point that picks its variant.
fn kernel_source(
    inputs: &[KernelInput],
    globals: &str,
    kind: KeyWidth,
    loads: &[translate::Load],
    filter_code: &str,
    pass: &str,
    key_code: &str,
) -> String {
    let rows = full_rows(kind);
    let row_loads = RowLoads::new(loads, rows);
    let (params, args) = input_params(inputs);
    let any_nulls = any_nulls(inputs, loads);
    [
        source_header(globals, kind, rows),
        rows_prologue(&params, &row_loads),
        rows_rounds(&row_loads, filter_code, pass, key_code),
        ROWS_TOTALS.to_string(),
        entry_kernel(&params, &args, &row_loads.aligned, &any_nulls),
    ]
    .concat()
}

/// Rows per thread and round of the full pass: enough loads in flight for the memory system,
/// fewer for wide keys (registers). 8 did no better overall: what one query gained, the others
/// lost.
fn full_rows(kind: KeyWidth) -> usize {
    match kind {
        KeyWidth::W32 | KeyWidth::W64 => 4,
        KeyWidth::W128 | KeyWidth::W256 => 2,
    }
}

/// The composite key's CUDA type (fused.cuh) for its width.
fn key_type(kind: KeyWidth) -> &'static str {
    match kind {
        KeyWidth::W32 => "K32",
        KeyWidth::W64 => "K64",
        KeyWidth::W128 => "K128",
        KeyWidth::W256 => "K256",
    }
}

/// Per input read, the statements that bring a round's rows into registers: the rows' values
/// are fetched first (arrays over the round's rows), held, then taken row by row.
struct RowLoads {
    /// The arrays the values and validities are fetched into.
    declare: String,
    /// Reads row i of every input.
    fetch: String,
    /// With consecutive rows per thread: each plain column's values for all of them at once …
    fetch_vector: String,
    /// … and the rest (other inputs' values, every validity) per row.
    fetch_rest: String,
    /// Copies of the fetched arrays, which a pipelined fetch of the next round leaves intact.
    hold: String,
    /// Row r's values and validities, under the names the expressions' code uses.
    take: String,
    /// C condition: every vector-loaded column is aligned for its vectors.
    aligned: String,
}

impl RowLoads {
    /// The statements for `loads`, with `rows` rows per thread in the full pass.
    fn new(loads: &[translate::Load], rows: usize) -> Self {
        let (mut declare, mut fetch, mut take) = (String::new(), String::new(), String::new());
        let mut hold = String::new();
        let (mut fetch_vector, mut fetch_rest) = (String::new(), String::new());
        let mut aligned = Vec::new();
        for l in loads {
            let (t, v, nv) = (&l.ctype, &l.value, &l.valid);
            let _ = writeln!(declare, "    {t} {v}_r[ROWS];\n    bool {nv}_r[ROWS];");
            let _ = writeln!(
                fetch,
                "                {v}_r[r] = {};\n                {nv}_r[r] = !NULLS || ({});",
                l.read, l.valid_read
            );
            match l.vector {
                Some((p, bytes)) => {
                    let _ = writeln!(
                        fetch_vector,
                        "            load_rows<{t}, ROWS>((const {t} *)c{p} + jb, {v}_r);"
                    );
                    aligned.push(format!("(u64)c{p} % {} == 0", (rows * bytes).min(16)));
                }
                None => {
                    let _ = writeln!(fetch_rest, "                {v}_r[r] = {};", l.read);
                }
            }
            let _ = writeln!(
                fetch_rest,
                "                {nv}_r[r] = !NULLS || ({});",
                l.valid_read
            );
            let _ = writeln!(
                hold,
                "        {t} {v}_c[ROWS];\n        bool {nv}_c[ROWS];\n#pragma unroll\n        \
                 for (int r = 0; r < ROWS; ++r) {{ {v}_c[r] = {v}_r[r]; {nv}_c[r] = {nv}_r[r]; }}"
            );
            let _ = writeln!(
                take,
                "            const {t} {v} = {v}_c[r];\n            const bool {nv} = {nv}_c[r];"
            );
        }
        let aligned = if aligned.is_empty() {
            "true".to_string()
        } else {
            aligned.join(" && ")
        };
        Self {
            declare,
            fetch,
            fetch_vector,
            fetch_rest,
            hold,
            take,
            aligned,
        }
    }
}

/// C condition: some input has a validity bitmap, so the rows' validities must be tested
/// (constant false where no input is read per row).
fn any_nulls(inputs: &[KernelInput], loads: &[translate::Load]) -> String {
    if loads.is_empty() {
        "false".to_string()
    } else {
        (0..inputs.len())
            .map(|p| format!("c{p}_valid != nullptr"))
            .collect::<Vec<_>>()
            .join(" || ")
    }
}

/// The inputs' kernel parameters, each commented with what it holds, and the arguments that
/// hand them on from the entry point to `fused_rows`.
fn input_params(inputs: &[KernelInput]) -> (String, String) {
    let mut params = String::new();
    let mut args = String::new();
    for (p, input) in inputs.iter().enumerate() {
        let what = match input {
            KernelInput::Column(c) => format!("input column {c}"),
            KernelInput::HostPredicate => "the host-evaluated predicate".to_string(),
            KernelInput::DictionaryCodes(c) => format!("codes of dictionary column {c}"),
            KernelInput::DictionaryMatch { column, values } => {
                format!("entries of column {column}'s dictionary in {values:?}")
            }
            KernelInput::StringPrefix(c) => format!("first 16 bytes of input column {c}"),
            KernelInput::StringColumn(c) => {
                format!("row ends of input column {c}; its bytes' address")
            }
            KernelInput::StringCodes(c) => format!("codes of string column {c}"),
        };
        let _ = writeln!(
            params,
            "    const u8 *c{p}, u64 c{p}_bit, const u8 *c{p}_valid, u64 c{p}_valid_bit, // {what}"
        );
        let _ = write!(args, "c{p}, c{p}_bit, c{p}_valid, c{p}_valid_bit, ");
    }
    (params, args)
}

/// The source's first lines: the host's NaN bits, the key type, the error flags and rows per
/// round as macros, the program's globals, and defaults for the loader's tuning macros.
fn source_header(globals: &str, kind: KeyWidth, rows: usize) -> String {
    let (nan32, nan64) = host_default_nan();
    let cluster = crate::device::FUSED_SAMPLE_CLUSTER;
    let (null_key, ambiguous, host_only) = (ERROR_NULL_KEY, ERROR_AMBIGUOUS_NAN, ERROR_HOST_ONLY);
    let key = key_type(kind);
    format!(
        r#"// Generated by datafusion-gpu-topk (src/fusion): predicate, keys and candidate append.
#define HOST_NAN_F32 0x{nan32:08x}u
#define HOST_NAN_F64 0x{nan64:016x}ull
#define SAMPLE_CLUSTER {cluster}
#include "fused.cuh"

typedef {key} Key;
#define ERROR_NULL_KEY {null_key}u
#define ERROR_AMBIGUOUS_NAN {ambiguous}u
#define ERROR_HOST_ONLY {host_only}u
#define FULL_ROWS {rows}
{globals}// The loader compiles with -DFUSED_MIN_BLOCKS=5 unless that spills (device/kernels.rs
// `compile_generated`).
#ifndef FUSED_MIN_BLOCKS
#define FUSED_MIN_BLOCKS 1
#endif
#ifndef FUSED_PIPELINE
#define FUSED_PIPELINE 0
#endif

"#
    )
}

/// `fused_rows`' documentation, signature and set-up, and its `fetch` of a round's inputs
/// (by vectors where a thread's rows are consecutive, else row by row).
fn rows_prologue(params: &str, loads: &RowLoads) -> String {
    let RowLoads {
        declare,
        fetch,
        fetch_vector,
        fetch_rest,
        ..
    } = loads;
    format!(
        r#"// Evaluates rows i = sample_row(j, step) for j < n (STRIDED: a sample of one row in `step`,
// fused.cuh; else i = j: the full pass); NULLS: some input has a validity bitmap. Each thread takes
// ROWS rows per round (FULL_ROWS in the full pass; 1 in the sample, whose few thousand rows lie far
// apart and want as many threads as they can get) and issues every input load of them before
// evaluating anything, so that their loads are in flight together; with FUSED_PIPELINE (set by the
// loader where the registers allow) the full pass issues the next round's loads before it evaluates
// this one. Counts and error flags stay in registers until the end (no barrier per round). A
// block's round covers 256 · ROWS rows: with VEC a thread's ROWS rows are consecutive and each
// plain column's values come in one vector load (`load_rows`), else row r of the round is r · 256 +
// the thread (coalesced scalar loads).
template <bool STRIDED, bool NULLS, bool VEC, int ROWS>
__device__ __forceinline__ void fused_rows(
{params}    u64 n, u64 step, u64 id_start, const Threshold<Key> *thr, Key *cand_keys, u64 *cand_ids, u64 *count,
    u64 capacity, u64 *passed, u32 *error, u32 *kept, u64 *span, Key *buffer_keys, u64 *buffer_ids) {{
    const bool have_thr = thr->valid != 0;
    const Key tk = thr->key;
    const u64 tid = thr->id;
    u32 my_passed = 0, my_error = 0;
    WarpBuffer<Key> buffer = {{buffer_keys, buffer_ids, 0}};
    // With `span`, the buffer's flushes OR the appended keys into its span words (common.cuh),
    // and the warp ORs them into `span` at the end.
    if (span != nullptr) buffer.clear_span();
    // The values of the round that starts at row j0, into the arrays below.
{declare}    auto fetch = [&](u64 j0) {{
        const u64 jb = j0 + (u64)threadIdx.x * ROWS; // VEC: the thread's first row
        if (VEC && jb + ROWS <= n) {{
{fetch_vector}#pragma unroll
            for (int r = 0; r < ROWS; ++r) {{
                const u64 i = jb + r;
{fetch_rest}            }}
        }} else {{
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {{
            const u64 j = VEC ? jb + r : j0 + (u64)r * 256 + threadIdx.x;
            const u64 i = STRIDED ? sample_row(j, step) : j;
            if (j < n) {{
{fetch}            }}
            }}
        }}
    }};
"#
    )
}

/// `fused_rows`' rounds: each evaluates its rows' predicate and key, appends the rows that
/// beat the threshold and records them in `kept`.
fn rows_rounds(loads: &RowLoads, filter_code: &str, pass: &str, key_code: &str) -> String {
    let (hold, take) = (&loads.hold, &loads.take);
    format!(
        r#"    // The full pass fetches the next round before it evaluates this one, so that a warp's
    // loads stay in flight while it evaluates and appends.
    constexpr bool PIPELINED = !STRIDED && FUSED_PIPELINE;
    const u64 stride = (u64)gridDim.x * (256 * ROWS);
    u64 j0 = (u64)blockIdx.x * (256 * ROWS);
    if (PIPELINED && j0 < n) fetch(j0);
    for (; j0 < n; j0 += stride) {{
        bool keeps[ROWS];
        Key keys[ROWS];
        if (!PIPELINED) fetch(j0);
{hold}        if (PIPELINED && j0 + stride < n) fetch(j0 + stride);
        const u64 jb = j0 + (u64)threadIdx.x * ROWS; // VEC: the thread's first row
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {{
            const u64 j = VEC ? jb + r : j0 + (u64)r * 256 + threadIdx.x;
            const u64 i = STRIDED ? sample_row(j, step) : j;
            const u64 id = id_start + i;
            bool pass = false, keep = false, bad = false, ambiguous = false, host_only = false;
            Key key = key_zero<Key>();
            if (j < n) {{
{take}{filter_code}            pass = {pass};
            if (pass) {{
{key_code}            keep = !bad && (!have_thr || pair_less(key, id, tk, tid));
            }}
            }}
            my_passed += pass;
            my_error |= (bad ? ERROR_NULL_KEY : 0u) | (ambiguous ? ERROR_AMBIGUOUS_NAN : 0u) |
                        (host_only ? ERROR_HOST_ONLY : 0u);
            keeps[r] = keep;
            keys[r] = key;
        }}
        // Most rounds append nothing once a threshold holds: one vote skips the appends.
        bool any_keep = false;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) any_keep |= keeps[r];
        if (kept == nullptr && !__any_sync(FULL_MASK, any_keep)) continue;
        if (VEC && kept != nullptr) {{
            // The warp's 32 · ROWS consecutive rows: 32 / ROWS lanes fill a word, ROWS bits each.
            constexpr u32 PER = 32 / ROWS;
            u32 word = 0;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) word |= (u32)keeps[r] << (ROWS * (lane_id() % PER) + r);
#pragma unroll
            for (u32 o = 1; o < PER; o <<= 1) word |= __shfl_xor_sync(FULL_MASK, word, o);
            const u64 first = j0 + (u64)(threadIdx.x & ~31u) * ROWS + (u64)(lane_id() / PER) * 32;
            if (lane_id() % PER == 0 && first < n) kept[first >> 5] = word;
        }}
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {{
            const u64 j = VEC ? jb + r : j0 + (u64)r * 256 + threadIdx.x;
            if (!VEC && kept != nullptr) {{
                const u32 keep_mask = __ballot_sync(FULL_MASK, keeps[r]);
                if (lane_id() == 0 && j < n) kept[j >> 5] = keep_mask;
            }}
            buffer.push(keeps[r], keys[r], id_start + (STRIDED ? sample_row(j, step) : j), cand_keys, cand_ids, count, capacity, span != nullptr);
        }}
    }}
"#
    )
}

/// `fused_rows`' end: the last appends, then the block's counts, error flags and span words
/// added into the outputs with one atomic per word.
const ROWS_TOTALS: &str = r#"    buffer.flush(cand_keys, cand_ids, count, capacity, span != nullptr);
    // The block's totals meet in shared memory, then one atomic per word and block: the warps'
    // own atomics on the same few words (thousands each in a full pass) would queue at the
    // pass's end. Every thread gets here: the loop's bounds are the block's.
    constexpr u32 TOTALS = 2 + 2 * Key::N;
    __shared__ u64 totals[8][TOTALS];
    const u32 warp = threadIdx.x / 32;
    const u32 warp_passed = __reduce_add_sync(FULL_MASK, my_passed);
    const u32 warp_error = __reduce_or_sync(FULL_MASK, my_error);
    if (lane_id() == 0) {
        totals[warp][0] = warp_passed;
        totals[warp][1] = warp_error;
    }
#pragma unroll
    for (u32 w = 0; w < 2 * Key::N; ++w) {
        const u64 words = span != nullptr ? buffer.warp_span(w) : 0ull;
        if (lane_id() == 0) totals[warp][2 + w] = words;
    }
    __syncthreads();
    if (threadIdx.x < TOTALS) {
        u64 v = 0;
#pragma unroll
        for (u32 q = 0; q < 8; ++q) v = threadIdx.x == 0 ? v + totals[q][0] : v | totals[q][threadIdx.x];
        if (v != 0) {
            if (threadIdx.x == 0) {
                atomicAdd(passed, v);
            } else if (threadIdx.x == 1) {
                atomicOr(error, (u32)v);
            } else if (span != nullptr) {
                atomicOr((unsigned long long *)&span[threadIdx.x - 2], v);
            }
        }
    }
}
"#;

/// The entry point: picks `fused_rows`' variant (sample or full pass, vector loads where the
/// columns are aligned, validity tests where some input has NULLs) and gives it warp buffers.
fn entry_kernel(params: &str, args: &str, aligned: &str, any_nulls: &str) -> String {
    format!(
        r#"
extern "C" __global__ void __launch_bounds__(256, FUSED_MIN_BLOCKS) {ENTRY}(
{params}    u64 n, u64 step, u64 id_start, const Threshold<Key> *thr, Key *cand_keys, u64 *cand_ids, u64 *count,
    u64 capacity, u64 *passed, u32 *error, u32 *kept, u64 *span) {{
    grid_dependency_wait();
    // Each warp's write buffer (common.cuh): one counter atomic per ~WARP_BUFFER appends.
    __shared__ Key buffer_keys[8][WARP_BUFFER];
    __shared__ u64 buffer_ids[8][WARP_BUFFER + WarpBuffer<Key>::SPAN_WORDS];
    Key *bk = buffer_keys[threadIdx.x / 32];
    u64 *bi = buffer_ids[threadIdx.x / 32];
    // The full pass loads a thread's rows by vectors where the columns are aligned for them,
    // and over inputs without NULLs (the common case) skips every validity test.
    if (step != 1) {{
        fused_rows<true, true, false, 1>({args}n, step, id_start, thr, cand_keys, cand_ids, count, capacity, passed, error, kept, span, bk, bi);
    }} else if (!({aligned})) {{
        fused_rows<false, true, false, FULL_ROWS>({args}n, step, id_start, thr, cand_keys, cand_ids, count, capacity, passed, error, kept, span, bk, bi);
    }} else if ({any_nulls}) {{
        fused_rows<false, true, true, FULL_ROWS>({args}n, step, id_start, thr, cand_keys, cand_ids, count, capacity, passed, error, kept, span, bk, bi);
    }} else {{
        fused_rows<false, false, true, FULL_ROWS>({args}n, step, id_start, thr, cand_keys, cand_ids, count, capacity, passed, error, kept, span, bk, bi);
    }}
}}
"#
    )
}
