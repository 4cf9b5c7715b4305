//! The differential fuzzer: random tables and random top-k queries, each run with the operator
//! (the backend under test) and with plain DataFusion (the rule off), and compared.
//!
//! Tables: every supported key type with NULLs, NaN, ±0.0, ±inf and extremes, columns made
//! all-equal or nearly so (heavy ties), empty and single-row partitions, random partition
//! counts and batch sizes, plain and dictionary strings; in memory or in Parquet files.
//! Queries: one to four sort keys (columns, ranking expressions of the translator's whole
//! grammar, or string, binary and `Decimal256` keys) with random ASC/DESC and NULLS FIRST/LAST, predicates (with string comparisons),
//! OFFSET, k from 0 to beyond the table, projections of any columns.
//!
//! The oracle is DataFusion's full sort with `rid` (the input position) as the last key, LIMIT
//! and OFFSET applied to its rows: the operator's order is that stable order, so rows must be
//! equal one for one, ties included; errors must be DataFusion's. When the two differ, plain
//! DataFusion's own answer to the very query is consulted (its TopK can skip rows whose key
//! fails, and which partition fails first is a race on both sides).
//!
//! Each table also gets per-group queries ([`GROUP_QUERIES_PER_TABLE`]): `ROW_NUMBER()`,
//! `RANK()` or `DENSE_RANK()` `OVER (PARTITION BY …)` of any one or two columns, ordered by any
//! columns, kept by `<=`, `<` or `=`, against DataFusion's window plan (rows in any order: the
//! window's partitions are hashed; `ROW_NUMBER()` ends its keys with `rid`, so its numbers are
//! DataFusion's).
//!
//! A mismatch is minimised (the query, then the rows) and written as a `.slt` case to
//! `GPU_TOPK_FUZZ_OUT` (default: a temporary directory), to keep in `sql-tests/`; a per-group
//! mismatch is written as its query and the two answers.
//!
//! `fuzz_slice_matches_datafusion` runs a fixed-seed slice in CI. The full run is ignored:
//! `GPU_TOPK_FUZZ_QUERIES=100000 cargo test --release --test all fuzz_budget -- --ignored
//! --nocapture` (`GPU_TOPK_FUZZ_SEED` picks another sequence, `GPU_TOPK_FUZZ_SECONDS` stops
//! it after that long).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{cast, take};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;

use crate::common::{
    Rng, Storage, count_gpu_topk, exact_rows, plain_session_with, register_as, run, run_oracle,
    test_backend, test_dir,
};
use crate::differential::{ExprGen, same_error_text, schema, table};
use crate::slt_format::{column_type, format_rows};
use sqllogictest::ColumnType as _;

/// Queries per random table.
const QUERIES_PER_TABLE: usize = 25;
/// Per-group queries per random table, besides those.
const GROUP_QUERIES_PER_TABLE: usize = 4;

/// One random table and how it is read.
#[derive(Clone)]
struct Setup {
    data: Vec<Vec<RecordBatch>>,
    storage: Storage,
    partitions: usize,
    batch_size: usize,
}

/// One random query.
#[derive(Debug, Clone)]
struct Query {
    select: Vec<String>,
    filter: Option<String>,
    /// Sort expressions with their direction and NULLS placement.
    keys: Vec<String>,
    limit: usize,
    offset: usize,
}

impl Query {
    fn tail(&self) -> String {
        match self.offset {
            0 => format!(" LIMIT {}", self.limit),
            m => format!(" LIMIT {} OFFSET {m}", self.limit),
        }
    }

    fn from(&self) -> String {
        let filter = self
            .filter
            .as_ref()
            .map(|f| format!(" WHERE {f}"))
            .unwrap_or_default();
        format!("SELECT {} FROM t{filter}", self.select.join(", "))
    }

    fn sql(&self) -> String {
        format!(
            "{} ORDER BY {}{}",
            self.from(),
            self.keys.join(", "),
            self.tail()
        )
    }

    /// The full sort in input order among ties, windowed by `run_oracle`. The keys are
    /// computed in a subquery: DataFusion's sanity check rejects some plans of
    /// `ORDER BY f(x), rid` over several partitions.
    fn oracle(&self) -> String {
        let (mut computed, mut order) = (Vec::new(), Vec::new());
        for (i, key) in self.keys.iter().enumerate() {
            let (expr, direction) = split_direction(key);
            computed.push(format!("{expr} AS __k{i}"));
            order.push(format!("__k{i}{direction}"));
        }
        let filter = self
            .filter
            .as_ref()
            .map(|f| format!(" WHERE {f}"))
            .unwrap_or_default();
        format!(
            "SELECT {} FROM (SELECT *, {} FROM t{filter}) ORDER BY {}, rid{}",
            self.select.join(", "),
            computed.join(", "),
            order.join(", "),
            self.tail()
        )
    }

    /// Simpler variants, for minimisation.
    fn simpler(&self) -> Vec<Query> {
        let mut out = Vec::new();
        if self.filter.is_some() {
            out.push(Query {
                filter: None,
                ..self.clone()
            });
        }
        if self.offset > 0 {
            out.push(Query {
                offset: 0,
                ..self.clone()
            });
        }
        for i in 0..self.keys.len() {
            if self.keys.len() > 1 {
                let mut q = self.clone();
                q.keys.remove(i);
                out.push(q);
            }
        }
        for i in 0..self.select.len() {
            if self.select.len() > 1 {
                let mut q = self.clone();
                q.select.remove(i);
                out.push(q);
            }
        }
        for limit in [1, self.limit / 2] {
            if limit < self.limit && limit > 0 {
                out.push(Query {
                    limit,
                    ..self.clone()
                });
            }
        }
        out
    }
}

/// Every column of the fuzzed table but `rid`.
fn columns() -> Vec<String> {
    schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .filter(|n| n != "rid")
        .collect()
}

