//! Deterministic synthetic web-analytics hits, shaped like ClickBench's `hits` table (a month
//! of page views of a web counter service): a subset of its columns with their types, and
//! distributions whose distinct counts follow ClickBench's at 100M rows and scale with the
//! row count. It backs the benchmark of the top-k over an aggregation ([`queries`]).
//!
//! Every value of row `i` is a pure function of `(seed, rows, i)`: the row's random words are
//! splitmix64 outputs at counter `i * WORDS_PER_ROW + j`, so any row range can be generated on
//! any thread and the data never depends on thread count or batch size.
//!
//! The model, per row (`n` = rows; the constants below):
//! - `WatchID`: a bijection of the row index onto 63 bits, so unique and unordered.
//! - `EventTime` spreads the rows evenly over July 2013 in row order, at whole seconds;
//!   `EventDate` is its day.
//! - `UserID` draws a user rank from a Zipf law (exponent 0.8) over `0.215 n` users (≈ `0.176
//!   n` appear, a few very active), scrambled onto 63 bits. A user's `RegionID`,
//!   `ClientIP`, `MobilePhoneModel` and `ResolutionWidth` are functions of the user.
//! - `SearchPhrase` is `''` for 70% of rows, else a phrase drawn from a Zipf law (0.8) over
//!   `0.077 n` phrases (≈ `0.06 n` appear); `SearchEngineID` is 0 exactly when it is empty.
//! - `URL` draws a page from a Zipf law (0.7) over `0.225 n` pages (≈ `0.2 n` appear); a page
//!   belongs to one counter, so `CounterID` is a function of the page (Zipf, exponent 1, over
//!   `max(100, 6.5e-5 n)` counters, the most popular being 62 as in ClickBench).
//! - `AdvEngineID` is 0 for 98% of rows, `IsRefresh` 1 for 10%, `TraficSourceID` and the
//!   engines follow small fixed tables, `WindowClientWidth` is 55–100% of the resolution.

use std::path::Path;
use std::sync::{Arc, LazyLock};

