//! Random top-k over an aggregate (`gpu_topk.aggregate_topk`) against plain DataFusion.
//!
//! Random tables: up to 3000 rows (none at times) over one to four partitions of batches of
//! random sizes, over every storage; an `Int64` key `g` of one value to about one a row,
//! further keys of each type the rule takes (`Int64`, `Timestamp(Microsecond)`, `Int32`,
//! `Utf8`, `Date32`), NULLs, `Int64` values at times near the ends of the type (their sums
//! wrap, as DataFusion's do), and `Float64` quarters (every sum exact in any order) with NaN.
//! Random queries: one or two keys (computed ones and a string expression among them), `COUNT(*)`, `COUNT`, `SUM`,
//! `MIN`, `MAX`, `AVG` (of columns and of expressions) and `COUNT(DISTINCT …)`, an order by
//! an aggregate then the keys (a total order) or by the aggregate alone, `LIMIT` beyond the
//! groups, `OFFSET`, `WHERE` and `HAVING` (some failing on a row or group), computed and
//! reordered output columns.
//!
//! Each answer must be DataFusion's: the same rows in the same order under a total order;
//! where the order leaves ties, the same values of the order key in order, each row one of
//! DataFusion's groups; an error where DataFusion fails. Every query whose shape the rule
//! takes must be taken; with `GPU_TOPK_TEST_BACKEND=cuda` on a GPU each one planned on the
//! device must run there (but where the device declines a NaN met by a float `MIN`/`MAX`).

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::physical_plan::{ExecutionPlan, collect};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::{AggregateBackend, Backend, GpuAggregateTopKExec};

use crate::common::{
    Rng, STORAGES, Storage, exact_rows, partitioned, physical_plan, plain_session, plan_text,
    register_as, run, session_with, test_backend, test_dir,
};
use crate::sessions::test_config;

/// What a random table is made of.
#[derive(Debug, Clone, Copy)]
struct Shape {
    seed: u64,
    rows: usize,
    partitions: usize,
    /// Distinct values of `g`.
    groups: u64,
    /// Distinct values of `h`.
    few: u64,
    /// Chance of a NULL in each nullable column.
    nulls: f64,
    /// `w` near `i64::MIN` and `i64::MAX` at times (its sums wrap), else small.
    huge: bool,
    /// Chance of a NaN in `f`.
    nan: f64,
}

impl Shape {
    fn random(rng: &mut Rng) -> Self {
        let rows = match rng.below(10) {
            0 => 0,
            1 => 1 + rng.below(5) as usize,
            _ => 1 + rng.below(3000) as usize,
        };
        let groups = match rng.below(5) {
            0 => 1,
            1 => 2 + rng.below(10),
            2 => 1 + rng.below(200),
            3 => rows.max(1) as u64,
            _ => 1 + rng.below(rows.max(1) as u64),
        };
        Shape {
            seed: rng.next_u64(),
            rows,
            partitions: 1 + rng.below(4) as usize,
            groups,
            few: 1 + rng.below(8),
            nulls: [0.0, 0.03, 0.2, 0.9][rng.below(4) as usize],
            huge: rng.chance(0.35),
            nan: [0.0, 0.0, 0.0, 0.01, 0.1][rng.below(5) as usize],
        }
    }

    /// Batch sizes of each partition (each has one batch at least, empty where it has no
    /// rows): the rows split at random, then cut into batches of random sizes.
    fn batch_sizes(&self, rng: &mut Rng) -> Vec<Vec<usize>> {
        let mut left = self.rows;
        (0..self.partitions)
            .map(|p| {
                let mut rows = match p + 1 == self.partitions {
                    true => left,
                    false => rng.below(left as u64 + 1) as usize,
                };
                left -= rows;
                let mut sizes = vec![];
                while rows > 0 || sizes.is_empty() {
                    let n = if rng.chance(0.05) {
                        0
                    } else {
                        (1 + rng.below(300) as usize).min(rows)
                    };
                    sizes.push(n);
                    rows -= n;
                }
                sizes
            })
            .collect()
    }
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Int64, true),
        Field::new("h", DataType::Int64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("i", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("d", DataType::Date32, true),
        Field::new("v", DataType::Int64, true),
        Field::new("w", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
    ]))
}

