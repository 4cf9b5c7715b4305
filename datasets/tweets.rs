//! Deterministic synthetic tweets, modelled on the 250M tweets of May 2017 of the SIGMOD'18
//! bitonic top-k evaluation.
//!
//! Every value of row `i` is a pure function of `(seed, rows, i)`: the row's random words are
//! splitmix64 outputs at counter `i * WORDS_PER_ROW + j`, so any row range can be generated on
//! any thread and the data never depends on thread count or batch size.
//!
//! The model, per row:
//! - `id` = `ID_BASE + i`, and `tweet_time` spreads the rows evenly over May 2017 in id order,
//!   so `tweet_time < X` selects ≈ (X − May 1) / 31 days of the table.
//! - `uid` draws a user rank from a Zipf law (exponent 0.7) over `0.266 × rows` users, then
//!   scrambles it; about `rows × 57/250` distinct users appear and the top 1% of them write
//!   ≈ 20% of the tweets (Q4's skew).
//! - `retweet_count` is 0 for 76% of rows, else a discrete Pareto (α = 1.3) that reaches the
//!   hundreds of thousands at full scale: top-k keys tie everywhere, as in the real data.
//! - `likes_count` is the retweet count times a log-logistic ratio (median 2.5), or for
//!   un-retweeted tweets 0 (95%) or a small Pareto, so likes are correlated and usually larger.
//! - `lang` follows the 2017 language mix (en 35%, ja 17%, es 9%, …) over 30 codes.

use std::path::Path;
use std::sync::{Arc, LazyLock};

use datafusion::arrow::array::{
    ArrayRef, DictionaryArray, Int32Array, Int64Array, StringArray, TimestampMillisecondArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::error::{DataFusionError, Result};

pub use super::shared::WriteSummary;
use super::shared::{self, GAMMA, mix64, threshold32, unit};

/// Seed used when none is given.
pub const DEFAULT_SEED: u64 = 20_170_501;
/// Name under which the CLI and the benchmarks register the table.
pub const TABLE_NAME: &str = "tweets";
/// 2017-05-01T00:00:00 in milliseconds since the epoch.
pub const TIME_START_MS: i64 = 1_493_596_800_000;
/// 2017-06-01T00:00:00 (exclusive upper bound of `tweet_time`).
pub const TIME_END_MS: i64 = TIME_START_MS + SPAN_MS;
const SPAN_MS: i64 = 31 * DAY_MS;
const DAY_MS: i64 = 86_400_000;

/// Tweet ids of early May 2017 were around 8.6e17; offsetting keeps them realistic-looking.
const ID_BASE: i64 = 858_000_000_000_000_000;
/// Zipf exponent and user universe per row, calibrated so that ≈ 57/250 of the rows' count of
/// users actually appear (a universe larger than the observed count: tail users may not tweet).
const USER_ZIPF_S: f64 = 0.7;
const USER_UNIVERSE_PER_ROW: f64 = 0.266;
/// Multiplier of the rank → uid scramble (prime, so coprime with almost every universe size).
const UID_SCRAMBLE: u64 = 2_654_435_761;

const RT_ZERO: f64 = 0.76;
const RT_ALPHA: f64 = 1.3;
const LIKES_ZERO_WHEN_NO_RT: f64 = 0.95;
const LIKES_ALPHA_WHEN_NO_RT: f64 = 1.6;
const LIKES_RATIO_MEDIAN: f64 = 2.5;
/// Spread of the likes/retweets ratio: ratio = median × (u / (1 − u))^spread.
const LIKES_RATIO_SPREAD: f64 = 0.4;
/// Keeps counts well inside Int32 (the real maxima are a few million).
const COUNT_CAP: f64 = 50_000_000.0;

/// Language codes and their weights in 1/10000 of the tweets.
pub const LANGS: [(&str, u32); 30] = [
    ("en", 3500),
    ("ja", 1700),
    ("es", 900),
    ("und", 760),
    ("pt", 600),
    ("ar", 500),
    ("th", 400),
    ("ko", 300),
    ("fr", 220),
    ("tr", 200),
    ("in", 180),
    ("ru", 120),
    ("de", 100),
    ("it", 80),
    ("tl", 80),
    ("hi", 50),
    ("nl", 40),
    ("pl", 40),
    ("zh", 40),
    ("fa", 30),
    ("ur", 20),
    ("sv", 20),
    ("ca", 20),
    ("el", 20),
    ("uk", 20),
    ("vi", 20),
    ("ht", 10),
    ("da", 10),
    ("fi", 10),
    ("no", 10),
];
const LANG_TOTAL: u64 = 10_000;
/// Cumulative weights: a row takes the first language whose bound exceeds its draw.
const LANG_CUM: [u32; 30] = {
    let mut cum = [0u32; 30];
    let mut acc = 0;
    let mut i = 0;
    while i < LANGS.len() {
        acc += LANGS[i].1;
        cum[i] = acc;
        i += 1;
    }
    assert!(
        acc as u64 == LANG_TOTAL,
        "language weights must sum to 10000"
    );
    cum
};

/// The four headline queries of DESIGN §9 (SIGMOD'18 §6.8) over table `tweets`.
pub const QUERIES: [(&str, &str); 4] = [
    (
        "Q1",
        "SELECT id FROM tweets WHERE tweet_time < '2017-05-04' ORDER BY retweet_count DESC LIMIT 50",
    ),
    (
        "Q2",
        "SELECT id FROM tweets ORDER BY retweet_count + 0.5 * likes_count DESC LIMIT 50",
    ),
    (
        "Q3",
        "SELECT id FROM tweets WHERE lang = 'en' OR lang = 'es' ORDER BY retweet_count DESC LIMIT 50",
    ),
    (
        "Q4",
        "SELECT uid, COUNT(*) AS num_tweets FROM tweets GROUP BY uid ORDER BY num_tweets DESC LIMIT 50",
    ),
];

/// Batch size of [`tweets_mem_table`] and [`tweets_gpu_table`].
const MEM_BATCH_ROWS: usize = 8192;

/// What to generate: the table size and the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TweetsSpec {
    pub rows: u64,
    pub seed: u64,
}