use datafusion::arrow::array::{
    ArrayRef, Date32Array, Int16Array, Int32Array, Int64Array, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::error::{DataFusionError, Result};

use super::shared::{self, GAMMA, WriteSummary, mix64, threshold32, unit};

/// Seed used when none is given.
pub const DEFAULT_SEED: u64 = 20_130_701;
/// Name under which the benchmarks register the table.
pub const TABLE_NAME: &str = "hits";
/// 2013-07-01T00:00:00 in seconds since the epoch.
pub const TIME_START_S: i64 = 1_372_636_800;
/// The same day in days since the epoch (`EventDate`).
const DAY_START: i32 = 15_887;
const DAY_S: i64 = 86_400;
const SPAN_S: i64 = 31 * DAY_S;

/// Zipf exponents and universes per row, calibrated so that the distinct counts per row are
/// ClickBench's at 100M rows (users ≈ 0.176, search phrases ≈ 0.06, URLs ≈ 0.2).
const USER_ZIPF_S: f64 = 0.8;
const USER_UNIVERSE_PER_ROW: f64 = 0.215;
const PHRASE_ZIPF_S: f64 = 0.8;
const PHRASE_UNIVERSE_PER_ROW: f64 = 0.077;
const URL_ZIPF_S: f64 = 0.7;
const URL_UNIVERSE_PER_ROW: f64 = 0.225;
/// Users map onto this many addresses, so that ≈ 0.093 n distinct `ClientIP`s appear.
const IP_UNIVERSE_PER_ROW: f64 = 0.121;
/// Counters and regions per row, and their least number (small tables still have a tail).
const COUNTERS_PER_ROW: f64 = 6.5e-5;
const REGIONS_PER_ROW: f64 = 9.0e-5;
const MIN_COUNTERS: u64 = 100;
const MIN_REGIONS: u64 = 100;
/// The most popular counter's id, as in ClickBench's queries.
const TOP_COUNTER_ID: i32 = 62;

const SEARCH_EMPTY: f64 = 0.7;
const MOBILE_USERS: f64 = 0.1;
const REFRESH: f64 = 0.1;
const ADV_NONZERO: f64 = 0.02;

/// Multiplier of the rank → id scrambles (prime, so coprime with almost every universe size).
const SCRAMBLE: u64 = 2_654_435_761;
/// Random words drawn per row (some used as two 32-bit halves).
const WORDS_PER_ROW: u64 = 7;
/// Batch size of [`hits_mem_table`] and [`hits_gpu_table`].
const MEM_BATCH_ROWS: usize = 8192;

/// Weighted choices, weights in percent (each table sums to 100).
const SEARCH_ENGINES: [(i16, u32); 7] = [(2, 70), (3, 22), (1, 3), (13, 2), (4, 1), (5, 1), (6, 1)];
const ADV_ENGINES: [(i16, u32); 12] = [
    (2, 40),
    (27, 20),
    (13, 12),
    (45, 8),
    (44, 6),
    (3, 5),
    (52, 3),
    (50, 2),
    (41, 1),
    (12, 1),
    (16, 1),
    (4, 1),
];
const TRAFFIC_SOURCES: [(i16, u32); 11] = [
    (-1, 5),
    (0, 30),
    (1, 25),
    (2, 15),
    (3, 10),
    (4, 5),
    (5, 4),
    (6, 3),
    (7, 1),
    (8, 1),
    (9, 1),
];
const DESKTOP_WIDTHS: [(i16, u32); 10] = [
    (1366, 28),
    (1920, 22),
    (1280, 14),
    (1440, 8),
    (1600, 7),
    (1024, 6),
    (1680, 5),
    (1360, 4),
    (1536, 3),
    (2560, 3),
];
const MOBILE_WIDTHS: [(i16, u32); 6] = [
    (360, 35),
    (320, 25),
    (768, 15),
    (1280, 10),
    (480, 10),
    (1024, 5),
];
/// Mobile users' models, most popular first (drawn by a Zipf law of exponent 1).
pub const PHONE_MODELS: [&str; 24] = [
    "iPhone 5",
    "iPhone 4S",
    "iPad 2",
    "Galaxy S III",
    "iPhone 4",
    "iPad mini",
    "Galaxy S4",
    "Galaxy Note II",
    "Nexus 7",
    "Galaxy Tab 2",
    "HTC One",
    "Xperia Z",
    "Lumia 920",
    "Nexus 4",
    "Galaxy Ace",
    "Lumia 520",
    "Optimus G",
    "HTC Desire",
    "Motorola Razr",
    "Asha 311",
    "BlackBerry Z10",
    "Xperia S",
    "Galaxy Mini",
    "iPod touch",
];
/// Words a search phrase may start with: none is a vocabulary word (see [`push_digits`]), so
/// a phrase still names its rank alone.
const PHRASE_PREFIXES: [&str; 12] = [
    "",
    "",
    "",
    "buy ",
    "cheap ",
    "how to ",
    "download ",
    "watch ",
    "free ",
    "online ",
    "the best ",
    "reviews of ",
];
const SECTIONS: [&str; 12] = [
    "news", "catalog", "video", "forum", "search", "shop", "blog", "photo", "auto", "realty",
    "weather", "mail",
];
const TLDS: [&str; 4] = ["ru", "com", "net", "org"];
/// Syllables of the vocabulary: a word is two of them, a base-1024 digit.
const CONSONANTS: [u8; 8] = *b"bdklmnrs";
const VOWELS: [u8; 4] = *b"aeio";

/// What to generate: the table size and the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HitsSpec {
    pub rows: u64,
    pub seed: u64,
}

impl HitsSpec {
    /// `rows` hits with [`DEFAULT_SEED`].
    pub fn new(rows: u64) -> Self {
        Self {
            rows,
            seed: DEFAULT_SEED,
        }
    }

    pub fn with_seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    fn per_row(&self, ratio: f64, least: u64) -> u64 {
        ((self.rows as f64 * ratio).round() as u64).max(least)
    }

    /// Users the `UserID`s are drawn from (not all of them appear).
    pub fn user_universe(&self) -> u64 {
        self.per_row(USER_UNIVERSE_PER_ROW, 1)
    }

    /// Distinct `CounterID`s possible: `max(100, 6.5e-5 × rows)`.
    pub fn counters(&self) -> u64 {
        self.per_row(COUNTERS_PER_ROW, MIN_COUNTERS)
    }