/// The table `t` of `shape`: a unique `id` (input position); keys `g` (`shape.groups`
/// values), `h` (`shape.few`), `ts` (24 hours), `i` (30), `s` (8 strings), `d` (15 days);
/// values `v` (small), `w` (small or near the ends of Int64) and `f` (quarters, some NaN).
fn table(shape: &Shape) -> Vec<Vec<RecordBatch>> {
    let schema = schema();
    let mut rng = Rng::new(shape.seed);
    let sizes = shape.batch_sizes(&mut rng);
    let sizes: Vec<&[usize]> = sizes.iter().map(Vec::as_slice).collect();
    let s = *shape;
    partitioned(shape.seed, &sizes, |rng: &mut Rng, first, rows| {
        let mut draw = |below: u64, base: i64| -> Vec<Option<i64>> {
            (0..rows)
                .map(|_| (!rng.chance(s.nulls)).then(|| base + rng.below(below) as i64))
                .collect()
        };
        let g = draw(s.groups, -(s.groups as i64 / 3));
        let h = draw(s.few, 0);
        let ts: Vec<Option<i64>> = (draw(24, 0).into_iter())
            .map(|x| x.map(|x| 1_600_000_000_000_000 + x * 3_600_000_000))
            .collect();
        let i: Vec<Option<i32>> = (draw(30, -10).into_iter())
            .map(|x| x.map(|x| x as i32))
            .collect();
        let strings = ["", "a", "b", "en", "es", "日本", "zz", "ab"];
        let text: Vec<Option<&str>> = (draw(8, 0).into_iter())
            .map(|x| x.map(|x| strings[x as usize]))
            .collect();
        let d: Vec<Option<i32>> = (draw(15, 18000).into_iter())
            .map(|x| x.map(|x| x as i32))
            .collect();
        let v = draw(41, -20);
        let w: Vec<Option<i64>> = (draw(2001, -1000).into_iter())
            .map(|x| {
                x.map(|x| match (s.huge, x.rem_euclid(3)) {
                    (true, 0) => i64::MAX - x.abs(),
                    (true, 1) => i64::MIN + x.abs(),
                    _ => x,
                })
            })
            .collect();
        let f: Vec<Option<f64>> = (draw(401, -200).into_iter())
            .map(|x| {
                x.map(|x| {
                    if rng.chance(s.nan) {
                        f64::NAN
                    } else {
                        x as f64 / 4.0
                    }
                })
            })
            .collect();
        let columns: Vec<Arc<dyn Array>> = vec![
            Arc::new(Int64Array::from_iter_values(first..first + rows as i64)),
            Arc::new(Int64Array::from(g)),
            Arc::new(Int64Array::from(h)),
            Arc::new(TimestampMicrosecondArray::from(ts)),
            Arc::new(Int32Array::from(i)),
            Arc::new(StringArray::from(text)),
            Arc::new(Date32Array::from(d)),
            Arc::new(Int64Array::from(v)),
            Arc::new(Int64Array::from(w)),
            Arc::new(Float64Array::from(f)),
        ];
        RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
    })
}

/// One random query: its text up to `LIMIT`, the window, and what the comparison needs.
#[derive(Debug, Clone)]
struct Query {
    body: String,
    limit: usize,
    offset: usize,
    /// Where the order leaves ties: the output column of the order's one key.
    tied_column: Option<usize>,
    /// Whether the rule takes the shape (see [`rule_takes`]).
    takes: bool,
    /// Whether the query computes a float `MIN` or `MAX` (whose result over a NaN depends on
    /// the rows' order in DataFusion, and which the device declines).
    float_extreme: bool,
}

