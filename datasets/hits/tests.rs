//! The hits generator's model, determinism, files and queries.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::datatypes::{Int16Type, Int32Type, Int64Type};
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use datafusion::prelude::SessionContext;

use super::*;

fn i64s(batch: &RecordBatch, name: &str) -> Vec<i64> {
    let col = batch.column_by_name(name).unwrap();
    col.as_primitive::<Int64Type>().values().to_vec()
}

fn strings<'a>(batch: &'a RecordBatch, name: &str) -> Vec<&'a str> {
    let col = batch.column_by_name(name).unwrap().as_string::<i32>();
    col.iter().map(Option::unwrap).collect()
}

fn distinct<T: std::hash::Hash + Eq>(values: impl IntoIterator<Item = T>) -> f64 {
    values.into_iter().collect::<HashSet<_>>().len() as f64
}

#[test]
fn deterministic_across_batches_and_partitions() {
    let spec = HitsSpec::new(20_000);
    let whole = generate_rows(&spec, 0, 20_000).unwrap();
    assert_eq!(whole.schema(), hits_schema());
    for (parts, batch) in [(1, 8192), (3, 777), (5, 20_000)] {
        let p = hits_partitions(&spec, parts, batch).unwrap();
        let batches: Vec<_> = p.into_iter().flatten().collect();
        assert_eq!(concat_batches(&hits_schema(), &batches).unwrap(), whole);
    }
    assert_eq!(
        generate_rows(&spec, 12_345, 100).unwrap(),
        whole.slice(12_345, 100)
    );
    assert_ne!(generate_rows(&spec.with_seed(7), 0, 20_000).unwrap(), whole);
    assert!(generate_rows(&spec, 19_990, 11).is_err());
}

/// The distinct counts per row follow the model (ClickBench's ratios), and the skews and
/// shares hold.
#[test]
fn cardinalities_follow_the_model() {
    let rows = 400_000;
    let spec = HitsSpec::new(rows);
    let b = concat_batches(
        &hits_schema(),
        &hits_partitions(&spec, 2, 65_536).unwrap().concat(),
    )
    .unwrap();
    assert!(b.columns().iter().all(|c| c.null_count() == 0));
    let n = rows as f64;
    let near = |what: &str, got: f64, want: f64| {
        assert!(
            (got / want - 1.0).abs() < 0.15,
            "{what}: {got}, expected ≈ {want}"
        );
    };
    let watch = i64s(&b, "WatchID");
    assert_eq!(distinct(&watch), n, "WatchID is unique");
    let users = i64s(&b, "UserID");
    near("users", distinct(&users), 0.176 * n);
    let mut per_user: HashMap<i64, usize> = HashMap::new();
    for &u in &users {
        *per_user.entry(u).or_default() += 1;
    }
    assert!(
        per_user.values().max().unwrap() * 200 > rows as usize,
        "a very active user"
    );
    let phrases = strings(&b, "SearchPhrase");
    near(
        "empty phrases",
        phrases.iter().filter(|p| p.is_empty()).count() as f64,
        0.7 * n,
    );
    near("phrases", distinct(&phrases) - 1.0, 0.06 * n);
    let engines = b
        .column_by_name("SearchEngineID")
        .unwrap()
        .as_primitive::<Int16Type>();
    assert!(
        phrases
            .iter()
            .zip(engines.values())
            .all(|(p, &e)| p.is_empty() == (e == 0))
    );
    let urls = strings(&b, "URL");
    near("URLs", distinct(&urls), 0.2 * n);
    let mean_url = urls.iter().map(|u| u.len()).sum::<usize>() as f64 / n;
    assert!(
        (40.0..90.0).contains(&mean_url),
        "mean URL length {mean_url}"
    );
    let models = strings(&b, "MobilePhoneModel");
    near(
        "no model",
        models.iter().filter(|m| m.is_empty()).count() as f64,
        0.9 * n,
    );
    assert!(distinct(&models) <= 1.0 + PHONE_MODELS.len() as f64);
    let counters = b
        .column_by_name("CounterID")
        .unwrap()
        .as_primitive::<Int32Type>();
    let top = counters
        .values()
        .iter()
        .filter(|&&c| c == TOP_COUNTER_ID)
        .count();
    assert!(top as f64 > 0.05 * n, "counter 62 has {top} rows");
    assert!(distinct(counters.values()) <= spec.counters() as f64);
    let adv = b
        .column_by_name("AdvEngineID")
        .unwrap()
        .as_primitive::<Int16Type>();
    near(
        "adverts",
        adv.values().iter().filter(|&&a| a != 0).count() as f64,
        0.02 * n,
    );
    let ips = b
        .column_by_name("ClientIP")
        .unwrap()
        .as_primitive::<Int32Type>();
    near("addresses", distinct(ips.values()), 0.093 * n);
    // Each page has one counter, each user one region.
    let mut page_counter = HashMap::new();
    for (u, &c) in urls.iter().zip(counters.values()) {
        assert_eq!(*page_counter.entry(*u).or_insert(c), c);
    }
    let times = b
        .column(5)
        .as_primitive::<datafusion::arrow::datatypes::TimestampMicrosecondType>();
    let dates = b
        .column(4)
        .as_primitive::<datafusion::arrow::datatypes::Date32Type>();
    assert!(times.values().windows(2).all(|w| w[0] <= w[1]));
    for (&t, &d) in times.values().iter().zip(dates.values()) {
        assert_eq!(t % 1_000_000, 0);
        assert_eq!(i64::from(d), t / 1_000_000 / DAY_S);
        assert!((DAY_START..DAY_START + 31).contains(&d));
    }
}