impl TweetsSpec {
    /// `rows` tweets with [`DEFAULT_SEED`].
    pub fn new(rows: u64) -> Self {
        Self {
            rows,
            seed: DEFAULT_SEED,
        }
    }

    pub fn with_seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    /// Size of the user universe the uids are drawn from (not all of them tweet).
    pub fn user_universe(&self) -> u64 {
        ((self.rows as f64 * USER_UNIVERSE_PER_ROW).round() as u64).max(1)
    }
}

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("uid", DataType::Int64, false),
        Field::new(
            "tweet_time",
            DataType::Timestamp(TimeUnit::Millisecond, None),
            false,
        ),
        Field::new("retweet_count", DataType::Int32, false),
        Field::new("likes_count", DataType::Int32, false),
        Field::new(
            "lang",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            false,
        ),
    ]))
});

/// One dictionary shared by every batch: pointer-equal values let arrow concatenate and
/// coalesce batches without merging dictionaries.
static LANG_VALUES: LazyLock<ArrayRef> =
    LazyLock::new(|| Arc::new(StringArray::from_iter_values(LANGS.iter().map(|l| l.0))));

/// Schema of the tweets table.
pub fn tweets_schema() -> SchemaRef {
    Arc::clone(&SCHEMA)
}

/// `tweet_time` bound `X` such that `tweet_time < X` selects the fraction `sel` (clamped to
/// 0..=1) of the rows, as a SQL timestamp literal without quotes, e.g. `2017-05-04 02:24:00`.
pub fn time_bound_for_selectivity(sel: f64) -> String {
    let sel = if sel.is_nan() {
        0.0
    } else {
        sel.clamp(0.0, 1.0)
    };
    let off = (sel * SPAN_MS as f64).round() as i64;
    let (day, rest) = (off / DAY_MS, off % DAY_MS);
    let date = if day >= 31 {
        "2017-06-01".to_string()
    } else {
        format!("2017-05-{:02}", day + 1)
    };
    let (h, m, s, ms) = (
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000,
    );
    if ms == 0 {
        format!("{date} {h:02}:{m:02}:{s:02}")
    } else {
        format!("{date} {h:02}:{m:02}:{s:02}.{ms:03}")
    }
}

