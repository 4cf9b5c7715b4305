//! The device path's translation and output without a GPU: the host reference of the device's
//! aggregation ([`aggregate_top_k_host`]) in its place, over the columns the plan reads (the
//! rows the spec's filter passes, as the filter's program gives the device), builds the
//! operator's output, which must be DataFusion's.

use datafusion::arrow::array::{
    Array, AsArray, Date32Array, Int16Array, Int32Array, Int64Array, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{Float64Type, Int64Type, TimeUnit};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};

use super::*;
use crate::SessionStateBuilderExt;
use crate::config::{Backend, GpuTopKConfig};
use crate::device::{HostColumn, aggregate_top_k_host};
use crate::exec::{AggregateBackend, GpuAggregateTopKExec};

/// Three partitions of `t`: keys `a` (60 values), `b` (5) and `ts`, values `v`, `w` (mostly
/// NULL) and `f` (quarters), each with NULLs.
fn table() -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int64, true),
        Field::new("b", DataType::Int64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("v", DataType::Int64, true),
        Field::new("w", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
        Field::new("g", DataType::Int32, true),
        Field::new("h", DataType::Int16, true),
        Field::new("d", DataType::Date32, true),
        Field::new("u", DataType::Utf8, true),
    ]));
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut draw = move |null: u64, below: u64| -> Option<i64> {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 100 >= null).then(|| ((state >> 8) % below) as i64)
    };
    (0..3)
        .map(|p| {
            let rows = 700 + 300 * p;
            let mut column = |null, below, base| -> Vec<Option<i64>> {
                (0..rows)
                    .map(|_| draw(null, below).map(|x| x + base))
                    .collect()
            };
            let (a, b) = (column(3, 60, -30), column(10, 5, 0));
            let ts = column(5, 12, 1_600_000_000_000_000);
            let (v, w) = (column(5, 21, -10), column(80, 100, -50));
            let f: Vec<Option<f64>> = (column(5, 80, 0).into_iter())
                .map(|x| x.map(|x| x as f64 / 4.0))
                .collect();
            let g: Vec<Option<i32>> = (column(4, 9, -4).into_iter())
                .map(|x| x.map(|x| x as i32))
                .collect();
            let h: Vec<Option<i16>> = (column(6, 30_000, -15_000).into_iter())
                .map(|x| x.map(|x| x as i16))
                .collect();
            let d: Vec<Option<i32>> = (column(3, 15, 19_000).into_iter())
                .map(|x| x.map(|x| x as i32))
                .collect();
            let u: Vec<Option<String>> = (column(7, 40, 0).into_iter())
                .map(|x| x.map(|x| "é".repeat(x as usize % 5) + &"x".repeat(x as usize / 5)))
                .collect();
            let columns: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from(a)),
                Arc::new(Int64Array::from(b)),
                Arc::new(TimestampMicrosecondArray::from(ts)),
                Arc::new(Int64Array::from(v)),
                Arc::new(Int64Array::from(w)),
                Arc::new(Float64Array::from(f)),
                Arc::new(Int32Array::from(g)),
                Arc::new(Int16Array::from(h)),
                Arc::new(Date32Array::from(d)),
                Arc::new(StringArray::from(u)),
            ];
            vec![RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()]
        })
        .collect()
}

fn context(config: Option<GpuTopKConfig>) -> SessionContext {
    let session = SessionConfig::new().with_target_partitions(3);
    let builder = SessionStateBuilder::new()
        .with_config(session)
        .with_default_features();
    let builder = match config {
        Some(config) => builder.with_gpu_topk(config),
        None => builder,
    };
    let ctx = SessionContext::new_with_state(builder.build());
    let data = table();
    let table = MemTable::try_new(data[0][0].schema(), data).unwrap();
    ctx.register_table("t", Arc::new(table)).unwrap();
    ctx
}

fn operator(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuAggregateTopKExec> {
    if let Some(exec) = plan.downcast_ref::<GpuAggregateTopKExec>() {
        return Some(exec);
    }
    plan.children().into_iter().find_map(operator)
}

/// A reference's view of `columns`.
fn host(columns: &[(Vec<u64>, Vec<bool>)]) -> Vec<HostColumn<'_>> {
    (columns.iter())
        .map(|(values, valid)| HostColumn {
            values,
            valid: Some(valid),
        })
        .collect()
}

/// The items of `all` whose row passes.
fn kept<T>(all: Vec<T>, passes: &[bool]) -> Vec<T> {
    (all.into_iter().zip(passes))
        .filter(|(_, p)| **p)
        .map(|(x, _)| x)
        .collect()
}