fn random_setup(rng: &mut Rng, seed: u64) -> Setup {
    let partitions = 1 + rng.below(6) as usize;
    let sizes: Vec<Vec<usize>> = (0..partitions)
        .map(|_| match rng.below(8) {
            0 => vec![],
            1 => vec![1],
            _ => (0..1 + rng.below(3))
                .map(|_| match rng.below(6) {
                    0 => 0,
                    1 => 1,
                    _ => 1 + rng.below(400) as usize,
                })
                .collect(),
        })
        .collect();
    let mut sizes: Vec<&[usize]> = sizes.iter().map(Vec::as_slice).collect();
    if sizes.iter().all(|s| s.is_empty()) {
        sizes[0] = &[0]; // a table is registered with at least one (empty) batch
    }
    let mut data = table(seed, &sizes);
    // Heavy ties: some columns all-equal over the whole table, some with a few values a batch.
    let names = columns();
    for name in &names {
        let index = schema().index_of(name).unwrap();
        let first = data
            .iter()
            .flatten()
            .find(|b| b.num_rows() > 0)
            .map(|b| ScalarValue::try_from_array(b.column(index), 0).unwrap());
        let mode = rng.below(10);
        if mode > 1 {
            continue;
        }
        for batch in data.iter_mut().flatten() {
            let n = batch.num_rows();
            if n == 0 {
                continue;
            }
            let column: ArrayRef = match (mode, &first) {
                (0, Some(value)) => value.to_array_of_size(n).unwrap(),
                _ => {
                    let picks = UInt32Array::from_iter_values(
                        (0..n).map(|_| rng.below(3.min(n as u64)) as u32),
                    );
                    take(batch.column(index), &picks, None).unwrap()
                }
            };
            let mut columns = batch.columns().to_vec();
            columns[index] = column;
            *batch = RecordBatch::try_new(batch.schema(), columns).unwrap();
        }
    }
    let storage = match rng.below(4) {
        0 => Storage::Parquet,
        1 => Storage::GpuTable,
        _ => Storage::Memory,
    };
    let partitions = match storage {
        // In-memory tables are read one partition each, so input order is the table's order.
        Storage::Memory | Storage::GpuTable => partitions,
        _ => 1 + rng.below(8) as usize,
    };
    Setup {
        data,
        storage,
        partitions,
        batch_size: [7, 64, 100, 1024][rng.below(4) as usize],
    }
}

/// A sort key's expression and its direction suffix (one of [`DIRECTIONS`]).
fn split_direction(key: &str) -> (&str, &str) {
    DIRECTIONS
        .iter()
        .filter(|d| !d.is_empty() && key.ends_with(**d))
        .max_by_key(|d| d.len())
        .map_or((key, ""), |d| (&key[..key.len() - d.len()], d))
}

const DIRECTIONS: &[&str] = &[
    "",
    " ASC",
    " DESC",
    " NULLS FIRST",
    " NULLS LAST",
    " DESC NULLS LAST",
    " ASC NULLS FIRST",
];

/// The (sort keys, predicate) pairs queries draw from: at most `limit` distinct ones, drawn
/// up front from their own seed, so that every fuzzing task's sequence depends on its seed
/// alone. With the CUDA backend each distinct pair is a generated program to compile (about a
/// second), so a bounded pool lets a run reach many queries; the tables, projections, k and
/// OFFSET still vary per query. Unbounded (the CPU path), every query draws a fresh pair.
struct Programs {
    drawn: Vec<(Vec<String>, Option<String>)>,
}

impl Programs {
    fn new(limit: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x5eed_0f9a_09a3);
        let drawn = match limit {
            usize::MAX => vec![],
            n => (0..n.max(1)).map(|_| random_program(&mut rng)).collect(),
        };
        Self { drawn }
    }

    fn draw(&self, rng: &mut Rng) -> (Vec<String>, Option<String>) {
        match self.drawn.len() {
            0 => random_program(rng),
            n => self.drawn[rng.below(n as u64) as usize].clone(),
        }
    }
}

/// Distinct programs a run compiles at most: all fresh on the CPU path, a bounded pool with
/// the CUDA backend (`GPU_TOPK_FUZZ_PROGRAMS`).
fn program_limit(cuda_default: usize) -> usize {
    match std::env::var("GPU_TOPK_FUZZ_PROGRAMS") {
        Ok(v) => v.parse().expect("GPU_TOPK_FUZZ_PROGRAMS: a number"),
        Err(_) if test_backend() == datafusion_gpu_topk::Backend::Cuda => cuda_default,
        Err(_) => usize::MAX,
    }
}

/// Keys compared byte by byte (a prefix layout): strings of each kind, binary, `Decimal256`.
const BYTE_KEYS: [&str; 7] = [
    "s",
    "ds",
    "sv",
    "concat(sv, s)",
    "arrow_cast(sv, 'Binary')",
    "arrow_cast(s, 'LargeUtf8')",
    "arrow_cast(dec, 'Decimal256(40, 3)')",
];

/// Whether a query's keys make a prefix layout: a byte-compared key, or keys wider than the
/// composite (two nullable `Decimal128` keys alone need 258 bits).
fn prefix_keys(keys: &[String]) -> bool {
    let bytes = keys.iter().any(|k| {
        let name = k.split_whitespace().next().unwrap_or("");
        BYTE_KEYS.contains(&name) || k.contains("Binary") || k.contains("concat")
    });
    bytes || keys.iter().filter(|k| k.starts_with("dec")).count() >= 2
}

/// Random sort keys and predicate.
fn random_program(rng: &mut Rng) -> (Vec<String>, Option<String>) {
    let names = columns();
    let mut generator = ExprGen(Rng::new(rng.next_u64()));
    let reads_a_column = |e: &str| {
        e.split(|c: char| !c.is_alphanumeric() && c != '_')
            .any(|w| names.iter().any(|n| n == w))
    };
    let mut keys: Vec<String> = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let key = match rng.below(4) {
            0 => names[rng.below(names.len() as u64) as usize].clone(),
            1 => BYTE_KEYS[rng.below(BYTE_KEYS.len() as u64) as usize].to_string(),
            _ => loop {
                let depth = rng.below(4) as u32;
                let e = match rng.below(2) {
                    0 => generator.int(depth),
                    _ => generator.float(depth),
                };
                // A bare integer literal would be a column position.
                if reads_a_column(&e) {
                    break e;
                }
            },
        };
        let direction = DIRECTIONS[rng.below(DIRECTIONS.len() as u64) as usize];
        let key = format!("{key}{direction}");
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let filter = match rng.below(10) {
        0..=2 => None,
        3 => Some(
            [
                "s = 'ab'",
                "s < 'b'",
                "s LIKE 'a%'",
                "s IS NULL",
                "s <> ''",
                "ds > 'en'",
                "ds = s",
            ][rng.below(7) as usize]
                .to_string(),
        ),
        4 => Some(string_predicate(rng, 2)),
        _ => Some(generator.pred(rng.below(4) as u32)),
    };
    (keys, filter)
}