    /// Distinct `RegionID`s possible: `max(100, 9e-5 × rows)`.
    pub fn regions(&self) -> u64 {
        self.per_row(REGIONS_PER_ROW, MIN_REGIONS)
    }
}

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    let field = |name: &str, data_type| Field::new(name, data_type, false);
    Arc::new(Schema::new(vec![
        field("WatchID", DataType::Int64),
        field("UserID", DataType::Int64),
        field("CounterID", DataType::Int32),
        field("RegionID", DataType::Int32),
        field("EventDate", DataType::Date32),
        field(
            "EventTime",
            DataType::Timestamp(TimeUnit::Microsecond, None),
        ),
        field("SearchPhrase", DataType::Utf8),
        field("URL", DataType::Utf8),
        field("AdvEngineID", DataType::Int16),
        field("ResolutionWidth", DataType::Int16),
        field("MobilePhoneModel", DataType::Utf8),
        field("IsRefresh", DataType::Int16),
        field("SearchEngineID", DataType::Int16),
        field("ClientIP", DataType::Int32),
        field("WindowClientWidth", DataType::Int16),
        field("TraficSourceID", DataType::Int16),
    ]))
});

/// Schema of the hits table (ClickBench's column names and types).
pub fn hits_schema() -> SchemaRef {
    Arc::clone(&SCHEMA)
}

/// The aggregate top-k queries over `hits` of `rows` rows, after ClickBench's: each selects
/// its sort key last (the benchmark compares answers by it), and the `HAVING` bound scales
/// with the rows as ClickBench's 100 000 does at 100M. Column names are quoted (`"UserID"`),
/// as SQL folds unquoted names to lower case.
pub fn queries(rows: u64) -> Vec<(String, String)> {
    let having = (rows / 1000).max(1);
    let q = [
        (
            "H01",
            "SELECT UserID, COUNT(*) AS c FROM hits GROUP BY UserID ORDER BY c DESC LIMIT 10",
        ),
        (
            "H02",
            "SELECT UserID, SearchPhrase, COUNT(*) AS c FROM hits GROUP BY UserID, SearchPhrase \
             ORDER BY c DESC LIMIT 10",
        ),
        (
            "H03",
            "SELECT RegionID, COUNT(DISTINCT UserID) AS u FROM hits GROUP BY RegionID \
             ORDER BY u DESC LIMIT 10",
        ),
        (
            "H04",
            "SELECT SearchPhrase, COUNT(*) AS c FROM hits WHERE SearchPhrase <> '' \
             GROUP BY SearchPhrase ORDER BY c DESC LIMIT 10",
        ),
        (
            "H05",
            "SELECT MobilePhoneModel, COUNT(DISTINCT UserID) AS u FROM hits \
             WHERE MobilePhoneModel <> '' GROUP BY MobilePhoneModel ORDER BY u DESC LIMIT 10",
        ),
        (
            "H06",
            "SELECT CounterID, COUNT(*) AS c, AVG(length(URL)) AS l FROM hits WHERE URL <> '' \
             GROUP BY CounterID HAVING COUNT(*) > {having} ORDER BY l DESC LIMIT 25",
        ),
        (
            "H07",
            "SELECT URL, COUNT(*) AS c FROM hits GROUP BY URL ORDER BY c DESC LIMIT 10",
        ),
        (
            "H08",
            "SELECT ClientIP, ClientIP - 1, ClientIP - 2, ClientIP - 3, COUNT(*) AS c FROM hits \
             GROUP BY ClientIP, ClientIP - 1, ClientIP - 2, ClientIP - 3 ORDER BY c DESC LIMIT 10",
        ),
        (
            "H09",
            "SELECT COUNT(*) AS pageviews, date_trunc('minute', EventTime) AS m FROM hits \
             WHERE CounterID = 62 AND EventDate >= '2013-07-14' AND EventDate <= '2013-07-15' \
             AND IsRefresh = 0 GROUP BY date_trunc('minute', EventTime) ORDER BY m \
             LIMIT 10 OFFSET 1000",
        ),
        (
            "H10",
            "SELECT WatchID, ClientIP, SUM(IsRefresh), AVG(ResolutionWidth), COUNT(*) AS c \
             FROM hits WHERE SearchPhrase <> '' GROUP BY WatchID, ClientIP ORDER BY c DESC LIMIT 10",
        ),
        (
            "H11",
            "SELECT WatchID, ClientIP, SUM(IsRefresh), AVG(ResolutionWidth), COUNT(*) AS c \
             FROM hits GROUP BY WatchID, ClientIP ORDER BY c DESC LIMIT 10",
        ),
        (
            "H12",
            "SELECT AdvEngineID, COUNT(*) AS c FROM hits WHERE AdvEngineID <> 0 \
             GROUP BY AdvEngineID ORDER BY c DESC LIMIT 10",
        ),
        (
            "H13",
            "SELECT RegionID, SUM(AdvEngineID), AVG(ResolutionWidth), COUNT(DISTINCT UserID), \
             COUNT(*) AS c FROM hits GROUP BY RegionID ORDER BY c DESC LIMIT 10",
        ),
    ];
    q.into_iter()
        .map(|(name, sql)| {
            let sql = quote_columns(&sql.replace("{having}", &having.to_string()));
            (name.to_string(), sql)
        })
        .collect()
}