#[test]
fn names_are_injective() {
    let m = Model::new(&HitsSpec::new(1_000_000));
    let mut seen = HashSet::new();
    for rank in 0..300_000 {
        let mut url = Vec::new();
        m.push_url(&mut url, rank, m.counter(rank));
        assert!(seen.insert(url), "page {rank}");
    }
    seen.clear();
    for rank in 0..300_000 {
        let mut phrase = Vec::new();
        m.push_phrase(&mut phrase, rank);
        assert!(seen.insert(phrase), "phrase {rank}");
    }
    let mut big = Vec::new();
    push_digits(&mut big, u64::MAX, 3, b' ');
    assert_eq!(big.split(|&c| c == b' ').count(), 7);
}

#[test]
fn empty_and_invalid_inputs() {
    let empty = HitsSpec::new(0);
    assert!(
        hits_partitions(&empty, 3, 8192)
            .unwrap()
            .iter()
            .all(Vec::is_empty)
    );
    assert_eq!(generate_rows(&empty, 0, 0).unwrap().num_rows(), 0);
    assert!(hits_partitions(&HitsSpec::new(10), 0, 8192).is_err());
    let tiny = hits_partitions(&HitsSpec::new(3), 8, 8192).unwrap();
    assert_eq!(
        tiny.iter().flatten().map(|b| b.num_rows()).sum::<usize>(),
        3
    );
}

#[test]
fn parquet_round_trip() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("hits-{}-{nanos}", std::process::id()));
    let spec = HitsSpec::new(30_000);
    let summary = write_parquet(&spec, &dir, 12_000, false).unwrap();
    assert_eq!((summary.files, summary.rows), (3, 30_000));
    let mut batches = Vec::new();
    for f in 0..3 {
        let file = File::open(dir.join(format!("hits-{f:05}.parquet"))).unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        batches.extend(reader.build().unwrap().map(Result::unwrap));
    }
    let read = concat_batches(&hits_schema(), &batches).unwrap();
    assert_eq!(read, generate_rows(&spec, 0, 30_000).unwrap());
    let err = write_parquet(&spec, &dir, 12_000, false).unwrap_err();
    assert!(err.to_string().contains("already holds 3 hits-"), "{err}");
    fs::remove_dir_all(&dir).unwrap();
}

/// Every query runs and gives its full LIMIT of rows (H09's OFFSET included).
#[tokio::test]
async fn queries_run_on_the_mem_table() {
    let rows = 300_000;
    let ctx = SessionContext::new();
    ctx.register_table(TABLE_NAME, hits_mem_table(&HitsSpec::new(rows), 4).unwrap())
        .unwrap();
    for (name, sql) in queries(rows) {
        let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        let got: usize = batches.iter().map(|b| b.num_rows()).sum();
        let want = match name.as_str() {
            "H06" => 25,
            _ => 10,
        };
        assert_eq!(got, want, "{name}: {sql}");
    }
}