/// A predicate on the plain string columns (`s`, `sv`) of the kinds the device evaluates on
/// each row's bytes: comparisons with literals, `[NOT] LIKE` (wildcards and escapes), `IN`
/// lists, `starts_with` / `ends_with`, lengths, `IS [NOT] NULL`, and their `AND` / `OR`.
fn string_predicate(rng: &mut Rng, depth: u32) -> String {
    const PIECES: [&str; 9] = [
        "",
        "a",
        "ab",
        "b",
        "é",
        "日本",
        "https://example.com/a/b/",
        "ÿ",
        "~",
    ];
    const OPS: [&str; 6] = ["=", "<>", "<", "<=", ">", ">="];
    let column = ["s", "sv"][rng.below(2) as usize];
    let piece = |rng: &mut Rng| PIECES[rng.below(PIECES.len() as u64) as usize].to_string();
    let literal = |rng: &mut Rng| {
        let mut text = piece(rng);
        if rng.chance(0.3) {
            text.push_str(&piece(rng));
        }
        text
    };
    let op = |rng: &mut Rng| OPS[rng.below(OPS.len() as u64) as usize];
    match rng.below(if depth > 0 { 8 } else { 7 }) {
        0 => format!("{column} {} '{}'", op(rng), literal(rng)),
        1 => format!("'{}' {} {column}", literal(rng), op(rng)),
        2 => {
            let mut pattern = String::new();
            for _ in 0..1 + rng.below(4) {
                match rng.below(7) {
                    0 | 1 => pattern.push('%'),
                    2 => pattern.push('_'),
                    3 => pattern.push_str(["\\%", "\\_", "\\\\", "\\a"][rng.below(4) as usize]),
                    _ => pattern.push_str(&literal(rng)),
                }
            }
            let not = if rng.chance(0.3) { "NOT " } else { "" };
            format!("{column} {not}LIKE '{pattern}'")
        }
        3 => {
            let items: Vec<String> = (0..1 + rng.below(3))
                .map(|_| match rng.chance(0.15) {
                    true => "NULL".to_string(),
                    false => format!("'{}'", literal(rng)),
                })
                .collect();
            let not = if rng.chance(0.3) { "NOT " } else { "" };
            format!("{column} {not}IN ({})", items.join(", "))
        }
        4 => {
            let function = ["starts_with", "ends_with"][rng.below(2) as usize];
            format!("{function}({column}, '{}')", literal(rng))
        }
        5 => {
            let function = ["length", "char_length", "octet_length"][rng.below(3) as usize];
            format!("{function}({column}) {} {}", op(rng), rng.below(30))
        }
        6 => {
            let not = if rng.chance(0.5) { "NOT " } else { "" };
            format!("{column} IS {not}NULL")
        }
        _ => {
            let join = ["AND", "OR"][rng.below(2) as usize];
            format!(
                "({} {join} {})",
                string_predicate(rng, depth - 1),
                string_predicate(rng, depth - 1)
            )
        }
    }
}

fn random_query(rng: &mut Rng, rows: usize, programs: &Programs) -> Query {
    let names = columns();
    let mut generator = ExprGen(Rng::new(rng.next_u64()));
    let (keys, filter) = programs.draw(rng);
    let mut select: Vec<String> = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let pick = match rng.below(12) {
            0 => "rid".to_string(),
            1 => format!("{} AS e", generator.int(2)),
            _ => names[rng.below(names.len() as u64) as usize].clone(),
        };
        let name = pick.rsplit(' ').next().unwrap().to_string();
        if !select
            .iter()
            .any(|s| s.rsplit(' ').next() == Some(name.as_str()))
        {
            select.push(pick);
        }
    }
    let limit = [
        0,
        1,
        2,
        3,
        10,
        50,
        333,
        rows.saturating_sub(1),
        rows,
        rows + 3,
        5000,
    ][rng.below(11) as usize];
    let offset = match rng.below(4) {
        0 => rng.below(30) as usize,
        _ => 0,
    };
    Query {
        select,
        filter,
        keys,
        limit,
        offset,
    }
}

/// A random per-group query over the fuzzed table (see the module documentation).
fn random_group_query(rng: &mut Rng) -> String {
    let names = columns();
    let pick =
        |rng: &mut Rng, items: &[String]| items[rng.below(items.len() as u64) as usize].clone();
    let mut groups = vec![pick(rng, &names)];
    let second = pick(rng, &names);
    if rng.chance(0.3) && !groups.contains(&second) {
        groups.push(second);
    }
    let function = ["ROW_NUMBER", "ROW_NUMBER", "RANK", "DENSE_RANK"][rng.below(4) as usize];
    let mut order: Vec<String> = (0..1 + rng.below(2))
        .map(|_| {
            let direction = DIRECTIONS[rng.below(DIRECTIONS.len() as u64) as usize];
            format!("{}{direction}", pick(rng, &names))
        })
        .collect();
    if function == "ROW_NUMBER" {
        order.push("rid".into());
    }
    let k = [0, 1, 1, 2, 3, 10, 100, 5000][rng.below(8) as usize];
    let keep = match rng.below(3) {
        0 => format!("rn <= {k}"),
        1 => format!("rn < {}", k + 1),
        _ => format!("rn = {}", k.max(1)),
    };
    let filter = match rng.chance(0.3) {
        true => format!("WHERE rid % {} <> 0", 2 + rng.below(4)),
        false => String::new(),
    };
    format!(
        "SELECT rid, {g}, rn FROM (SELECT *, {function}() OVER (PARTITION BY {g} ORDER BY {o}) \
         AS rn FROM t {filter}) WHERE {keep}",
        g = groups.join(", "),
        o = order.join(", ")
    )
}