/// `sql` with every word that names a column of [`hits_schema`] in double quotes.
fn quote_columns(sql: &str) -> String {
    let schema = hits_schema();
    let mut out = String::with_capacity(sql.len() + 32);
    let mut rest = sql;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic()) {
        out.push_str(&rest[..start]);
        let word = &rest[start..];
        let end = word
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(word.len());
        let (word, tail) = word.split_at(end);
        match schema.field_with_name(word) {
            Ok(_) => out.push_str(&format!("\"{word}\"")),
            Err(_) => out.push_str(word),
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// A Zipf law of exponent `s` < 1 over ranks `0..universe`, by its continuous inverse CDF:
/// rank = (1 + u·d)^(1/a) − 1, a = 1 − s.
#[derive(Debug, Clone, Copy)]
struct Zipf {
    universe: u64,
    d: f64,
    inv_a: f64,
}

impl Zipf {
    fn new(universe: u64, s: f64) -> Self {
        let a = 1.0 - s;
        Self {
            universe,
            d: ((universe + 1) as f64).powf(a) - 1.0,
            inv_a: 1.0 / a,
        }
    }

    #[inline]
    fn rank(&self, x: u64) -> u64 {
        let rank = ((1.0 + unit(x) * self.d).powf(self.inv_a) - 1.0) as u64;
        rank.min(self.universe - 1)
    }
}

/// The Zipf law of exponent 1 over `0..n`: rank = (n + 1)^u − 1.
#[inline]
fn zipf1(n: u64, x: u64) -> u64 {
    let rank = ((unit(x) * ((n + 1) as f64).ln()).exp() - 1.0) as u64;
    rank.min(n - 1)
}

/// A bijection of `0..n` (a multiplication by a unit modulo `n`), then `+ offset`.
#[inline]
fn permute(rank: u64, n: u64, offset: i64) -> i64 {
    let mult = match (SCRAMBLE % n, n.is_multiple_of(SCRAMBLE)) {
        (m, false) if m > 0 => m,
        _ => 1,
    };
    ((rank as u128 * mult as u128 % n as u128) as i64) + offset
}

/// A keyed bijection of 63-bit values (odd multiplications and xor-shifts modulo 2^63).
#[inline]
fn scramble63(x: u64, key: u64) -> i64 {
    const MASK: u64 = (1 << 63) - 1;
    let mut z = (x ^ key) & MASK;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9) & MASK;
    z ^= z >> 31;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB) & MASK;
    z ^= z >> 29;
    z as i64
}

/// The value of a weighted table for a 32-bit draw.
#[inline]
fn pick<T: Copy>(table: &[(T, u32)], draw32: u32) -> T {
    let v = ((draw32 as u64 * 100) >> 32) as u32;
    let mut acc = 0;
    for &(value, weight) in table {
        acc += weight;
        if v < acc {
            return value;
        }
    }
    table[table.len() - 1].0
}