/// Q1 with the time bound that selects the fraction `sel` of the table.
pub fn q1_with_selectivity(sel: f64) -> String {
    format!(
        "SELECT id FROM tweets WHERE tweet_time < '{}' ORDER BY retweet_count DESC LIMIT 50",
        time_bound_for_selectivity(sel)
    )
}

/// Random words drawn per row (some used as two 32-bit halves).
const WORDS_PER_ROW: u64 = 5;

/// Discrete Pareto ≥ 1: floor(u^(−1/α)) with u in (0, 1].
#[inline]
fn pareto(x: u64, inv_alpha: f64) -> f64 {
    (1.0 - unit(x)).powf(-inv_alpha).floor()
}

/// Per-table constants of the generator.
struct Model {
    /// splitmix64 state before row 0.
    key: u64,
    universe: u64,
    /// Zipf inverse CDF: rank = (1 + u·zipf_d)^(1/zipf_a) − 1.
    zipf_d: f64,
    zipf_inv_a: f64,
    scramble: u64,
    /// Milliseconds per row (as f64: the products stay monotone in the row index).
    ms_per_row: f64,
    rt_zero: u32,
    likes_zero: u32,
}

impl Model {
    fn new(spec: &TweetsSpec) -> Self {
        let universe = spec.user_universe();
        let a = 1.0 - USER_ZIPF_S;
        // Fall back to the identity scramble in the unlikely case the prime divides the universe.
        let scramble = if universe.is_multiple_of(UID_SCRAMBLE) {
            1
        } else {
            UID_SCRAMBLE % universe
        };
        Self {
            key: mix64(spec.seed ^ 0x7477_6565_7473_2017),
            universe,
            zipf_d: ((universe + 1) as f64).powf(a) - 1.0,
            zipf_inv_a: 1.0 / a,
            scramble,
            ms_per_row: SPAN_MS as f64 / spec.rows.max(1) as f64,
            rt_zero: threshold32(RT_ZERO),
            likes_zero: threshold32(LIKES_ZERO_WHEN_NO_RT),
        }
    }

    /// `j`-th random word of row `i`.
    #[inline]
    fn word(&self, i: u64, j: u64) -> u64 {
        mix64(
            self.key
                .wrapping_add((i.wrapping_mul(WORDS_PER_ROW) + j + 1).wrapping_mul(GAMMA)),
        )
    }

    #[inline]
    fn uid(&self, x: u64) -> i64 {
        let rank = ((1.0 + unit(x) * self.zipf_d).powf(self.zipf_inv_a) - 1.0) as u64;
        let rank = rank.min(self.universe - 1);
        // Bijective on 0..universe, so popular users do not get the smallest uids.
        let scrambled = if self.universe <= u32::MAX as u64 {
            (rank * self.scramble + 1) % self.universe
        } else {
            ((rank as u128 * self.scramble as u128 + 1) % self.universe as u128) as u64
        };
        scrambled as i64 + 1
    }

    #[inline]
    fn time(&self, i: u64, frac32: u32) -> i64 {
        let pos = i as f64 + frac32 as f64 * (1.0 / 4_294_967_296.0);
        let off = ((pos * self.ms_per_row) as i64).min(SPAN_MS - 1);
        TIME_START_MS + off
    }