/// Number of `GpuGroupTopKExec` nodes in a plan.
fn count_group_topk(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> usize {
    let here = usize::from(
        plan.downcast_ref::<datafusion_gpu_topk::GpuGroupTopKExec>()
            .is_some(),
    );
    here + plan
        .children()
        .into_iter()
        .map(count_group_topk)
        .sum::<usize>()
}

/// A per-group query run by the operator and by DataFusion's window plan over the same
/// storage: the same rows in any order, or the same error. `None` where they agree.
async fn group_check(sessions: &Sessions, sql: &str, taken: &mut usize) -> Option<String> {
    let ours: Outcome = match sessions.ours.sql(sql).await {
        Err(e) => Err(e.to_string()),
        Ok(frame) => match frame.create_physical_plan().await {
            Err(e) => Err(e.to_string()),
            Ok(plan) => {
                *taken += usize::from(count_group_topk(&plan) > 0);
                collect(plan, sessions.ours.task_ctx())
                    .await
                    .map(|b| exact_rows(&b))
                    .map_err(|e| e.to_string())
            }
        },
    };
    let sorted = |outcome: Outcome| {
        normal(outcome).map(|mut rows| {
            rows.sort();
            rows
        })
    };
    let ours = sorted(ours);
    for ctx in [&sessions.oracle, &sessions.oracle_one] {
        let want = sorted(
            run(ctx, sql)
                .await
                .map(|b| exact_rows(&b))
                .map_err(|e| e.to_string()),
        );
        if ours == want {
            return None;
        }
        // DataFusion's sanity check rejects some of its plans over several partitions from
        // one planning to the next: its answer over one partition is its answer.
        if !want.as_ref().is_err_and(|e| e.contains("SanityCheckPlan")) {
            return Some(format!("{sql}\nours: {ours:?}\nwant: {want:?}"));
        }
    }
    Some(format!(
        "{sql}\nours: {ours:?}\nwant: DataFusion's sanity check failed"
    ))
}

/// Ours (`enabled`; split between devices over an even number of partitions) or the oracle,
/// which reads every row of files (see `common::plain_session`).
fn context(
    enabled: bool,
    partitions: usize,
    batch_size: usize,
    storage: Storage,
) -> SessionContext {
    // Half the setups split the top-k between two devices (see `split_devices`).
    let devices = match partitions % 2 {
        0 => crate::sessions::split_devices(),
        _ => vec![0],
    };
    match enabled {
        true => crate::common::session_with(
            partitions,
            batch_size,
            crate::sessions::test_config(true).with_devices(Some(&devices)),
        ),
        false => plain_session_with(partitions, batch_size, storage),
    }
}

/// The sessions of one setup: ours, the oracle's, and plain DataFusion as is.
struct Sessions {
    ours: SessionContext,
    oracle: SessionContext,
    oracle_one: SessionContext,
    plain: SessionContext,
    data: Vec<Vec<RecordBatch>>,
    _dir: Option<PathBuf>,
}

impl Drop for Sessions {
    fn drop(&mut self) {
        if let Some(dir) = &self._dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

async fn sessions(setup: &Setup, tag: &str) -> Sessions {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = match setup.storage {
        Storage::Memory | Storage::GpuTable => None,
        _ => Some(test_dir(&format!("fuzz-{tag}-{n}"))),
    };
    let path = dir.clone().unwrap_or_default();
    let (p, b, s) = (setup.partitions, setup.batch_size, setup.storage);
    let sessions = Sessions {
        ours: context(true, p, b, s),
        oracle: context(false, p, b, s),
        oracle_one: context(false, 1, b, s),
        plain: context(false, p, b, Storage::Memory),
        data: setup.data.clone(),
        _dir: dir,
    };
    for ctx in [
        &sessions.ours,
        &sessions.oracle,
        &sessions.oracle_one,
        &sessions.plain,
    ] {
        register_as(ctx, "t", &setup.data, s, &path).await;
    }
    sessions
}

type Outcome = Result<Vec<String>, String>;

/// Normalises an outcome for comparison.
fn normal(outcome: Outcome) -> Outcome {
    outcome.map_err(|e| same_error_text(&e))
}

/// The query with its sort keys projected too, run by the operator and by plain DataFusion:
/// the same number of rows with the same key values in order.
async fn same_keys(sessions: &Sessions, query: &Query) -> bool {
    let mut keyed = query.clone();
    for (i, key) in query.keys.iter().enumerate() {
        keyed
            .select
            .push(format!("{} AS __k{i}", split_direction(key).0));
    }
    let sql = keyed.sql();
    let width = query.keys.len();
    let keys = |rows: Vec<String>| -> Vec<String> {
        rows.iter()
            .map(|r| {
                let cells: Vec<&str> = r.split(" | ").collect();
                cells[cells.len().saturating_sub(width)..].join(" | ")
            })
            .collect()
    };
    match (
        run(&sessions.ours, &sql).await,
        run(&sessions.plain, &sql).await,
    ) {
        (Ok(a), Ok(b)) => keys(exact_rows(&a)) == keys(exact_rows(&b)),
        _ => false,
    }
}

/// Whether DataFusion's own plan sorts by fewer keys than the query names: its optimizer
/// drops a key that a filter's equality makes constant, which for floats is unsound (`x =
/// -0.0` holds for 0.0 too), so its answer orders such rows by the plan's shape. The operator
/// orders by the query's keys where the plan still names them (the merge above the sorts).
async fn keys_normalised_away(sessions: &Sessions, query: &Query) -> bool {
    use datafusion::physical_plan::ExecutionPlan;
    use datafusion::physical_plan::sorts::sort::SortExec;
    fn fewest(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
        let here = plan.downcast_ref::<SortExec>().map(|s| s.expr().len());
        let below = plan.children().into_iter().filter_map(fewest).min();
        here.into_iter().chain(below).min()
    }
    match crate::common::physical_plan(&sessions.plain, &query.sql()).await {
        Ok(plan) => fewest(&plan).is_some_and(|n| n < query.keys.len()),
        Err(_) => false,
    }
}

/// Whether DataFusion computes different sort-key values for the same rows when the table
/// comes in one-row batches and in one batch a partition: a NaN computed from NaNs has no
/// specified sign (IEEE 754), and arrow's vectorised and scalar loops give different ones, so
/// every plan of such a query, DataFusion's included, orders those rows by its batch layout.
async fn layout_dependent_keys(sessions: &Sessions, query: &Query) -> bool {
    let keys: Vec<String> = query
        .keys
        .iter()
        .enumerate()
        .map(|(i, k)| format!("{} AS __k{i}", split_direction(k).0))
        .collect();
    let filter = query
        .filter
        .as_ref()
        .map(|f| format!(" WHERE {f}"))
        .unwrap_or_default();
    let sql = format!(
        "SELECT rid, {} FROM t{filter} ORDER BY rid",
        keys.join(", ")
    );
    let rows: Vec<RecordBatch> = sessions.data.iter().flatten().cloned().collect();
    let Some(first) = rows.first() else {
        return false;
    };
    let one_batch = datafusion::arrow::compute::concat_batches(&first.schema(), &rows).unwrap();
    let single_rows: Vec<RecordBatch> = (0..one_batch.num_rows())
        .map(|i| one_batch.slice(i, 1))
        .collect();
    let mut outcomes = Vec::new();
    for (layout, batch_size) in [
        (vec![vec![one_batch.clone()]], 8192),
        (vec![single_rows], 1),
    ] {
        let ctx = context(false, 1, batch_size, Storage::Memory);
        register_as(&ctx, "t", &layout, Storage::Memory, &PathBuf::new()).await;
        outcomes.push(run(&ctx, &sql).await.map(|b| exact_rows(&b)).ok());
    }
    outcomes[0] != outcomes[1]
}

/// Whether DataFusion fails with `error` on some row alone (the row's filter and keys). When
/// several rows fail, which error a query reports depends on which batch meets its failing
/// row first, and DataFusion's plan (its filter coalesces the rows that pass into new
/// batches) cuts batches differently from the operator, which evaluates the keys of each
/// input batch's passing rows.
async fn some_row_fails_with(sessions: &Sessions, query: &Query, error: &str) -> bool {
    let rows: Vec<RecordBatch> = sessions.data.iter().flatten().cloned().collect();
    let Some(first) = rows.first() else {
        return false;
    };
    let all = datafusion::arrow::compute::concat_batches(&first.schema(), &rows).unwrap();
    let ctx = context(false, 1, 8192, Storage::Memory);
    register_as(&ctx, "t", &[vec![all]], Storage::Memory, &PathBuf::new()).await;
    let mut alone = query.clone();
    let filter = alone.filter.take();
    if query.limit == 0 {
        return false;
    }
    (alone.limit, alone.offset) = (1, 0);
    let total: usize = rows.iter().map(|b| b.num_rows()).sum();
    let rids = exact_rows(&run(&ctx, "SELECT rid FROM t ORDER BY rid").await.unwrap());
    for rid in rids.iter().skip(1).take(total.min(2000)) {
        alone.filter = Some(match &filter {
            Some(f) => format!("rid = {rid} AND ({f})"),
            None => format!("rid = {rid}"),
        });
        if let Err(e) = run(&ctx, &alone.sql()).await
            && same_error_text(&e.to_string()) == error
        {
            return true;
        }
    }
    false
}

/// The oracle over the rows that pass the filter, materialised first (in input order): the
/// keys are then evaluated on those rows only, as SQL says, whichever way DataFusion's
/// optimizer would have arranged the full sort's projection and filter. `None` when the
/// filter alone fails.
async fn filtered_first(sessions: &Sessions, query: &Query) -> Option<Outcome> {
    let rows: Vec<RecordBatch> = sessions.data.iter().flatten().cloned().collect();
    let first = rows.first()?;
    let all = datafusion::arrow::compute::concat_batches(&first.schema(), &rows).unwrap();
    let ctx = context(false, 1, 8192, Storage::Memory);
    register_as(&ctx, "t", &[vec![all]], Storage::Memory, &PathBuf::new()).await;
    let filter = query
        .filter
        .as_ref()
        .map(|f| format!(" WHERE {f}"))
        .unwrap_or_default();
    let passing = run(&ctx, &format!("SELECT * FROM t{filter} ORDER BY rid"))
        .await
        .ok()?;
    let passing = datafusion::arrow::compute::concat_batches(&first.schema(), &passing).unwrap();
    let ctx = context(false, 1, 8192, Storage::Memory);
    register_as(
        &ctx,
        "t",
        &[vec![passing]],
        Storage::Memory,
        &PathBuf::new(),
    )
    .await;
    let unfiltered = Query {
        filter: None,
        ..query.clone()
    };
    Some(
        run_oracle(&ctx, &unfiltered.oracle())
            .await
            .map_err(|e| e.to_string()),
    )
}

/// Runs one query; `None` when it matches, else what differs. Adds to `taken` when the
/// operator ran it.
async fn check(
    sessions: &Sessions,
    query: &Query,
    taken: &mut usize,
    tied: &mut usize,
) -> Option<String> {
    let sql = query.sql();
    let mut by_operator = false;
    let ours: Outcome = match sessions.ours.sql(&sql).await {
        Err(e) => Err(e.to_string()),
        Ok(frame) => match frame.create_physical_plan().await {
            Err(e) => Err(e.to_string()),
            Ok(plan) => {
                by_operator = count_gpu_topk(&plan) > 0;
                *taken += usize::from(by_operator);
                collect(plan, sessions.ours.task_ctx())
                    .await
                    .map(|b| exact_rows(&b))
                    .map_err(|e| e.to_string())
            }
        },
    };
    let oracle_sql = query.oracle();
    let mut want = run_oracle(&sessions.oracle, &oracle_sql)
        .await
        .map_err(|e| e.to_string());
    if want.as_ref().is_err_and(|e| e.contains("SanityCheckPlan")) {
        // DataFusion's sanity check rejects some plans of `ORDER BY f(x), rid` over several
        // partitions; one partition plans without the merge it trips on.
        want = run_oracle(&sessions.oracle_one, &oracle_sql)
            .await
            .map_err(|e| e.to_string());
    }
    let (ours, want) = (normal(ours), normal(want));
    if ours == want {
        return None;
    }
    if ours
        .as_ref()
        .is_err_and(|e| e.contains("SanityCheckPlan") && !e.contains("GpuTopKExec"))
    {
        // DataFusion's own plan (the rule declined it) failed DataFusion's sanity check, which
        // for some orderings of several partitions it does from one planning to the next.
        return None;
    }
    if !by_operator {
        // Plain DataFusion ran it on both sides; its TopK breaks ties in arrival order.
        let same = match (&ours, &want) {
            (Ok(a), Ok(b)) => a.len() == b.len(),
            (Err(_), Err(_)) => true,
            _ => false,
        };
        if same {
            return None;
        }
    }
    // Plain DataFusion's answer to the query itself: its TopK may skip rows whose key fails,
    // and over several partitions which error comes first is a race.
    if let Err(e) = &ours {
        // Each batch alone: which failing row DataFusion meets first depends on which
        // partition runs first and on how its plan coalesces batches; an error one batch
        // raises alone is one DataFusion raises.
        for batch in sessions.data.iter().flatten().filter(|b| b.num_rows() > 0) {
            let one = context(false, 1, 100, Storage::Memory);
            let part = vec![vec![batch.clone()]];
            register_as(&one, "t", &part, Storage::Memory, &PathBuf::new()).await;
            if normal(
                run(&one, &sql)
                    .await
                    .map(|_| vec![])
                    .map_err(|e| e.to_string()),
            ) == Err(e.clone())
            {
                return None;
            }
        }
        if want.is_err() && some_row_fails_with(sessions, query, e).await {
            return None;
        }
        for ctx in [&sessions.plain, &sessions.oracle, &sessions.oracle_one] {
            for _ in 0..3 {
                if normal(
                    run(ctx, &sql)
                        .await
                        .map(|_| vec![])
                        .map_err(|e| e.to_string()),
                ) == Err(e.clone())
                {
                    return None;
                }
            }
        }
    }
    if let (Ok(rows), Ok(_)) = (&ours, &want) {
        // DataFusion's own plans of the query can disagree with its full sort: its optimizer
        // drops a key a filter makes constant (`-0.0 = x` holds for 0.0 too), and the sign of
        // a NaN computed from NaNs is not specified (IEEE 754) and varies with the batch
        // layout, which its total order of floats then tells apart. The answer of another
        // of DataFusion's plans is DataFusion's answer too...
        let direct = format!(
            "{} ORDER BY {}, rid{}",
            query.from(),
            query.keys.join(", "),
            query.tail()
        );
        for (ctx, sql) in [
            (&sessions.oracle, direct.as_str()),
            (&sessions.plain, sql.as_str()),
        ] {
            if run_oracle(ctx, sql).await.ok().as_ref() == Some(rows) {
                return None;
            }
        }
        // ... and where ties make rows interchangeable, the same sort-key values in order
        // (the keys computed once, by DataFusion, for both) are.
        if same_keys(sessions, query).await
            || layout_dependent_keys(sessions, query).await
            || keys_normalised_away(sessions, query).await
        {
            *tied += 1;
            return None;
        }
    }
    if filtered_first(sessions, query).await.map(normal).as_ref() == Some(&ours) {
        return None;
    }
    if let (Ok(ours), Err(_)) = (&ours, &want) {
        // The full sort's plan can evaluate the keys before the filter (DataFusion moves the
        // projection computing them), and DataFusion's sanity check rejects some plans of the
        // query over several partitions: its answer over one partition is its answer.
        for ctx in [&sessions.plain, &sessions.oracle_one] {
            if let Ok(theirs) = run(ctx, &sql).await.map(|b| exact_rows(&b)) {
                let (mut a, mut b) = (ours.clone(), theirs);
                a.sort();
                b.sort();
                if a == b {
                    return None;
                }
            }
        }
    }
    Some(format!("{sql}\nours: {ours:?}\nwant: {want:?}"))
}

/// `setup` with fewer rows: a partition, an empty batch, or a half or quarter of a batch less.
fn smaller_setups(setup: &Setup) -> Vec<Setup> {
    let mut out = Vec::new();
    let batches = setup.data.iter().flatten().count();
    // Whole partitions, then halves and quarters of each batch.
    if setup.data.len() > 1 {
        for p in 0..setup.data.len() {
            if setup.data[p].len() == batches {
                continue;
            }
            let mut s = setup.clone();
            s.data.remove(p);
            if setup.storage == Storage::Memory {
                s.partitions = s.data.len();
            }
            out.push(s);
        }
    }
    for (p, part) in setup.data.iter().enumerate() {
        for (b, batch) in part.iter().enumerate() {
            let n = batch.num_rows();
            if n == 0 && batches > 1 {
                let mut s = setup.clone();
                s.data[p].remove(b);
                out.push(s);
                continue;
            }
            for parts in [2, 4] {
                let chunk = n.div_ceil(parts);
                for start in (0..n).step_by(chunk.max(1)) {
                    let len = chunk.min(n - start);
                    let kept: Vec<RecordBatch> = [
                        batch.slice(0, start),
                        batch.slice(start + len, n - start - len),
                    ]
                    .into_iter()
                    .filter(|b| b.num_rows() > 0)
                    .collect();
                    let kept = match kept.is_empty() {
                        true => vec![batch.slice(0, 0)],
                        false => kept,
                    };
                    let mut s = setup.clone();
                    s.data[p].splice(b..=b, kept);
                    out.push(s);
                }
            }
        }
    }
    out
}

/// The smallest setup and query (greedily) that still differ.
async fn minimise(mut setup: Setup, mut query: Query) -> (Setup, Query, String) {
    let mut taken = 0;
    let mut tied = 0;
    let again = check(
        &sessions(&setup, "min").await,
        &query,
        &mut taken,
        &mut tied,
    )
    .await;
    let Some(mut diff) = again else {
        // Still a failure: the first run's difference was printed when it was found.
        let diff = "the mismatch did not recur when run again".to_string();
        return (setup, query, diff);
    };
    let mut budget = 400;
    'query: while budget > 0 {
        let ctx = sessions(&setup, "min").await;
        for q in query.simpler() {
            budget -= 1;
            if let Some(d) = check(&ctx, &q, &mut taken, &mut tied).await {
                (query, diff) = (q, d);
                continue 'query;
            }
        }
        break;
    }
    'rows: while budget > 0 {
        for s in smaller_setups(&setup) {
            budget -= 1;
            if budget == 0 {
                break 'rows;
            }
            if let Some(d) = check(&sessions(&s, "min").await, &query, &mut taken, &mut tied).await
            {
                (setup, diff) = (s, d);
                continue 'rows;
            }
        }
        break;
    }
    (setup, query, diff)
}

/// The columns a query reads, `rid` first.
fn read_columns(query: &Query) -> Vec<String> {
    let text = format!("{} {}", query.sql(), "rid");
    let words: Vec<&str> = text
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .collect();
    let mut out = vec!["rid".to_string()];
    out.extend(
        columns()
            .into_iter()
            .filter(|c| words.contains(&c.as_str())),
    );
    out
}

/// `CREATE TABLE t …` holding `setup`'s rows (the columns `query` reads), in input order.
fn create_table_sql(setup: &Setup, query: &Query) -> String {
    let names = read_columns(query);
    let schema = schema();
    let mut rows: Vec<Vec<String>> = Vec::new();
    for batch in setup.data.iter().flatten() {
        let texts: Vec<ArrayRef> = names
            .iter()
            .map(|n| {
                let column = batch.column(schema.index_of(n).unwrap());
                // Dates and timestamps go through their integer value (any value prints).
                let physical = match column.data_type() {
                    DataType::Date32 => cast(column, &DataType::Int32).unwrap(),
                    DataType::Date64 | DataType::Timestamp(..) => {
                        cast(column, &DataType::Int64).unwrap()
                    }
                    _ => Arc::clone(column),
                };
                cast(&physical, &DataType::Utf8).unwrap()
            })
            .collect();
        for r in 0..batch.num_rows() {
            rows.push(
                texts
                    .iter()
                    .map(|t| match ScalarValue::try_from_array(t, r).unwrap() {
                        ScalarValue::Utf8(Some(v)) => format!("'{}'", v.replace('\'', "''")),
                        _ => "NULL".to_string(),
                    })
                    .collect(),
            );
        }
    }
    let casts: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let t = schema.field_with_name(n).unwrap().data_type().clone();
            let value = format!("column{}", i + 1);
            match &t {
                DataType::Date32 => {
                    format!("arrow_cast(arrow_cast({value}, 'Int32'), '{t}') AS {n}")
                }
                DataType::Date64 | DataType::Timestamp(..) => {
                    format!("arrow_cast(arrow_cast({value}, 'Int64'), '{t}') AS {n}")
                }
                _ => format!("arrow_cast({value}, '{t}') AS {n}"),
            }
        })
        .collect();
    // VALUES needs a row: an empty table is the empty result of a query over one.
    let empty = rows.is_empty();
    if empty {
        rows.push(vec!["NULL".to_string(); names.len()]);
    }
    let values: Vec<String> = rows.iter().map(|r| format!("({})", r.join(", "))).collect();
    format!(
        "CREATE TABLE t AS SELECT {} FROM (VALUES\n  {}){}",
        casts.join(", "),
        values.join(",\n  "),
        if empty { " WHERE false" } else { "" }
    )
}