/// Appends `rank` as vocabulary words (base-1024 digits, most significant first, at least
/// `least` of them) separated by `sep`. A word is consonant-vowel-consonant-vowel over fixed
/// letters, so the words, and with them the rank, can be read back: distinct ranks give
/// distinct text.
fn push_digits(out: &mut Vec<u8>, mut rank: u64, least: usize, sep: u8) {
    let mut digits = [0u16; 8];
    let mut n = 0;
    while n < least || rank > 0 {
        digits[n] = (rank & 1023) as u16;
        rank >>= 10;
        n += 1;
    }
    for (i, &d) in digits[..n].iter().rev().enumerate() {
        if i > 0 {
            out.push(sep);
        }
        for syllable in [d >> 5, d & 31] {
            out.push(CONSONANTS[(syllable >> 2) as usize]);
            out.push(VOWELS[(syllable & 3) as usize]);
        }
    }
}

/// Per-table constants of the generator.
struct Model {
    /// splitmix64 state before row 0.
    key: u64,
    rows: u64,
    users: Zipf,
    phrases: Zipf,
    urls: Zipf,
    counters: u64,
    regions: u64,
    ips: u64,
    search_empty: u32,
    mobile: u32,
    refresh: u32,
    adv: u32,
}

/// A user's fixed attributes.
struct User {
    id: i64,
    region: i32,
    ip: i32,
    /// Index into [`PHONE_MODELS`] of a mobile user.
    model: Option<usize>,
    width: i16,
}