/// The host reference's best groups over the columns `plan` reads of the spec's table, in
/// the rows its filter passes, and the group keys' dictionaries (a string key's codes'
/// dictionary, as the device path's upload interns them).
fn host_top(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
) -> (Vec<AggregateGroup>, Vec<Option<ArrayRef>>) {
    let memory = memory_input(&spec.table).unwrap();
    let mut passes = Vec::new();
    for batch in memory.batches() {
        let batch = batch.project(&memory.columns).unwrap();
        match &spec.filter {
            Some(filter) => {
                let verdict = filter.evaluate(&batch).unwrap();
                let verdict = verdict.into_array(batch.num_rows()).unwrap();
                passes.extend(verdict.as_boolean().iter().map(|p| p == Some(true)));
            }
            None => passes.extend(std::iter::repeat_n(true, batch.num_rows())),
        }
    }
    // A column's or a computed expression's values as the device holds them: f64 bits, or
    // the i64 of an integer or date.
    let column = |of: &dyn Fn(&RecordBatch) -> ArrayRef| -> (Vec<u64>, Vec<bool>) {
        let (mut values, mut valid) = (Vec::new(), Vec::new());
        for batch in memory.batches() {
            let array = of(&batch.project(&memory.columns).unwrap());
            match array.data_type() {
                DataType::Float64 | DataType::Float32 => (cast(&array, &DataType::Float64)
                    .unwrap())
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .for_each(|v| values.push(v.to_bits())),
                _ => {
                    let array = match array.data_type() {
                        DataType::Date32 => cast(&array, &DataType::Int32).unwrap(),
                        _ => array.clone(),
                    };
                    (cast(&array, &DataType::Int64).unwrap())
                        .as_primitive::<Int64Type>()
                        .values()
                        .iter()
                        .for_each(|&v| values.push(v as u64))
                }
            }
            valid.extend((0..array.len()).map(|i| array.is_valid(i)));
        }
        (kept(values, &passes), kept(valid, &passes))
    };
    let evaluated = |exprs: Vec<Arc<dyn PhysicalExpr>>| -> Vec<(Vec<u64>, Vec<bool>)> {
        (exprs.iter())
            .map(|e| column(&|b| e.evaluate(b).unwrap().into_array(b.num_rows()).unwrap()))
            .collect()
    };
    let mut dictionaries = vec![None; spec.group_keys.len()];
    let (keys, values) = match &plan.computed {
        Some(computed) => {
            let mut keys = Vec::new();
            for (j, key) in spec.group_keys.iter().enumerate() {
                if !is_device_string(&key.data_type) {
                    keys.extend(evaluated(vec![Arc::clone(&key.expr)]));
                    continue;
                }
                let c = plain_column(&key.expr).expect("a string key is a column");
                let chunks: Vec<ArrayRef> = (memory.batches())
                    .map(|b| Arc::clone(b.project(&memory.columns).unwrap().column(c)))
                    .collect();
                let interned = codes::intern(&chunks).unwrap();
                let valid: Vec<bool> = (chunks.iter())
                    .flat_map(|a| (0..a.len()).map(|i| a.is_valid(i)).collect::<Vec<_>>())
                    .collect();
                let codes = interned.codes.iter().map(|&c| c as u64).collect();
                keys.push((kept(codes, &passes), kept(valid, &passes)));
                dictionaries[j] = Some(interned.dictionary);
            }
            (keys, evaluated(computed.values.clone()))
        }
        None => {
            let read = |columns: &[usize]| {
                (columns.iter())
                    .map(|&c| column(&|b| Arc::clone(b.column(c))))
                    .collect::<Vec<_>>()
            };
            (read(&plan.keys), read(&plan.values))
        }
    };
    // With HAVING, every group in order, then those it passes.
    let k = match spec.having {
        Some(_) => passes.len(),
        None => spec.k,
    };
    let (top, _) =
        aggregate_top_k_host(&host(&keys), &host(&values), &plan.ops, plan.order, k).unwrap();
    let Some(having) = &spec.having else {
        return (top, dictionaries);
    };
    let groups = groups_batch(spec, plan, &top, &dictionaries).unwrap();
    let verdict = having.evaluate(&groups).unwrap();
    let verdict = verdict.into_array(groups.num_rows()).unwrap();
    let verdict: Vec<bool> = verdict
        .as_boolean()
        .iter()
        .map(|p| p == Some(true))
        .collect();
    let mut top = kept(top, &verdict);
    top.truncate(spec.k);
    (top, dictionaries)
}