impl Query {
    fn sql(&self) -> String {
        match self.offset {
            0 => format!("{} LIMIT {}", self.body, self.limit),
            m => format!("{} LIMIT {} OFFSET {m}", self.body, self.limit),
        }
    }
}

/// The keys: the device's first (every one but the string expression), computed ones among
/// them.
const KEYS: [&str; 11] = [
    "g", "g", "g", "h", "ts", "id", "i", "d", "g % 5", "s", "upper(s)",
];
const DEVICE_KEYS: usize = 10;

/// The aggregates: the device's first ([`DEVICE_AGGREGATES`] of them, but over `s` other than
/// `COUNT(s)`).
const AGGREGATES: [&str; 29] = [
    "COUNT(*)",
    "COUNT(v)",
    "COUNT(w)",
    "COUNT(f)",
    "COUNT(s)",
    "SUM(v)",
    "SUM(w)",
    "SUM(f)",
    "MIN(v)",
    "MIN(w)",
    "MIN(f)",
    "MIN(s)",
    "MIN(d)",
    "MAX(v)",
    "MAX(w)",
    "MAX(f)",
    "MAX(ts)",
    "AVG(v)",
    "AVG(f)",
    "SUM(i)",
    "MIN(i)",
    "MAX(i)",
    "AVG(i)",
    "SUM(v * 2)",
    "MAX(length(s))",
    "COUNT(DISTINCT v)",
    "COUNT(DISTINCT s)",
    "COUNT(DISTINCT f)",
    "COUNT(DISTINCT h)",
];
const DEVICE_AGGREGATES: usize = 25;

const FILTERS: [&str; 8] = [
    "v > 3",
    "id % 3 <> 0",
    "f < 5",
    "s <> 'es'",
    "g IS NOT NULL",
    "w > 0",
    "h < 3 AND v IS NOT NULL",
    // Fails where a row has v = 7: DataFusion's error.
    "100 / (v - 7) > 0",
];

const HAVINGS: [&str; 6] = [
    "COUNT(*) > 2",
    "SUM(v) > 0",
    "SUM(f) < 10",
    "MIN(v) IS NOT NULL",
    "COUNT(DISTINCT v) > 1",
    // Fails where a group has one row.
    "MAX(v) / (COUNT(*) - 1) >= 0",
];

fn pick<'a>(rng: &mut Rng, items: &[&'a str]) -> &'a str {
    items[rng.below(items.len() as u64) as usize]
}

/// `aggregate` in the output: itself, or at times an expression of it that cannot overflow.
fn output_of(rng: &mut Rng, aggregate: &str) -> String {
    let forms: &[&str] = if aggregate.starts_with("COUNT") {
        &["{} * 2", "{} + 1", "{} - 5"]
    } else if aggregate.ends_with("(v)") && !aggregate.starts_with("AVG") {
        &["{} * 2", "{} + 1"]
    } else if aggregate.ends_with("(f)") || aggregate.starts_with("AVG") {
        &["{} * 2", "-{}", "{} + 0.5"]
    } else {
        &[]
    };
    if forms.is_empty() || rng.chance(0.75) {
        return aggregate.to_string();
    }
    pick(rng, forms).replace("{}", aggregate)
}

/// Whether the rule takes a query of these aggregates (over the select list, `HAVING` and
/// the order): DataFusion plans one column's `COUNT(DISTINCT …)` beside only `SUM`, `MIN` and
/// `MAX` as an aggregation over another with aggregates of its own, which the rule declines.
fn rule_takes(aggregates: &[&str]) -> bool {
    let mut distinct: Vec<&str> = (aggregates.iter())
        .filter(|a| a.contains("DISTINCT"))
        .copied()
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    let others: Vec<&&str> = aggregates
        .iter()
        .filter(|a| !a.contains("DISTINCT"))
        .collect();
    let beside = |a: &&&str| ["SUM(", "MIN(", "MAX("].iter().any(|f| a.starts_with(f));
    !(distinct.len() == 1 && !others.is_empty() && others.iter().all(beside))
}