/// The `.slt` case of a minimised mismatch: the table, and the query's expected outcome
/// from DataFusion's full sort (input order among ties, so it holds for the operator).
async fn slt_case(setup: &Setup, query: &Query, diff: &str, origin: &str) -> String {
    let create = create_table_sql(setup, query);
    let mut out = format!(
        "# Found by the differential fuzzer ({origin}).\n# {}\n\nstatement ok\n{create}\n\n",
        diff.lines().next().unwrap_or_default(),
    );
    let ctx = context(false, 1, 64, Storage::Memory);
    if let Err(e) = run(&ctx, &create).await {
        let _ = writeln!(out, "# (the table could not be built here: {e})");
        return out;
    }
    let sql = query.sql();
    match ctx.sql(&query.oracle()).await {
        Ok(frame) => {
            let schema = frame.schema().inner().clone();
            match frame.collect().await {
                Ok(batches) => {
                    let types: String = schema
                        .fields()
                        .iter()
                        .map(|f| column_type(f.data_type()).to_char())
                        .collect();
                    let rows = format_rows(&batches).unwrap();
                    let _ = writeln!(out, "onlyif gpu_topk\nquery {types}\n{sql}\n----");
                    for row in rows {
                        let _ = writeln!(out, "{}", row.join(" "));
                    }
                }
                Err(e) => {
                    let first = e.to_string();
                    let first = first.lines().next().unwrap_or_default();
                    let _ = writeln!(out, "statement error {}\n{sql}", regex_escape(first));
                }
            }
        }
        Err(e) => {
            let _ = writeln!(out, "# (the oracle does not plan: {e})");
        }
    }
    out
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' => {
                vec!['\\', c]
            }
            c => vec![c],
        })
        .collect()
}