    /// (retweet_count, likes_count) from three random words.
    #[inline]
    fn counts(&self, zeros: u64, x: u64, y: u64) -> (i32, i32) {
        if (zeros as u32) < self.rt_zero {
            let likes = if ((zeros >> 32) as u32) < self.likes_zero {
                0
            } else {
                pareto(y, 1.0 / LIKES_ALPHA_WHEN_NO_RT).min(COUNT_CAP) as i32
            };
            return (0, likes);
        }
        let rt = pareto(x, 1.0 / RT_ALPHA).min(COUNT_CAP);
        // Log-logistic ratio: u in (0, 1) so the odds are finite and positive.
        let u = (unit(y) + 0.5 / (1u64 << 53) as f64).clamp(1e-9, 1.0 - 1e-9);
        let ratio = LIKES_RATIO_MEDIAN * (u / (1.0 - u)).powf(LIKES_RATIO_SPREAD);
        let likes = (rt * ratio).round().min(COUNT_CAP);
        (rt as i32, likes as i32)
    }
}

#[inline]
fn lang_key(draw32: u32) -> i32 {
    let v = ((draw32 as u64 * LANG_TOTAL) >> 32) as u32;
    LANG_CUM
        .iter()
        .position(|&c| v < c)
        .unwrap_or(LANGS.len() - 1) as i32
}

/// Generates rows `[start, start + len)` of the table described by `spec`.
pub fn generate_rows(spec: &TweetsSpec, start: u64, len: usize) -> Result<RecordBatch> {
    let end = start
        .checked_add(len as u64)
        .filter(|&end| end <= spec.rows)
        .ok_or_else(|| {
            DataFusionError::Execution(format!(
                "tweets: rows {start}..{start}+{len} are outside the table of {} rows",
                spec.rows
            ))
        })?;
    let model = Model::new(spec);
    let mut ids = Vec::with_capacity(len);
    let mut uids = Vec::with_capacity(len);
    let mut times = Vec::with_capacity(len);
    let mut retweets = Vec::with_capacity(len);
    let mut likes = Vec::with_capacity(len);
    let mut langs = Vec::with_capacity(len);
    for i in start..end {
        let w: [u64; WORDS_PER_ROW as usize] = std::array::from_fn(|j| model.word(i, j as u64));
        ids.push(ID_BASE + i as i64);
        uids.push(model.uid(w[0]));
        times.push(model.time(i, w[1] as u32));
        langs.push(lang_key((w[1] >> 32) as u32));
        let (rt, lk) = model.counts(w[2], w[3], w[4]);
        retweets.push(rt);
        likes.push(lk);
    }
    let lang =
        DictionaryArray::<Int32Type>::try_new(Int32Array::from(langs), Arc::clone(&LANG_VALUES))?;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids)),
        Arc::new(Int64Array::from(uids)),
        Arc::new(TimestampMillisecondArray::from(times)),
        Arc::new(Int32Array::from(retweets)),
        Arc::new(Int32Array::from(likes)),
        Arc::new(lang),
    ];
    Ok(RecordBatch::try_new(tweets_schema(), columns)?)
}

/// The table split into `partitions` contiguous row ranges (partition `p` holds the p-th
/// range, so concatenating partitions in order gives rows `0..rows`), each as batches of at
/// most `batch_size` rows. Generated in parallel.
pub fn tweets_partitions(
    spec: &TweetsSpec,
    partitions: usize,
    batch_size: usize,
) -> Result<Vec<Vec<RecordBatch>>> {
    shared::partitions("tweets", spec.rows, partitions, batch_size, |start, len| {
        generate_rows(spec, start, len)
    })
}

/// The table in memory, in `partitions` partitions of 8192-row batches.
pub fn tweets_mem_table(spec: &TweetsSpec, partitions: usize) -> Result<Arc<MemTable>> {
    let parts = tweets_partitions(spec, partitions, MEM_BATCH_ROWS)?;
    Ok(Arc::new(MemTable::try_new(tweets_schema(), parts)?))
}