/// A random query of `t` (see the module documentation). Most are of the shapes the device
/// path takes (over an in-memory table or `GpuTable`): integer, date and timestamp keys, as
/// columns or computed, plain string columns, its aggregates, no `WHERE` or `HAVING`, ties ordered by the keys
/// ascending or not at all.
fn random_query(rng: &mut Rng) -> Query {
    let device = rng.chance(0.6);
    let (keys, aggregates) = keys_and_aggregates(rng, device);
    // The select list: keys (at times left out) and aggregates `a0`, `a1`, … (at times as an
    // expression of the aggregate), at times an extra column, at times shuffled.
    let mut select: Vec<String> = (keys.iter())
        .filter(|_| !rng.chance(0.1))
        .map(|k| k.to_string())
        .collect();
    let by = rng.below(aggregates.len() as u64) as usize;
    let mut outputs = vec![];
    for (i, a) in aggregates.iter().enumerate() {
        let output = match device && i == by && rng.chance(0.85) {
            true => a.to_string(),
            false => output_of(rng, a),
        };
        outputs.push(output.clone());
        select.push(format!("{output} AS a{i}"));
    }
    let mut all = aggregates.clone();
    if rng.chance(0.15) {
        select.push("COUNT(*) * 2 AS e".to_string());
        all.push("COUNT(*)");
    }
    if rng.chance(0.3) {
        for i in (1..select.len()).rev() {
            select.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    let filter = match !device && rng.chance(0.4) {
        true => format!(" WHERE {}", pick(rng, &FILTERS)),
        false => String::new(),
    };
    let having = match !device && rng.chance(0.3) {
        true => {
            let h = pick(rng, &HAVINGS);
            all.extend(AGGREGATES.iter().filter(|a| h.contains(*a)));
            format!(" HAVING {h}")
        }
        false => String::new(),
    };
    let alias = format!("a{by}");
    let tied_column = select
        .iter()
        .position(|c| c.ends_with(&format!(" AS {alias}")));
    // By the alias, or by the aggregate itself where the output is the aggregate.
    let first = match outputs[by] == aggregates[by] && rng.chance(0.2) {
        true => aggregates[by].to_string(),
        false => alias,
    };
    let mut order = vec![format!("{first}{}", direction(rng))];
    let mut total = rng.chance(0.8);
    if total {
        let (ties, all_keys) = tie_order(rng, &keys, device);
        order.extend(ties);
        total = all_keys;
    }
    let body = format!(
        "SELECT {} FROM t{filter} GROUP BY {}{having} ORDER BY {}",
        select.join(", "),
        keys.join(", "),
        order.join(", ")
    );
    let limit = match rng.below(4) {
        0 => 1,
        1 => 1 + rng.below(50) as usize,
        2 => 1 + rng.below(10) as usize,
        _ => 1000 + rng.below(4000) as usize,
    };
    Query {
        body,
        limit,
        offset: if rng.chance(0.3) {
            1 + rng.below(20) as usize
        } else {
            0
        },
        tied_column: if total { None } else { tied_column },
        takes: rule_takes(&all),
        float_extreme: all.iter().any(|a| *a == "MIN(f)" || *a == "MAX(f)"),
    }
}

/// One or two group keys and one to three aggregates (of the device's shapes where `device`).
fn keys_and_aggregates(rng: &mut Rng, device: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let (key_set, aggregate_set): (&[&str], &[&str]) = match device {
        true => (&KEYS[..DEVICE_KEYS], &AGGREGATES[..DEVICE_AGGREGATES]),
        false => (&KEYS, &AGGREGATES),
    };
    let mut keys = vec![pick(rng, key_set)];
    if rng.chance(0.35) {
        let other = pick(rng, key_set);
        if other != keys[0] {
            keys.push(other);
        }
    }
    let mut aggregates: Vec<&str> = vec![];
    let count = 1 + rng.below(3) as usize;
    while aggregates.len() < count {
        let a = pick(rng, aggregate_set);
        let device_takes = !a.ends_with("(s)") || a == "COUNT(s)";
        // A count of a key's distinct values is one a group: a different plan.
        let distinct_key =
            a.contains("DISTINCT") && keys.iter().any(|k| a.ends_with(&format!(" {k})")));
        if !distinct_key && (device_takes || !device) {
            aggregates.push(a);
        }
    }
    (keys, aggregates)
}

/// The order among groups of equal values of the first sort key: the keys, ascending with
/// NULLs last in key order (the device's order), a prefix of that, or another order; and
/// whether it names every key (the order is total).
fn tie_order(rng: &mut Rng, keys: &[&str], device: bool) -> (Vec<String>, bool) {
    if device || rng.chance(0.5) {
        let spelled = [" ASC NULLS LAST", " ASC", " NULLS LAST", ""];
        let mut ties: Vec<String> = (keys.iter())
            .map(|k| format!("{k}{}", pick(rng, &spelled)))
            .collect();
        if ties.len() > 1 && rng.chance(0.2) {
            ties.pop();
            return (ties, false);
        }
        return (ties, true);
    }
    let mut ties: Vec<String> = (keys.iter())
        .map(|k| format!("{k}{}", direction(rng)))
        .collect();
    if rng.chance(0.5) {
        ties.reverse();
    }
    (ties, true)
}

/// A random direction and NULL placement of a sort key (either at times the default).
fn direction(rng: &mut Rng) -> String {
    let asc = pick(rng, &["", " ASC", " DESC"]);
    let nulls = pick(rng, &["", " NULLS FIRST", " NULLS LAST"]);
    format!("{asc}{nulls}")
}

/// Rows as [`exact_rows`] writes them, but a NaN by its sign alone: its payload is not
/// specified (IEEE 754), and a sum met by a NaN may carry another than DataFusion's.
fn normal(rows: Vec<String>) -> Vec<String> {
    let cell = |c: &str| -> String {
        match c
            .strip_prefix("NaN#")
            .map(|bits| u64::from_str_radix(bits, 16))
        {
            Some(Ok(bits)) if bits >> 63 == 1 => "-NaN".to_string(),
            Some(Ok(_)) => "NaN".to_string(),
            _ => c.to_string(),
        }
    };
    (rows.into_iter())
        .map(|r| r.split(" | ").map(cell).collect::<Vec<_>>().join(" | "))
        .collect()
}

type Outcome = std::result::Result<Vec<String>, String>;

/// What running a query with the operator gave.
struct Ours {
    outcome: Outcome,
    taken: bool,
    /// Planned on the device (`backend=cuda`) ...
    planned: bool,
    /// ... and answered by DataFusion's plan after all.
    fell_back: bool,
    plan: String,
}

fn operator(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuAggregateTopKExec> {
    if let Some(exec) = plan.downcast_ref::<GpuAggregateTopKExec>() {
        return Some(exec);
    }
    plan.children().into_iter().find_map(operator)
}

async fn run_ours(ctx: &SessionContext, sql: &str) -> Ours {
    let plan = match physical_plan(ctx, sql).await {
        Ok(plan) => plan,
        Err(e) => {
            return Ours {
                outcome: Err(e.to_string()),
                taken: false,
                planned: false,
                fell_back: false,
                plan: String::new(),
            };
        }
    };
    let outcome = (collect(Arc::clone(&plan), ctx.task_ctx()).await)
        .map(|b| normal(exact_rows(&b)))
        .map_err(|e| e.to_string());
    let exec = operator(&plan);
    let fallbacks = (exec.and_then(|e| e.metrics()))
        .and_then(|m| m.sum_by_name("gpu_fallbacks"))
        .map_or(0, |v| v.as_usize());
    Ours {
        outcome,
        taken: exec.is_some(),
        planned: exec.is_some_and(|e| matches!(e.backend(), AggregateBackend::Cuda(_))),
        fell_back: fallbacks > 0,
        plan: plan_text(&plan),
    }
}

/// How `ours` differs from DataFusion's answer to `query` (`plain`), if it does: the full
/// sort of every group by DataFusion, windowed by the query's `LIMIT` and `OFFSET`. Under a
/// total order, the same rows; where the order leaves ties, the same order-key values, each
/// row one of DataFusion's; an error where DataFusion fails. Where `loose`, only the columns
/// and the number of rows.
async fn difference(
    plain: &SessionContext,
    query: &Query,
    ours: &Outcome,
    loose: bool,
) -> Option<String> {
    let full = run(plain, &query.body)
        .await
        .map(|b| normal(exact_rows(&b)))
        .map_err(|e| e.to_string());
    let (ours, full) = match (ours, full) {
        (Ok(ours), Ok(full)) => (ours, full),
        (Err(_), Err(_)) => return None,
        (ours, full) => return Some(format!("ours: {ours:?}\nDataFusion's: {full:?}")),
    };
    let body: Vec<&String> = (full.iter().skip(1).skip(query.offset))
        .take(query.limit)
        .collect();
    let want: Vec<&String> = match body.is_empty() {
        true => body,
        false => full.iter().take(1).chain(body).collect(),
    };
    let differs = || Some(format!("ours: {ours:#?}\nDataFusion's: {want:#?}"));
    if loose {
        let same = ours.len() == want.len() && ours.first() == want.first().copied();
        return (!same).then(differs).flatten();
    }
    let Some(column) = query.tied_column else {
        return (ours.iter().ne(want.iter().copied()))
            .then(differs)
            .flatten();
    };
    let cell = |row: &String| row.split(" | ").nth(column).map(str::to_string);
    let values = |rows: &mut dyn Iterator<Item = &String>| -> Vec<Option<String>> {
        rows.skip(1).map(cell).collect()
    };
    if ours.first() != want.first().copied()
        || values(&mut ours.iter()) != values(&mut want.iter().copied())
    {
        return differs();
    }
    let mut groups: HashMap<&String, usize> = HashMap::new();
    for row in full.iter().skip(1) {
        *groups.entry(row).or_default() += 1;
    }
    for row in ours.iter().skip(1) {
        match groups.get_mut(row) {
            Some(n) if *n > 0 => *n -= 1,
            _ => return Some(format!("{row} is no group of DataFusion's\n{}", differs()?)),
        }
    }
    None
}

/// The tallies of a run.
#[derive(Debug, Default)]
struct Counts {
    done: usize,
    taken: usize,
    /// Of the shapes the rule declines (as it should).
    declined: usize,
    planned: usize,
    on_device: usize,
    /// Compared by the order key's values (the order left ties).
    tied: usize,
    /// Where DataFusion and the operator both failed.
    errors: usize,
    /// Compared in shape only (a float MIN or MAX over a NaN).
    loose: usize,
}

/// A session with the operator, `gpu_topk.aggregate_topk` on, on the test backend.
fn aggregate_session(partitions: usize, batch_size: usize) -> SessionContext {
    let mut config = test_config(true);
    config.aggregate_topk = true;
    session_with(partitions, batch_size, config)
}

/// The sessions of one table: with the operator and plain DataFusion.
struct Sessions {
    ours: SessionContext,
    plain: SessionContext,
    shape: Shape,
    storage: Storage,
    /// Whether the operator runs on a GPU where it plans the device.
    device: bool,
}

impl Sessions {
    /// `shape`'s table stored as `storage` (its files under `dir`) in both sessions.
    async fn new(rng: &mut Rng, shape: Shape, storage: Storage, dir: &std::path::Path) -> Self {
        let data = table(&shape);
        let ours = aggregate_session(shape.partitions, 8 + rng.below(300) as usize);
        let plain = plain_session(shape.partitions, storage);
        // A directory of each table's own: files are written once per name and directory.
        let dir = dir.join(shape.seed.to_string());
        for ctx in [&ours, &plain] {
            register_as(ctx, "t", &data, storage, &dir).await;
        }
        let device = test_backend() == Backend::Cuda
            && datafusion_gpu_topk::internal::device::gpu().is_some();
        if device {
            // A fallback's warning says why the device failed.
            crate::common::capture_warnings();
        }
        Self {
            ours,
            plain,
            shape,
            storage,
            device,
        }
    }

    /// Checks `query` (see the module documentation), panicking with it, the table and both
    /// answers on a difference.
    async fn check(&self, query: &Query, counts: &mut Counts) {
        let sql = query.sql();
        let context = || {
            format!(
                "{sql}
table {:?} as {:?}",
                self.shape, self.storage
            )
        };
        let got = run_ours(&self.ours, &sql).await;
        // DataFusion's float MIN and MAX over a NaN depend on the rows' order (its batches,
        // which partition's states merge first): the answers agree in shape only.
        let loose = query.float_extreme && self.shape.nan > 0.0;
        if let Some(diff) = difference(&self.plain, query, &got.outcome, loose).await {
            panic!("{}\n{diff}\n{}", context(), got.plan);
        }
        assert!(
            got.taken || !query.takes,
            "not taken by the operator: {}\n{}",
            context(),
            got.plan
        );
        // The device declines a NaN met by a float MIN or MAX, and a row of the filter or a
        // group of HAVING that DataFusion fails on (its error is the answer); nothing else
        // falls back.
        if self.device && got.planned && got.fell_back && !loose && got.outcome.is_ok() {
            let warnings = crate::common::logged_warnings();
            let last = &warnings[warnings.len().saturating_sub(3)..];
            panic!(
                "the device fell back: {}\nlast warnings: {last:#?}\n{}",
                context(),
                got.plan
            );
        }
        counts.done += 1;
        counts.taken += usize::from(got.taken);
        counts.declined += usize::from(!query.takes && !got.taken);
        counts.planned += usize::from(got.planned);
        counts.on_device += usize::from(got.planned && !got.fell_back && got.outcome.is_ok());
        counts.tied += usize::from(query.tied_column.is_some());
        counts.errors += usize::from(got.outcome.is_err());
        counts.loose += usize::from(loose);
    }
}

/// Random tables over every storage and random queries of each (see the module
/// documentation). `GPU_TOPK_AGG_QUERIES` sets how many queries (default 150),
/// `GPU_TOPK_AGG_SEED` the seed (so that processes in parallel draw different queries).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_aggregate_queries_match_datafusion() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let queries = env("GPU_TOPK_AGG_QUERIES").unwrap_or(150) as usize;
    let seed = env("GPU_TOPK_AGG_SEED").unwrap_or(0xbb67_ae85);
    let dir = test_dir(&format!("aggregate-random-{seed}"));
    let mut rng = Rng::new(seed);
    let mut counts = Counts::default();
    while counts.done < queries {
        let shape = Shape::random(&mut rng);
        let storage = STORAGES[rng.below(STORAGES.len() as u64) as usize];
        let batch = (queries - counts.done).min(1 + rng.below(15) as usize);
        let sessions = Sessions::new(&mut rng, shape, storage, &dir).await;
        for _ in 0..batch {
            sessions.check(&random_query(&mut rng), &mut counts).await;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    report(&counts, "random");
}

fn report(counts: &Counts, what: &str) {
    let Counts {
        done,
        taken,
        on_device,
        ..
    } = counts;
    eprintln!(
        "{taken} of {done} {what} aggregate top-k queries taken by the operator, {on_device} on the GPU"
    );
    eprintln!("{counts:?}");
    assert_eq!(
        counts.taken + counts.declined,
        counts.done,
        "every query the rule takes is taken"
    );
}

/// The edges, each over every storage with the same random queries: no rows, one row, one
/// group, a group per row, keys all NULL, and `w` near the ends of Int64, whose sums wrap in
/// DataFusion (its `SUM` of Int64 adds wrapping) and must wrap alike with the operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn edge_tables_match_datafusion() {
    let dir = test_dir("aggregate-edges");
    let shape = |seed, rows, groups, nulls, huge| Shape {
        seed,
        rows,
        partitions: 3,
        groups,
        few: 4,
        nulls,
        huge,
        nan: if seed % 2 == 0 { 0.02 } else { 0.0 },
    };
    let shapes = [
        shape(1, 0, 1, 0.1, false),
        shape(2, 1, 1, 0.0, true),
        shape(3, 700, 1, 0.0, false),
        shape(4, 900, 900 * 900, 0.05, true),
        shape(5, 500, 30, 1.0, false),
        shape(6, 2000, 40, 0.03, true),
    ];
    let mut counts = Counts::default();
    let mut rng = Rng::new(0x3c6e_f372);
    for shape in shapes {
        for storage in STORAGES {
            let sessions = Sessions::new(&mut rng, shape, storage, &dir).await;
            let mut queries = Rng::new(shape.seed);
            for _ in 0..8 {
                sessions
                    .check(&random_query(&mut queries), &mut counts)
                    .await;
            }
            if shape.huge && shape.rows > 1 {
                sums_wrap(&sessions, &mut counts).await;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    report(&counts, "edge");
}

/// Over a table of `w` near the ends of Int64: some group's `SUM(w)` overflows, and both
/// answers are the sums wrapped to 64 bits.
async fn sums_wrap(sessions: &Sessions, counts: &mut Counts) {
    let query = Query {
        body: "SELECT h, SUM(w) AS a0 FROM t GROUP BY h ORDER BY a0 DESC, h".to_string(),
        limit: 20,
        offset: 0,
        tied_column: None,
        takes: true,
        float_extreme: false,
    };
    sessions.check(&query, counts).await;
    let mut sums: HashMap<Option<i64>, Option<i128>> = HashMap::new();
    for batch in table(&sessions.shape).iter().flatten() {
        let column = |name: &str| -> Int64Array {
            let c = batch.column_by_name(name).unwrap();
            c.as_any().downcast_ref::<Int64Array>().unwrap().clone()
        };
        for (h, w) in column("h").iter().zip(column("w").iter()) {
            let sum = sums.entry(h).or_default();
            if let Some(w) = w {
                *sum = Some(sum.unwrap_or(0) + i128::from(w));
            }
        }
    }
    let overflows = |s: &Option<i128>| s.is_some_and(|s| i64::try_from(s).is_err());
    assert!(sums.values().any(overflows), "no sum overflows: {sums:?}");
    let got = run_ours(&sessions.ours, &query.sql()).await;
    let rows = got.outcome.expect("SUM(w)");
    let mut want: Vec<(Option<i64>, Option<i64>)> = (sums.into_iter())
        .map(|(h, s)| (h, s.map(|s| s as i64)))
        .collect();
    // DESC puts NULL first; then the keys ascending, NULL last.
    want.sort_by(|a, b| {
        let by_sum = match (a.1, b.1) {
            (None, None) => std::cmp::Ordering::Equal,
            (None, _) => std::cmp::Ordering::Less,
            (_, None) => std::cmp::Ordering::Greater,
            (Some(x), Some(y)) => y.cmp(&x),
        };
        let key = |k: Option<i64>| (k.is_none(), k);
        by_sum.then(key(a.0).cmp(&key(b.0)))
    });
    let text = |x: Option<i64>| x.map_or("NULL".to_string(), |x| x.to_string());
    let want: Vec<String> = (want.iter().take(query.limit))
        .map(|(h, s)| format!("{} | {}", text(*h), text(*s)))
        .collect();
    assert_eq!(rows[1..], want[..], "{}", query.sql());
}