/// Each shape of the slice: the device path's plan and output over the host reference's
/// groups are DataFusion's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_paths_output_is_datafusions() {
    let mut config = GpuTopKConfig::default().with_backend(Backend::Cuda);
    config.aggregate_topk = true;
    let ours = context(Some(config));
    let plain = context(None);
    for sql in [
        "SELECT a, COUNT(*) AS n FROM t GROUP BY a ORDER BY n DESC, a LIMIT 10",
        "SELECT COUNT(*) AS n, a FROM t GROUP BY a ORDER BY n, a LIMIT 7 OFFSET 3",
        "SELECT a, COUNT(w) AS c, SUM(w) AS s FROM t GROUP BY a ORDER BY s DESC NULLS FIRST, a LIMIT 9",
        "SELECT a, b, SUM(w) AS s FROM t GROUP BY a, b ORDER BY s NULLS FIRST, a, b LIMIT 9",
        "SELECT a, SUM(f) AS s, MIN(f) AS lo, MAX(f) AS hi FROM t GROUP BY a ORDER BY s DESC, a LIMIT 8",
        "SELECT a, MIN(v) AS lo, MAX(v) AS hi FROM t GROUP BY a ORDER BY hi, a LIMIT 8",
        "SELECT b, ts, AVG(v) AS m, AVG(w) AS mw FROM t GROUP BY b, ts ORDER BY m DESC, b, ts LIMIT 12",
        "SELECT ts, AVG(w) AS m FROM t GROUP BY ts ORDER BY m NULLS FIRST, ts LIMIT 20",
        "SELECT b, COUNT(*) AS n FROM t GROUP BY b ORDER BY n, b LIMIT 100 OFFSET 2",
        "SELECT a, COUNT(*) AS n FROM t GROUP BY a ORDER BY n DESC, a LIMIT 5 OFFSET 100",
        "SELECT a, COUNT(*) AS n FROM t WHERE v > 0 GROUP BY a ORDER BY n DESC, a LIMIT 10",
        "SELECT a, b, SUM(w) AS s FROM t WHERE f < 10.0 AND b IS NOT NULL GROUP BY a, b ORDER BY s NULLS FIRST, a, b LIMIT 9",
        "SELECT ts, AVG(v) AS m FROM t WHERE w IS NULL OR w % 3 = 1 GROUP BY ts ORDER BY m DESC, ts LIMIT 5",
        "SELECT a, MAX(f) AS hi FROM t WHERE a > v GROUP BY a ORDER BY hi, a LIMIT 8",
        "SELECT a, COUNT(*) AS n FROM t WHERE v > 1000 GROUP BY a ORDER BY n, a LIMIT 8",
        "SELECT a, COUNT(*) AS n FROM t GROUP BY a HAVING COUNT(*) > 30 ORDER BY n, a LIMIT 10",
        "SELECT a, b, SUM(w) AS s FROM t WHERE v > 0 GROUP BY a, b HAVING SUM(w) IS NOT NULL AND MIN(v) < 5 ORDER BY s, a, b LIMIT 9",
        "SELECT ts, MAX(f) AS hi FROM t GROUP BY ts HAVING MAX(f) < 19.5 OR ts IS NULL ORDER BY hi DESC, ts LIMIT 5 OFFSET 1",
        "SELECT b, COUNT(*) AS n FROM t GROUP BY b HAVING COUNT(*) > 100000 ORDER BY n, b LIMIT 5",
        "SELECT a, AVG(v) AS m FROM t GROUP BY a HAVING MAX(v) - MIN(v) >= 18 AND a % 2 = 0 ORDER BY m DESC, a LIMIT 7",
        // Keys and inputs the generated pass computes: narrow integers, dates, expressions.
        "SELECT g, COUNT(*) AS n, SUM(h) AS s FROM t GROUP BY g ORDER BY n DESC, g LIMIT 5",
        "SELECT d, MIN(h) AS lo, MAX(g) AS hi, MAX(d) AS last FROM t GROUP BY d ORDER BY lo, d LIMIT 6",
        "SELECT a - 1 AS k, COUNT(*) AS n FROM t GROUP BY a - 1 ORDER BY n DESC, k LIMIT 5",
        "SELECT g, AVG(length(u)) AS l, COUNT(*) AS n FROM t WHERE u <> '' GROUP BY g HAVING COUNT(*) > 10 ORDER BY l DESC, g LIMIT 4",
        "SELECT a, h, AVG(g) AS m FROM t GROUP BY a, h ORDER BY m DESC NULLS LAST, a, h LIMIT 7",
        "SELECT b % 3 AS r, SUM(v * 2) AS s, MIN(f) AS lo FROM t WHERE g > -2 GROUP BY b % 3 ORDER BY s, r LIMIT 3",
        "SELECT h, COUNT(g) AS c FROM t GROUP BY h ORDER BY c DESC, h LIMIT 3 OFFSET 1",
        // Ordered by a group key.
        "SELECT a, COUNT(*) AS n FROM t GROUP BY a ORDER BY a DESC NULLS FIRST LIMIT 6",
        "SELECT date_trunc('minute', ts) AS m, COUNT(*) AS n FROM t WHERE v > 0 GROUP BY date_trunc('minute', ts) ORDER BY m LIMIT 4 OFFSET 1",
        "SELECT a, b, MAX(v) AS hi FROM t GROUP BY a, b ORDER BY b, a LIMIT 7",
        "SELECT g, d, COUNT(*) AS n FROM t GROUP BY g, d ORDER BY g DESC, d LIMIT 5",
        // String keys, grouped by their codes.
        "SELECT u, COUNT(*) AS n FROM t GROUP BY u ORDER BY n DESC, u LIMIT 6",
        "SELECT u, SUM(v) AS s FROM t WHERE u <> '' GROUP BY u ORDER BY s NULLS FIRST, u LIMIT 5",
        "SELECT u, a, COUNT(*) AS n FROM t WHERE u LIKE '%é%' GROUP BY u, a ORDER BY n DESC, u, a LIMIT 8",
        "SELECT u, MAX(g) AS hi FROM t GROUP BY u ORDER BY u DESC NULLS FIRST LIMIT 5 OFFSET 2",
        "SELECT b, u, AVG(f) AS m FROM t GROUP BY b, u ORDER BY u, b LIMIT 9",
        "SELECT u, COUNT(*) AS n FROM t WHERE v > 1000 GROUP BY u ORDER BY n, u LIMIT 3",
        "SELECT a, COUNT(u) AS c, COUNT(*) AS n FROM t GROUP BY a ORDER BY c DESC, a LIMIT 5",
    ] {
        let plan = ours.sql(sql).await.unwrap().create_physical_plan().await;
        let plan = plan.unwrap();
        let exec = operator(&plan).unwrap_or_else(|| panic!("{sql}: no operator"));
        let AggregateBackend::Cuda(device) = exec.backend() else {
            panic!("{sql}: {:?}", exec.backend());
        };
        let (top, dictionaries) = host_top(exec.spec(), device);
        let got = output_batch(exec.spec(), device, &top, &dictionaries, exec.schema());
        let got = got.unwrap();
        let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
        // Rows alone: DataFusion hands out no batch where there are none.
        let text = |batches: &[RecordBatch]| {
            let rows: Vec<RecordBatch> = (batches.iter())
                .filter(|b| b.num_rows() > 0)
                .cloned()
                .collect();
            pretty_format_batches(&rows).unwrap().to_string()
        };
        assert_eq!(text(&[got]), text(&want), "{sql}");
    }
}