/// The table in memory as a [`crate::GpuTable`] (its top-k queries' columns kept on the GPU
/// between queries), in `partitions` partitions of 8192-row batches.
pub fn tweets_gpu_table(spec: &TweetsSpec, partitions: usize) -> Result<Arc<crate::GpuTable>> {
    let parts = tweets_partitions(spec, partitions, MEM_BATCH_ROWS)?;
    Ok(Arc::new(crate::GpuTable::try_new(tweets_schema(), parts)?))
}

/// Writes the table as `tweets-00000.parquet`, `tweets-00001.parquet`, … of `rows_per_file`
/// rows each (zstd, ~1M-row row groups) into `out_dir`, one file per thread at a time. Creates
/// `out_dir`, and refuses to run if it already holds `tweets-*.parquet` files. A table of 0
/// rows is written as one empty file so that readers still see the schema. `show_progress`:
/// a progress bar with the `cli` feature, else a log line per file; the files are the same.
pub fn write_parquet(
    spec: &TweetsSpec,
    out_dir: &Path,
    rows_per_file: u64,
    show_progress: bool,
) -> Result<WriteSummary> {
    let table = shared::Table {
        name: TABLE_NAME,
        schema: tweets_schema(),
        rows: spec.rows,
        generate: |start, len| generate_rows(spec, start, len),
    };
    shared::write_parquet(&table, out_dir, rows_per_file, show_progress)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::fs::{self, File};

    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::compute::concat_batches;
    use datafusion::arrow::datatypes::{Int64Type, TimestampMillisecondType};
    use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use datafusion::prelude::SessionContext;

    use std::path::PathBuf;

    use super::*;

    fn concat(parts: Vec<Vec<RecordBatch>>) -> RecordBatch {
        let batches: Vec<_> = parts.into_iter().flatten().collect();
        concat_batches(&tweets_schema(), &batches).unwrap()
    }

    fn i32s(batch: &RecordBatch, name: &str) -> Vec<i32> {
        let col = batch.column_by_name(name).unwrap();
        col.as_primitive::<Int32Type>().values().to_vec()
    }

    #[test]
    fn deterministic_across_batches_and_partitions() {
        let spec = TweetsSpec::new(20_000);
        let whole = generate_rows(&spec, 0, 20_000).unwrap();
        assert_eq!(whole.num_rows(), 20_000);
        for (parts, batch) in [(1, 8192), (3, 777), (7, 20_000), (64, 1)] {
            let p = tweets_partitions(&spec, parts, batch).unwrap();
            assert_eq!(p.len(), parts);
            assert!(p.iter().flatten().all(|b| b.num_rows() <= batch));
            assert_eq!(
                concat(p),
                whole,
                "{parts} partitions of {batch}-row batches"
            );
        }
        assert_eq!(
            generate_rows(&spec, 12_345, 100).unwrap(),
            whole.slice(12_345, 100)
        );
        let other = generate_rows(&spec.with_seed(7), 0, 20_000).unwrap();
        assert_ne!(other, whole);
    }

    #[test]
    fn ids_unique_and_time_monotonic() {
        let spec = TweetsSpec::new(100_000);
        let b = concat(tweets_partitions(&spec, 4, 4096).unwrap());
        let ids = b.column(0).as_primitive::<Int64Type>().values();
        let times = b.column(2).as_primitive::<TimestampMillisecondType>();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(times.values().windows(2).all(|w| w[0] <= w[1]));
        assert!(times.values()[0] >= TIME_START_MS);
        assert!(*times.values().last().unwrap() < TIME_END_MS);
        assert_eq!(b.schema(), tweets_schema());
        assert!(b.columns().iter().all(|c| c.null_count() == 0));
        // '2017-05-04' selects 3 of 31 days.
        let bound = TIME_START_MS + 3 * DAY_MS;
        let sel = times.values().iter().filter(|&&t| t < bound).count() as f64 / 1e5;
        assert!((sel - 3.0 / 31.0).abs() < 0.001, "selectivity {sel}");
    }

    #[test]
    fn counts_are_heavy_tailed_and_correlated() {
        let spec = TweetsSpec::new(1_000_000);
        let b = generate_rows(&spec, 0, 1_000_000).unwrap();
        let (rt, likes) = (i32s(&b, "retweet_count"), i32s(&b, "likes_count"));
        let zero = |v: &[i32]| v.iter().filter(|&&x| x == 0).count() as f64 / v.len() as f64;
        assert!((0.65..0.85).contains(&zero(&rt)), "rt zeros {}", zero(&rt));
        assert!(
            (0.65..0.85).contains(&zero(&likes)),
            "likes zeros {}",
            zero(&likes)
        );
        assert!(rt.iter().all(|&x| x >= 0) && likes.iter().all(|&x| x >= 0));
        let max_rt = *rt.iter().max().unwrap();
        assert!(max_rt > 5_000, "max retweets {max_rt}");
        let retweeted: Vec<_> = rt.iter().zip(&likes).filter(|(r, _)| **r > 0).collect();
        let larger = retweeted.iter().filter(|(r, l)| l > r).count();
        assert!(larger as f64 > 0.7 * retweeted.len() as f64);
        // Many ties at the top-k boundary, but the largest values are not all equal.
        let distinct: HashSet<_> = rt.iter().collect();
        assert!(distinct.len() > 100);
    }

    #[test]
    fn lang_is_skewed() {
        let spec = TweetsSpec::new(200_000);
        let b = generate_rows(&spec, 0, 200_000).unwrap();
        let lang = b.column(5).as_dictionary::<Int32Type>();
        let mut counts = [0usize; LANGS.len()];
        for &k in lang.keys().values() {
            counts[k as usize] += 1;
        }
        let top = (0..LANGS.len()).max_by_key(|&i| counts[i]).unwrap();
        assert_eq!(LANGS[top].0, "en");
        let share =
            |code: &str| counts[LANGS.iter().position(|l| l.0 == code).unwrap()] as f64 / 200_000.0;
        assert!((share("en") - 0.35).abs() < 0.01);
        assert!((share("ja") - 0.17).abs() < 0.01);
        assert!(share("es") > share("pt"));
        assert!(counts.iter().all(|&c| c > 0));
    }

    #[test]
    fn users_are_many_and_skewed() {
        let rows = 1_000_000;
        let b = generate_rows(&TweetsSpec::new(rows), 0, rows as usize).unwrap();
        let mut per_user: HashMap<i64, u32> = HashMap::new();
        for &u in b.column(1).as_primitive::<Int64Type>().values() {
            *per_user.entry(u).or_default() += 1;
        }
        let expected = rows as f64 * 57.0 / 250.0;
        let distinct = per_user.len() as f64;
        assert!(
            (0.85 * expected..1.15 * expected).contains(&distinct),
            "{distinct} users, expected ≈ {expected}"
        );
        let mut counts: Vec<u32> = per_user.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let top1pct: u64 = counts[..counts.len() / 100].iter().map(|&c| c as u64).sum();
        assert!(counts[0] > 1000, "top user has {} tweets", counts[0]);
        assert!(top1pct as f64 > 0.1 * rows as f64);
    }

    #[test]
    fn empty_and_invalid_inputs() {
        let empty = TweetsSpec::new(0);
        let parts = tweets_partitions(&empty, 4, 8192).unwrap();
        assert!(parts.iter().all(|p| p.is_empty()));
        assert!(tweets_mem_table(&empty, 2).is_ok());
        assert_eq!(generate_rows(&empty, 0, 0).unwrap().num_rows(), 0);
        assert!(generate_rows(&TweetsSpec::new(10), 5, 6).is_err());
        assert!(generate_rows(&TweetsSpec::new(10), u64::MAX, 1).is_err());
        assert!(tweets_partitions(&TweetsSpec::new(10), 0, 8192).is_err());
        assert!(tweets_partitions(&TweetsSpec::new(10), 1, 0).is_err());
        // Fewer rows than partitions: trailing partitions may be empty, nothing is lost.
        let p = tweets_partitions(&TweetsSpec::new(3), 8, 8192).unwrap();
        assert_eq!(p.iter().flatten().map(|b| b.num_rows()).sum::<usize>(), 3);
    }

    #[test]
    fn selectivity_bounds() {
        assert_eq!(time_bound_for_selectivity(0.0), "2017-05-01 00:00:00");
        assert_eq!(time_bound_for_selectivity(0.1), "2017-05-04 02:24:00");
        assert_eq!(time_bound_for_selectivity(1.0), "2017-06-01 00:00:00");
        assert_eq!(time_bound_for_selectivity(2.0), "2017-06-01 00:00:00");
        assert!(q1_with_selectivity(0.5).contains("'2017-05-16 12:00:00'"));
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        std::env::temp_dir().join(format!("tweets-{tag}-{}-{nanos}", std::process::id()))
    }

    #[test]
    fn parquet_round_trip() {
        let dir = temp_dir("roundtrip");
        let spec = TweetsSpec::new(50_000);
        let summary = write_parquet(&spec, &dir, 20_000, false).unwrap();
        assert_eq!(summary.files, 3);
        assert_eq!(summary.rows, 50_000);
        assert!(summary.bytes > 0);
        let mut batches = Vec::new();
        for f in 0..3 {
            let file = File::open(dir.join(format!("tweets-{f:05}.parquet"))).unwrap();
            let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                .unwrap()
                .build()
                .unwrap();
            batches.extend(reader.map(|b| b.unwrap()));
        }
        let read = concat_batches(&tweets_schema(), &batches).unwrap();
        assert_eq!(read, generate_rows(&spec, 0, 50_000).unwrap());
        // A second write into the same directory is refused and leaves the files alone.
        let err = write_parquet(&spec, &dir, 20_000, false).unwrap_err();
        assert!(err.to_string().contains("already holds 3"), "{err}");
        fs::remove_dir_all(&dir).unwrap();

        // Zero rows: one empty file with the schema.
        let dir = temp_dir("empty");
        let summary = write_parquet(&TweetsSpec::new(0), &dir, 1000, false).unwrap();
        assert_eq!((summary.files, summary.rows), (1, 0));
        fs::remove_dir_all(&dir).unwrap();

        // A regular file where the directory should be.
        let file = temp_dir("file");
        fs::write(&file, b"x").unwrap();
        assert!(write_parquet(&spec, &file.join("sub"), 1000, false).is_err());
        fs::remove_file(&file).unwrap();
    }

    #[tokio::test]
    async fn queries_run_on_the_mem_table() {
        let spec = TweetsSpec::new(100_000);
        let ctx = SessionContext::new();
        ctx.register_table(TABLE_NAME, tweets_mem_table(&spec, 4).unwrap())
            .unwrap();
        for (name, sql) in QUERIES {
            let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            assert_eq!(rows, 50, "{name}");
        }
        for sel in [0.1, 0.5, 0.9] {
            let sql = format!(
                "SELECT COUNT(*) FROM tweets WHERE tweet_time < '{}'",
                time_bound_for_selectivity(sel)
            );
            let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            let n = batches[0].column(0).as_primitive::<Int64Type>().value(0);
            assert!((n as f64 / 1e5 - sel).abs() < 0.002, "sel {sel}: {n}");
        }
        let sql = "SELECT COUNT(*) FROM tweets WHERE lang = 'en' OR lang = 'es'";
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let n = batches[0].column(0).as_primitive::<Int64Type>().value(0);
        assert!((n as f64 / 1e5 - 0.44).abs() < 0.01, "Q3 selectivity {n}");
    }
}