/// Counts of one fuzzing run.
#[derive(Debug, Default)]
struct Counts {
    queries: usize,
    taken: usize,
    tables: usize,
    /// Answers that differ from DataFusion's full sort only among rows of equal sort keys
    /// (see `check`).
    tied: usize,
    /// Queries with string, binary or wide keys.
    prefix: usize,
    /// Per-group queries, and those the per-group operator ran.
    groups: usize,
    groups_taken: usize,
    mismatches: Vec<PathBuf>,
}

/// Runs `queries` random queries from `seed`; minimises and writes every mismatch.
async fn fuzz(seed: u64, queries: usize, seconds: Option<u64>, programs: Arc<Programs>) -> Counts {
    let mut rng = Rng::new(seed);
    let mut counts = Counts::default();
    let out = std::env::var_os("GPU_TOPK_FUZZ_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("gpu-topk-fuzz"));
    let started = std::time::Instant::now();
    let out_of_time = || seconds.is_some_and(|s| started.elapsed().as_secs() >= s);
    while counts.queries < queries && !out_of_time() {
        let table_seed = rng.next_u64();
        let setup = random_setup(&mut rng, table_seed);
        let rows: usize = setup.data.iter().flatten().map(|b| b.num_rows()).sum();
        let ctx = sessions(&setup, &format!("{seed}-{}", counts.tables)).await;
        counts.tables += 1;
        for _ in 0..QUERIES_PER_TABLE.min(queries - counts.queries) {
            let query = random_query(&mut rng, rows, &programs);
            counts.queries += 1;
            counts.prefix += usize::from(prefix_keys(&query.keys));
            let found = check(&ctx, &query, &mut counts.taken, &mut counts.tied).await;
            let Some(found) = found else {
                continue;
            };
            let origin = format!("seed {seed}, query {}", counts.queries);
            // Printed before minimising, which a mismatch that does not recur cannot do.
            eprintln!("MISMATCH ({origin}): {}\n{found}", query.sql());
            let (small, small_query, diff) = minimise(setup.clone(), query).await;
            let case = slt_case(&small, &small_query, &diff, &origin).await;
            std::fs::create_dir_all(&out).unwrap();
            let path = out.join(format!("fuzz-{seed}-{}.slt", counts.queries));
            std::fs::write(&path, &case).unwrap();
            eprintln!(
                "MISMATCH ({origin}) written to {}:\n{diff}\n{case}",
                path.display()
            );
            counts.mismatches.push(path);
        }
        let mut group_rng = Rng::new(table_seed ^ 0x9e37_79b9_7f4a_7c15);
        for _ in 0..GROUP_QUERIES_PER_TABLE {
            let sql = random_group_query(&mut group_rng);
            counts.groups += 1;
            let Some(found) = group_check(&ctx, &sql, &mut counts.groups_taken).await else {
                continue;
            };
            let origin = format!("seed {seed}, table {}", counts.tables);
            std::fs::create_dir_all(&out).unwrap();
            let path = out.join(format!("fuzz-group-{seed}-{}.txt", counts.groups));
            std::fs::write(&path, format!("-- {origin}\n{found}\n")).unwrap();
            eprintln!(
                "MISMATCH ({origin}) written to {}:\n{found}",
                path.display()
            );
            counts.mismatches.push(path);
        }
        if counts.tables % 200 == 0 {
            eprintln!(
                "fuzz: {} queries ({} by the operator), {} mismatches, {:.0?}",
                counts.queries,
                counts.taken,
                counts.mismatches.len(),
                started.elapsed()
            );
        }
    }
    eprintln!(
        "fuzz (seed {seed}, backend {}): {} queries ({} with string, binary or wide keys) over \
         {} tables, {} run by the operator, {} per-group queries ({} by the operator), {} \
         mismatches, {} equal only in their key values, {:.1?}",
        test_backend(),
        counts.queries,
        counts.prefix,
        counts.tables,
        counts.taken,
        counts.groups,
        counts.groups_taken,
        counts.mismatches.len(),
        counts.tied,
        started.elapsed()
    );
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_slice_matches_datafusion() {
    let programs = Arc::new(Programs::new(program_limit(16), 0xf022));
    let counts = fuzz(0xf022, 300, None, programs).await;
    assert!(
        counts.mismatches.is_empty(),
        "mismatches: {:?}",
        counts.mismatches
    );
    assert!(
        counts.taken > 150,
        "only {} queries reached the operator",
        counts.taken
    );
    assert!(
        counts.groups_taken * 2 > counts.groups,
        "only {} of {} per-group queries reached the operator",
        counts.groups_taken,
        counts.groups
    );
}

/// The full run (see the module documentation; `GPU_TOPK_FUZZ_TASKS` runs that many sequences
/// at once, seeds `SEED + 1000 i`).
#[tokio::test(flavor = "multi_thread", worker_threads = 16)]
#[ignore]
async fn fuzz_budget() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
            .unwrap_or(default)
    };
    let queries = env("GPU_TOPK_FUZZ_QUERIES", 100_000) as usize;
    let seed = env("GPU_TOPK_FUZZ_SEED", 1);
    let seconds = std::env::var("GPU_TOPK_FUZZ_SECONDS")
        .ok()
        .map(|v| v.parse().expect("GPU_TOPK_FUZZ_SECONDS: a number"));
    // Several fuzzing tasks share one pool of programs (each compiles once) and the GPU.
    let tasks = env("GPU_TOPK_FUZZ_TASKS", 1).max(1);
    let programs = Arc::new(Programs::new(program_limit(150), seed));
    let mut running = tokio::task::JoinSet::new();
    for task in 0..tasks {
        let share = (queries as u64).div_ceil(tasks) as usize;
        running.spawn(fuzz(
            seed + 1000 * task,
            share,
            seconds,
            Arc::clone(&programs),
        ));
    }
    let (mut total, mut prefix, mut groups, mut mismatches) = (0, 0, 0, Vec::new());
    while let Some(counts) = running.join_next().await {
        let counts = counts.expect("a fuzzing task panicked");
        total += counts.queries;
        prefix += counts.prefix;
        groups += counts.groups;
        mismatches.extend(counts.mismatches);
    }
    eprintln!(
        "fuzz: {total} queries ({prefix} with string, binary or wide keys) and {groups} \
         per-group queries in {tasks} tasks, {} mismatches",
        mismatches.len()
    );
    assert!(mismatches.is_empty(), "mismatches: {mismatches:?}");
}