/// The device's first table is sized for the rule's estimate and a quarter more, within the
/// table's rows and [`GROUPS_MOST`]; without an estimate for [`GROUPS_UNKNOWN`] groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_table_is_sized_by_the_estimate() {
    let mut config = GpuTopKConfig::default().with_backend(Backend::Cuda);
    config.aggregate_topk = true;
    let ours = context(Some(config));
    let sql = "SELECT a, COUNT(*) AS n FROM t GROUP BY a ORDER BY n DESC, a LIMIT 10";
    let plan = ours.sql(sql).await.unwrap().create_physical_plan().await;
    let plan = plan.unwrap();
    let exec = operator(&plan).unwrap();
    let AggregateBackend::Cuda(device) = exec.backend() else {
        panic!("{:?}", exec.backend());
    };
    // 60 values and NULL, every row sampled.
    assert_eq!(device.groups, Some(61));
    assert_eq!(exec.costing().groups, Some(61));
    assert_eq!(device.groups_estimate(device.rows), 76);
    let mut plan = AggregateDevicePlan::clone(device);
    plan.groups = Some(10);
    assert_eq!(plan.groups_estimate(5), 5);
    assert_eq!(plan.groups_estimate(0), 1);
    plan.groups = Some(usize::MAX);
    assert_eq!(plan.groups_estimate(usize::MAX), GROUPS_MOST);
    plan.groups = None;
    assert_eq!(plan.groups_estimate(usize::MAX), GROUPS_UNKNOWN);
    assert_eq!(plan.groups_estimate(100), 100);
}