impl Model {
    fn new(spec: &HitsSpec) -> Self {
        let ips = spec.per_row(IP_UNIVERSE_PER_ROW, 1).min(1 << 32);
        Self {
            key: mix64(spec.seed ^ 0x6869_7473_2013_0701),
            rows: spec.rows.max(1),
            users: Zipf::new(spec.user_universe(), USER_ZIPF_S),
            phrases: Zipf::new(spec.per_row(PHRASE_UNIVERSE_PER_ROW, 1), PHRASE_ZIPF_S),
            urls: Zipf::new(spec.per_row(URL_UNIVERSE_PER_ROW, 1), URL_ZIPF_S),
            counters: spec.counters(),
            regions: spec.regions(),
            ips,
            search_empty: threshold32(SEARCH_EMPTY),
            mobile: threshold32(MOBILE_USERS),
            refresh: threshold32(REFRESH),
            adv: threshold32(ADV_NONZERO),
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

    /// A keyed hash of an entity (`salt` tells users, pages and phrases apart).
    #[inline]
    fn hash(&self, salt: u64, rank: u64) -> u64 {
        mix64(self.key ^ salt.wrapping_mul(GAMMA) ^ mix64(rank))
    }

    fn user(&self, rank: u64) -> User {
        let h = self.hash(1, rank);
        let g = mix64(h);
        let mobile = (h as u32) < self.mobile;
        let model = mobile.then(|| zipf1(PHONE_MODELS.len() as u64, g) as usize);
        let widths: &[(i16, u32)] = if mobile {
            &MOBILE_WIDTHS
        } else {
            &DESKTOP_WIDTHS
        };
        // Users share addresses; an odd multiplier keeps distinct addresses distinct.
        let ip = (mix64(g) % self.ips) as u32;
        User {
            id: scramble63(rank, self.key),
            region: permute(zipf1(self.regions, mix64(h ^ 1)), self.regions, 1) as i32,
            ip: ip.wrapping_mul(0x9E37_79B1) as i32,
            model,
            width: pick(widths, (h >> 32) as u32),
        }
    }

    /// A page's counter: Zipf of exponent 1 over the counters, rank 0 being counter 62.
    fn counter(&self, page: u64) -> i32 {
        let rank = zipf1(self.counters, self.hash(2, page));
        permute(rank, self.counters, TOP_COUNTER_ID as i64) as i32
    }

    /// The URL of a page: its counter's site, a section, the page rank as words and, for half
    /// the pages, a query string; every part is a function of the page.
    fn push_url(&self, out: &mut Vec<u8>, page: u64, counter: i32) {
        let h = self.hash(3, page);
        let site = mix64(counter as u64 ^ self.key);
        out.extend_from_slice(b"http://");
        if site & 1 == 0 {
            out.extend_from_slice(b"www.");
        }
        push_digits(out, (site >> 8) & 1023, 1, b'-');
        push_digits(out, counter as u64, 1, b'-');
        out.push(b'.');
        out.extend_from_slice(TLDS[(site >> 20) as usize % TLDS.len()].as_bytes());
        out.push(b'/');
        out.extend_from_slice(SECTIONS[h as usize % SECTIONS.len()].as_bytes());
        out.push(b'/');
        push_digits(out, page, 3, b'-');
        out.extend_from_slice(b".html");
        if (h >> 8) & 1 == 0 {
            out.extend_from_slice(b"?from=");
            push_digits(out, (h >> 16) & 1023, 1, b'-');
            out.extend_from_slice(b"&page=");
            let page_no = (h >> 32) % 50 + 1;
            if page_no >= 10 {
                out.push(b'0' + (page_no / 10) as u8);
            }
            out.push(b'0' + (page_no % 10) as u8);
        }
    }

    /// A search phrase: a common prefix (a function of the phrase) and its rank as words.
    fn push_phrase(&self, out: &mut Vec<u8>, phrase: u64) {
        let h = self.hash(4, phrase);
        out.extend_from_slice(PHRASE_PREFIXES[h as usize % PHRASE_PREFIXES.len()].as_bytes());
        push_digits(out, phrase, 2, b' ');
    }

    /// Seconds since the epoch of row `i`, `frac32` placing it within its share of the month.
    #[inline]
    fn time(&self, i: u64, frac32: u32) -> i64 {
        let pos = i as f64 + frac32 as f64 * (1.0 / 4_294_967_296.0);
        let off = ((pos * SPAN_S as f64 / self.rows as f64) as i64).min(SPAN_S - 1);
        TIME_START_S + off
    }
}

/// Utf8 column under construction: values and offsets.
struct Strings {
    bytes: Vec<u8>,
    offsets: Vec<i32>,
}

impl Strings {
    fn with_capacity(rows: usize, bytes: usize) -> Self {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        Self {
            bytes: Vec::with_capacity(bytes),
            offsets,
        }
    }

    /// Ends the current value.
    fn end(&mut self) -> Result<()> {
        let end = i32::try_from(self.bytes.len()).map_err(|_| {
            DataFusionError::Execution("hits: a batch's strings exceed 2 GiB".into())
        })?;
        self.offsets.push(end);
        Ok(())
    }

    fn finish(self) -> Result<ArrayRef> {
        let offsets = OffsetBuffer::new(ScalarBuffer::from(self.offsets));
        Ok(Arc::new(StringArray::try_new(
            offsets,
            Buffer::from_vec(self.bytes),
            None,
        )?))
    }
}

/// Generates rows `[start, start + len)` of the table described by `spec`.
pub fn generate_rows(spec: &HitsSpec, start: u64, len: usize) -> Result<RecordBatch> {
    let end = start
        .checked_add(len as u64)
        .filter(|&end| end <= spec.rows)
        .ok_or_else(|| {
            DataFusionError::Execution(format!(
                "hits: rows {start}..{start}+{len} are outside the table of {} rows",
                spec.rows
            ))
        })?;
    let m = Model::new(spec);
    let mut watch = Vec::with_capacity(len);
    let mut user_ids = Vec::with_capacity(len);
    let mut counters = Vec::with_capacity(len);
    let mut regions = Vec::with_capacity(len);
    let mut dates = Vec::with_capacity(len);
    let mut times = Vec::with_capacity(len);
    let mut adv = Vec::with_capacity(len);
    let mut widths = Vec::with_capacity(len);
    let mut refresh = Vec::with_capacity(len);
    let mut engines = Vec::with_capacity(len);
    let mut ips = Vec::with_capacity(len);
    let mut windows = Vec::with_capacity(len);
    let mut sources = Vec::with_capacity(len);
    let mut phrases = Strings::with_capacity(len, len * 8);
    let mut urls = Strings::with_capacity(len, len * 64);
    let mut models = Strings::with_capacity(len, len);
    for i in start..end {
        let w: [u64; WORDS_PER_ROW as usize] = std::array::from_fn(|j| m.word(i, j as u64));
        watch.push(scramble63(i, !m.key));
        let user = m.user(m.users.rank(w[0]));
        user_ids.push(user.id);
        regions.push(user.region);
        ips.push(user.ip);
        widths.push(user.width);
        if let Some(model) = user.model {
            models
                .bytes
                .extend_from_slice(PHONE_MODELS[model].as_bytes());
        }
        models.end()?;
        let seconds = m.time(i, w[1] as u32);
        times.push(seconds * 1_000_000);
        dates.push(DAY_START + ((seconds - TIME_START_S) / DAY_S) as i32);
        refresh.push(i16::from(((w[1] >> 32) as u32) < m.refresh));
        let adv_draw = w[5] as u32;
        adv.push(match adv_draw < m.adv {
            true => pick(&ADV_ENGINES, mix64(w[5]) as u32),
            false => 0,
        });
        if (w[2] as u32) < m.search_empty {
            engines.push(0);
        } else {
            engines.push(pick(&SEARCH_ENGINES, (w[2] >> 32) as u32));
            m.push_phrase(&mut phrases.bytes, m.phrases.rank(w[3]));
        }
        phrases.end()?;
        let page = m.urls.rank(w[4]);
        let counter = m.counter(page);
        counters.push(counter);
        m.push_url(&mut urls.bytes, page, counter);
        urls.end()?;
        let share = 0.55 + 0.45 * unit(w[6]);
        windows.push((f64::from(user.width) * share) as i16);
        sources.push(pick(&TRAFFIC_SOURCES, (w[5] >> 32) as u32));
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(watch)),
        Arc::new(Int64Array::from(user_ids)),
        Arc::new(Int32Array::from(counters)),
        Arc::new(Int32Array::from(regions)),
        Arc::new(Date32Array::from(dates)),
        Arc::new(TimestampMicrosecondArray::from(times)),
        phrases.finish()?,
        urls.finish()?,
        Arc::new(Int16Array::from(adv)),
        Arc::new(Int16Array::from(widths)),
        models.finish()?,
        Arc::new(Int16Array::from(refresh)),
        Arc::new(Int16Array::from(engines)),
        Arc::new(Int32Array::from(ips)),
        Arc::new(Int16Array::from(windows)),
        Arc::new(Int16Array::from(sources)),
    ];
    Ok(RecordBatch::try_new(hits_schema(), columns)?)
}

/// The table split into `partitions` contiguous row ranges (partition `p` holds the p-th
/// range, so concatenating partitions in order gives rows `0..rows`), each as batches of at
/// most `batch_size` rows. Generated in parallel.
pub fn hits_partitions(
    spec: &HitsSpec,
    partitions: usize,
    batch_size: usize,
) -> Result<Vec<Vec<RecordBatch>>> {
    shared::partitions(
        TABLE_NAME,
        spec.rows,
        partitions,
        batch_size,
        |start, len| generate_rows(spec, start, len),
    )
}

/// The table in memory, in `partitions` partitions of 8192-row batches.
pub fn hits_mem_table(spec: &HitsSpec, partitions: usize) -> Result<Arc<MemTable>> {
    let parts = hits_partitions(spec, partitions, MEM_BATCH_ROWS)?;
    Ok(Arc::new(MemTable::try_new(hits_schema(), parts)?))
}

/// The table in memory as a [`crate::GpuTable`], in `partitions` partitions of 8192-row
/// batches.
pub fn hits_gpu_table(spec: &HitsSpec, partitions: usize) -> Result<Arc<crate::GpuTable>> {
    let parts = hits_partitions(spec, partitions, MEM_BATCH_ROWS)?;
    Ok(Arc::new(crate::GpuTable::try_new(hits_schema(), parts)?))
}

/// Writes the table as `hits-00000.parquet`, `hits-00001.parquet`, … of `rows_per_file` rows
/// each (zstd, ~1M-row row groups) into `out_dir`, as the tweets' `write_parquet` does (the
/// same refusal of a directory holding `hits-*.parquet` files, the same progress).
pub fn write_parquet(
    spec: &HitsSpec,
    out_dir: &Path,
    rows_per_file: u64,
    show_progress: bool,
) -> Result<WriteSummary> {
    let table = shared::Table {
        name: TABLE_NAME,
        schema: hits_schema(),
        rows: spec.rows,
        generate: |start, len| generate_rows(spec, start, len),
    };
    shared::write_parquet(&table, out_dir, rows_per_file, show_progress)
}

#[cfg(test)]
mod tests;