/// Found by the fuzzer: `WHERE -0.0 = f64` holds for 0.0 too, yet DataFusion's sorts below the
/// merge drop `round(f64, 1)` as a constant; the operator orders by the merge's (the query's)
/// keys, so −0.0 ranks before 0.0 over several partitions, as in DataFusion's merge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_filter_makes_constant_still_orders_signed_zeros() {
    let template = table(1, &[&[1], &[1]]);
    let columns = [("rid", [585i64, 863]), ("u8", [255, 8])];
    let data: Vec<Vec<RecordBatch>> = template
        .iter()
        .enumerate()
        .map(|(i, part)| {
            let schema = schema();
            let mut cols = part[0].columns().to_vec();
            for (name, values) in columns {
                let value = ScalarValue::Int64(Some(values[i]));
                let t = schema.field_with_name(name).unwrap().data_type();
                cols[schema.index_of(name).unwrap()] =
                    value.cast_to(t).unwrap().to_array_of_size(1).unwrap();
            }
            cols[schema.index_of("f64").unwrap()] = ScalarValue::Float64(Some([-0.0, 0.0][i]))
                .to_array_of_size(1)
                .unwrap();
            vec![RecordBatch::try_new(schema, cols).unwrap()]
        })
        .collect();
    let query = Query {
        select: vec!["rid".into()],
        filter: Some("-0.0 = f64".into()),
        keys: vec!["round(f64, 1)".into(), "u8 ASC NULLS FIRST".into()],
        limit: 10,
        offset: 0,
    };
    for storage in [Storage::Memory, Storage::Parquet] {
        let setup = Setup {
            data: data.clone(),
            storage,
            partitions: 2,
            batch_size: 64,
        };
        let sessions = sessions(&setup, "signed-zeros").await;
        let got = exact_rows(&run(&sessions.ours, &query.sql()).await.unwrap());
        assert_eq!(got, ["rid:Int64", "585", "863"], "{storage:?}");
        // DataFusion's own full sort may drop the key as well, depending on its plan: the
        // check accepts either, the rows above are the query's order.
        let (mut taken, mut tied) = (0, 0);
        let diff = check(&sessions, &query, &mut taken, &mut tied).await;
        assert_eq!((diff, taken), (None, 1), "{storage:?}");
    }
}