/// A filter the fusion translates runs in the generated pass (over the aggregation's columns,
/// then the predicate's own); one it does not keeps DataFusion's subtree, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_run_on_the_device_where_they_translate() {
    let mut config = GpuTopKConfig::default().with_backend(Backend::Cuda);
    config.aggregate_topk = true;
    let ctx = context(Some(config));
    let backend = |sql: &'static str| {
        let ctx = ctx.clone();
        async move {
            let plan = ctx.sql(sql).await.unwrap().create_physical_plan().await;
            let plan = plan.unwrap();
            let exec = operator(&plan).unwrap_or_else(|| panic!("{sql}: no operator"));
            exec.backend().clone()
        }
    };
    let sql = "SELECT a, SUM(v) AS s FROM t WHERE f > 2.5 AND b IN (1, 3) GROUP BY a \
               ORDER BY s DESC, a LIMIT 4";
    let plan = ctx.sql(sql).await.unwrap().create_physical_plan().await;
    let plan = plan.unwrap();
    let exec = operator(&plan).unwrap_or_else(|| panic!("{sql}: no operator"));
    let AggregateBackend::Cuda(device) = exec.backend() else {
        panic!("{sql}: not on the device");
    };
    let program = device.pass.as_ref().expect("the filter's program");
    let schema = exec.spec().table.schema();
    let names: Vec<&str> = (program.inputs.iter())
        .map(|input| match input {
            KernelInput::Column(c) => schema.field(*c).name().as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    // a, v (the aggregation's), then f and b (the predicate's).
    assert_eq!(names, ["a", "v", "f", "b"], "{}", program.source);
    let AggregateBackend::Cuda(plan) =
        backend("SELECT a, COUNT(*) AS n FROM t GROUP BY a ORDER BY n, a LIMIT 3").await
    else {
        panic!("no filter: not on the device");
    };
    assert!(plan.pass.is_none());
    for (sql, why) in [
        (
            "SELECT a, COUNT(*) AS n FROM t WHERE ln(f) > 1.0 GROUP BY a ORDER BY n, a LIMIT 3",
            ["the filter has no device translation", "ln"],
        ),
        (
            "SELECT a, COUNT(*) AS n FROM t GROUP BY a HAVING SUM(f) > 3.0 ORDER BY n, a LIMIT 3",
            ["HAVING reads sum(t.f)", "floating-point sum"],
        ),
        (
            "SELECT a, AVG(v) AS m FROM t GROUP BY a HAVING AVG(v) > 1.0 ORDER BY m, a LIMIT 3",
            ["HAVING reads avg(t.v)", "floating-point sum or average"],
        ),
        (
            "SELECT a, MAX(f) AS m FROM t GROUP BY a HAVING ln(MAX(f)) > 1.0 ORDER BY m, a LIMIT 3",
            ["HAVING has no device translation", "ln"],
        ),
    ] {
        match backend(sql).await {
            AggregateBackend::Cpu(reason) => {
                assert!(why.iter().all(|w| reason.contains(w)), "{sql}: {reason}")
            }
            other => panic!("{sql}: {other:?}"),
        }
    }
    // HAVING over exact aggregates (a MIN(v) that only HAVING reads among them) and keys.
    let sql = "SELECT a, COUNT(*) AS n FROM t GROUP BY a HAVING MIN(v) < 0 AND a > 3 \
               ORDER BY n, a LIMIT 3";
    let AggregateBackend::Cuda(plan) = backend(sql).await else {
        panic!("{sql}: not on the device");
    };
    let (_, columns) = plan.having.as_ref().expect("the HAVING program");
    assert_eq!(columns, &[HavingColumn::Op(1)]);
    // DataFusion moves the key's condition below the aggregation: a filter.
    assert!(plan.pass.is_some());
    let sql = "SELECT a, COUNT(*) AS n FROM t GROUP BY a HAVING MIN(v) < 0 OR a > 3 \
               ORDER BY n, a LIMIT 3";
    let AggregateBackend::Cuda(plan) = backend(sql).await else {
        panic!("{sql}: not on the device");
    };
    let (_, columns) = plan.having.as_ref().expect("the HAVING program");
    assert_eq!(columns, &[HavingColumn::Op(1), HavingColumn::Key(0)]);
}