/// A sort key that fails whatever the rows (a failing constant) fails over an empty batch as
/// DataFusion's TopK does, which evaluates its keys on every batch it receives; with a filter
/// below, only the filter sees that batch. Found by the fuzzer (an in-memory table whose only
/// batch is empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_constant_key_fails_over_an_empty_batch_as_in_datafusion() {
    let setup = Setup {
        data: table(1, &[&[0]]),
        storage: Storage::Memory,
        partitions: 1,
        batch_size: 64,
    };
    let sessions = sessions(&setup, "empty-batch").await;
    for filter in [None, Some("f32 > 0".to_string())] {
        let query = Query {
            select: vec!["s".into()],
            filter: filter.clone(),
            keys: vec!["(sqrt(-2.5) + f32) DESC".into()],
            limit: 1,
            offset: 0,
        };
        let ours = run(&sessions.ours, &query.sql()).await;
        match &filter {
            None => {
                let err = ours.expect_err("a failing key").to_string();
                assert!(err.contains("square root of a negative number"), "{err}");
            }
            Some(_) => assert!(ours.unwrap().iter().all(|b| b.num_rows() == 0)),
        }
        let (mut taken, mut tied) = (0, 0);
        let diff = check(&sessions, &query, &mut taken, &mut tied).await;
        assert_eq!(diff, None, "{query:?}");
    }
}
