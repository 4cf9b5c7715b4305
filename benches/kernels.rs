//! Kernel sweep of the device selection: every (n, k, key type, distribution, algorithm),
//! timed with CUDA events on device-resident data, and reported as a multiple of
//! the *read floor* measured in the same run (a kernel that only reads the same key bytes,
//! kernels/read_floor.cu).
//!
//! ```text
//! cargo bench --bench kernels -- [--n LIST] [--k LIST] [--keys LIST] [--dist LIST]
//!     [--algo LIST] [--reps R] [--csv FILE] [--quick]
//! ```
//!
//! LISTs are comma-separated; sizes take `2^20` or plain integers. Defaults: n ∈ {2^20, 2^24,
//! 2^27, 2^29}, k ∈ {1, 8, 32, 256, 1024, 4096, 2^16, 2^20} (k ≤ n), keys f32,i32,f64,i64,
//! every distribution, algorithms bitonic,radix, R = 5. `--quick`: n ∈ {2^20, 2^24},
//! k ∈ {32, 1024, 2^16}, distributions uniform,all-equal (explicit flags still override).
//! `--budget S`: start no new data set after S seconds (the table still comes last).
//! `--host-check`: no GPU needed; checks the generators, the oracle and the result checks
//! (which must reject corrupted outputs) on the host, and prints host costs at n = 2^24.
//! `--sel LIST` (default 1): below 1, each case first runs a filter that keeps that fraction of
//! the rows (a hash of the row id, `TopKEngine::filter_fraction`) and selects among the kept
//! (key, row id) pairs; both are timed, and the check counts kept rows only.
//! `--cost-model` (`--recalibrate` to measure the calibration again): predicts every case with
//! the calibrated cost model (CSV columns `predicted_ms`, `ties`) and ends with its report: how
//! often the predicted-fastest algorithm is within 10% of the fastest measured, the worst
//! regret, and the median |predicted − measured| / measured.
//! `--replay CSV --calibration FILE`: that report for an earlier run's CSV, predicted anew with
//! a calibration file; no GPU needed.
//!
//! Per (n, key type, distribution) the keys are generated on the host (xorshift, deterministic),
//! encoded with [`KeyLayout::encode`] (ascending, not nullable: f32/i32 are 32-bit composites,
//! f64/i64 64-bit), and uploaded once with row ids 0..n; every k and algorithm reuses that
//! upload. Each case runs 1 warm-up and R timed repetitions of the whole device selection
//! ([`TopKEngine::enqueue_select`] + [`TopKEngine::finish_reporting`]), returning sorted
//! (key, row id) pairs; no host transfer of the data or the result in the timed region, though
//! the radix path reads its 1160-byte control block back once, as the engine always does. A
//! sampled selection of small k has no read-back inside: its status is read after its last
//! kernel, like the result, and only when that check starts more device work (a missed
//! estimate) does the time run to the end of that work. The L2 cache is flushed before every
//! repetition. The first timed repetition's output is checked on the host: every output pair
//! must be a real input pair, strictly ascending by (key, row id), and the min(n, k) smallest:
//! equal to a host sort's prefix for n ≤ 2^24, else proven by counting (in parallel) the input
//! pairs below the last output pair. Any mismatch prints WRONG and makes the exit status 1.
//!
//! Without a usable GPU (or NVRTC) it prints `no GPU: <reason>` and exits 0.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cudarc::driver::result;
use datafusion::arrow::array::{ArrayRef, Float32Array, Float64Array, Int32Array, Int64Array};
use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::datatypes::DataType;
use datafusion_gpu_topk::internal::cost::CostModel;
use datafusion_gpu_topk::internal::cost::calibration::{
    calibration, model_from_file as calibration_model,
};
use datafusion_gpu_topk::internal::cost::validation::{
    Assessment, GridPoint, assess, parse_grid_csv,
};
use datafusion_gpu_topk::internal::device::GpuTimer;
use datafusion_gpu_topk::internal::device::measure::{
    FLUSH_BYTES, ReadFloor, fraction_cut, fraction_hash, median, time_selection,
};
use datafusion_gpu_topk::internal::device::{
    DeviceAlgorithm, DevicePairs, GpuDevice, GpuError, GpuResult, GpuStatus, KeyWidth, TopKEngine,
    gpu_status,
};
use datafusion_gpu_topk::internal::keys::{EncodedKeys, KeyLayout, KeySpec};

// ---- command line -------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyType {
    F32,
    I32,
    F64,
    I64,
}

impl KeyType {
    const ALL: [KeyType; 4] = [KeyType::F32, KeyType::I32, KeyType::F64, KeyType::I64];

    fn name(self) -> &'static str {
        match self {
            KeyType::F32 => "f32",
            KeyType::I32 => "i32",
            KeyType::F64 => "f64",
            KeyType::I64 => "i64",
        }
    }

    fn data_type(self) -> DataType {
        match self {
            KeyType::F32 => DataType::Float32,
            KeyType::I32 => DataType::Int32,
            KeyType::F64 => DataType::Float64,
            KeyType::I64 => DataType::Int64,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, KeyType::F32 | KeyType::F64)
    }

    fn kind(self) -> KeyWidth {
        match self {
            KeyType::F32 | KeyType::I32 => KeyWidth::W32,
            KeyType::F64 | KeyType::I64 => KeyWidth::W64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dist {
    /// Floats Uniform[0, 1); integers over their whole range.
    Uniform,
    /// One value (not zero).
    AllEqual,
    /// Floats Uniform[128.6, 128.7]; integers 4096 values from 1 000 000.
    Narrow,
    /// Row i holds i − n/2 (as f32 beyond 2^24: ascending with ties).
    SortedAsc,
    /// Row i holds n/2 − i.
    SortedDesc,
    /// −count, count Zipf-like (P(count ≥ c) ≈ c^−1.1, half of them 0): the top-k by ascending
    /// −count is ORDER BY count DESC over heavy ties.
    ZipfTies,
    /// Floats only: Uniform[−1, 1) with 10% NaN of either sign and random payloads (−NaN sorts
    /// first, +NaN last).
    NanMix,
}

impl Dist {
    const ALL: [Dist; 7] = [
        Dist::Uniform,
        Dist::AllEqual,
        Dist::Narrow,
        Dist::SortedAsc,
        Dist::SortedDesc,
        Dist::ZipfTies,
        Dist::NanMix,
    ];

    fn name(self) -> &'static str {
        match self {
            Dist::Uniform => "uniform",
            Dist::AllEqual => "all-equal",
            Dist::Narrow => "narrow",
            Dist::SortedAsc => "sorted-asc",
            Dist::SortedDesc => "sorted-desc",
            Dist::ZipfTies => "zipf-ties",
            Dist::NanMix => "nan-mix",
        }
    }

    fn applies_to(self, key: KeyType) -> bool {
        self != Dist::NanMix || key.is_float()
    }
}

const ALGORITHMS: [DeviceAlgorithm; 4] = [
    DeviceAlgorithm::Bitonic,
    DeviceAlgorithm::Radix,
    DeviceAlgorithm::Sample,
    DeviceAlgorithm::Delegate,
];

#[derive(Debug)]
struct Options {
    ns: Vec<usize>,
    ks: Vec<usize>,
    keys: Vec<KeyType>,
    dists: Vec<Dist>,
    algos: Vec<DeviceAlgorithm>,
    reps: usize,
    /// Filter selectivities: below 1, a filter pass keeps that fraction of the rows (a hash of
    /// the row id) and the selection runs over the kept pairs; both are timed.
    sels: Vec<f64>,
    /// Predict every case with the calibrated cost model and report its choices.
    cost_model: bool,
    /// Measure the calibration again rather than reading the cached one.
    recalibrate: bool,
    csv: Option<String>,
    /// Start no new (n, key type, distribution) after this many seconds.
    budget: Option<f64>,
}

const USAGE: &str = "usage: kernels [--n LIST] [--k LIST] [--keys LIST] [--dist LIST] \
                     [--algo LIST] [--sel LIST] [--reps R] [--csv FILE] [--quick] [--budget SECONDS] \
                     [--cost-model] [--recalibrate] [--host-check]";

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let value = if let Some(e) = s.strip_prefix("2^") {
        let e: u32 = e.parse().map_err(|_| format!("bad size '{s}'"))?;
        1usize
            .checked_shl(e)
            .filter(|_| e < 63)
            .ok_or_else(|| format!("size '{s}' too large"))?
    } else {
        s.replace('_', "")
            .parse()
            .map_err(|_| format!("bad size '{s}'"))?
    };
    if value == 0 {
        return Err(format!("size '{s}' must be positive"));
    }
    Ok(value)
}

fn parse_list<T>(s: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    let items: Vec<T> = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| item(p.trim()))
        .collect::<Result<_, _>>()?;
    if items.is_empty() {
        return Err(format!("empty list '{s}'"));
    }
    Ok(items)
}

fn by_name<T: Copy>(all: &[T], name: impl Fn(T) -> &'static str, s: &str) -> Result<T, String> {
    all.iter().copied().find(|&v| name(v) == s).ok_or_else(|| {
        let names: Vec<&str> = all.iter().map(|&v| name(v)).collect();
        format!("unknown '{s}' (one of {})", names.join(", "))
    })
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = if quick {
        Options {
            ns: vec![1 << 20, 1 << 24],
            ks: vec![32, 1024, 1 << 16],
            keys: KeyType::ALL.to_vec(),
            dists: vec![Dist::Uniform, Dist::AllEqual],
            algos: ALGORITHMS.to_vec(),
            reps: 5,
            sels: vec![1.0],
            cost_model: false,
            recalibrate: false,
            csv: None,
            budget: None,
        }
    } else {
        Options {
            ns: vec![1 << 20, 1 << 24, 1 << 27, 1 << 29],
            ks: vec![1, 8, 32, 256, 1024, 4096, 1 << 16, 1 << 20],
            keys: KeyType::ALL.to_vec(),
            dists: Dist::ALL.to_vec(),
            algos: ALGORITHMS.to_vec(),
            reps: 5,
            sels: vec![1.0],
            cost_model: false,
            recalibrate: false,
            csv: None,
            budget: None,
        }
    };
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--quick" {
            i += 1;
            continue;
        }
        if flag == "--cost-model" || flag == "--recalibrate" {
            o.cost_model = true;
            o.recalibrate |= flag == "--recalibrate";
            i += 1;
            continue;
        }
        // `cargo bench` passes --bench to harness-less benches.
        if flag == "--bench" {
            i += 1;
            continue;
        }
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.to_string());
        }
        let value = args
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag {
            "--n" => o.ns = parse_list(value, parse_size)?,
            "--k" => o.ks = parse_list(value, parse_size)?,
            "--keys" => o.keys = parse_list(value, |s| by_name(&KeyType::ALL, KeyType::name, s))?,
            "--dist" => o.dists = parse_list(value, |s| by_name(&Dist::ALL, Dist::name, s))?,
            "--algo" => {
                o.algos = parse_list(value, |s| by_name(&ALGORITHMS, DeviceAlgorithm::name, s))?
            }
            "--reps" => {
                o.reps = value
                    .parse()
                    .ok()
                    .filter(|&r| r > 0)
                    .ok_or_else(|| format!("bad --reps '{value}'"))?
            }
            "--sel" => {
                o.sels = parse_list(value, |s| {
                    s.parse::<f64>()
                        .ok()
                        .filter(|&f| f > 0.0 && f <= 1.0)
                        .ok_or_else(|| format!("bad selectivity '{s}' (0 < sel <= 1)"))
                })?
            }
            "--csv" => o.csv = Some(value.clone()),
            "--budget" => {
                o.budget = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|&b: &f64| b > 0.0)
                        .ok_or_else(|| format!("bad --budget '{value}'"))?,
                )
            }
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
        i += 2;
    }
    Ok(o)
}

fn size_name(v: usize) -> String {
    if v.is_power_of_two() && v >= 1024 {
        format!("2^{}", v.trailing_zeros())
    } else {
        v.to_string()
    }
}

// ---- deterministic data -------------------------------------------------------------------------

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xorshift64*.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        Self(splitmix64(seed).max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Rows per generation chunk (each has its own generator, so the data does not depend on the
/// number of threads).
const GEN_CHUNK: usize = 1 << 22;

/// `−count` of the Zipf-like counts.
fn zipf_value(rng: &mut XorShift) -> i64 {
    let u = 1.0 - rng.unit(); // (0, 1]
    let count = (u.powf(-1.0 / 1.1) - 1.0).floor().min(1e9);
    -(count as i64)
}

/// Rows `[start, start + len)` of the column (of `n` rows) as an Arrow array.
fn gen_chunk(key: KeyType, dist: Dist, n: usize, start: usize, len: usize, seed: u64) -> ArrayRef {
    let mut rng = XorShift::new(seed ^ (start as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let half = (n / 2) as i64;
    let rows = start..start + len;
    if key.is_float() {
        // (value, or a NaN with this sign and payload source)
        let mut values: Vec<Result<f64, u64>> = Vec::with_capacity(len);
        for i in rows {
            let i = i as i64;
            values.push(match dist {
                Dist::Uniform => Ok(rng.unit()),
                Dist::AllEqual => Ok(42.5),
                Dist::Narrow => Ok(128.6 + 0.1 * rng.unit()),
                Dist::SortedAsc => Ok((i - half) as f64),
                Dist::SortedDesc => Ok((half - i) as f64),
                Dist::ZipfTies => Ok(zipf_value(&mut rng) as f64),
                Dist::NanMix => {
                    let r = rng.next();
                    if r.is_multiple_of(10) {
                        Err(rng.next())
                    } else {
                        Ok(2.0 * rng.unit() - 1.0)
                    }
                }
            });
        }
        match key {
            KeyType::F32 => Arc::new(Float32Array::from(
                values
                    .into_iter()
                    .map(|v| match v {
                        Ok(x) => x as f32,
                        // sign | all-ones exponent | non-zero 23-bit payload
                        Err(r) => f32::from_bits(
                            ((r >> 63) as u32) << 31
                                | 0x7F80_0000
                                | ((r as u32) & 0x7F_FFFF).max(1),
                        ),
                    })
                    .collect::<Vec<f32>>(),
            )),
            _ => Arc::new(Float64Array::from(
                values
                    .into_iter()
                    .map(|v| match v {
                        Ok(x) => x,
                        Err(r) => f64::from_bits(
                            (r >> 63) << 63
                                | 0x7FF0_0000_0000_0000
                                | (r & 0xF_FFFF_FFFF_FFFF).max(1),
                        ),
                    })
                    .collect::<Vec<f64>>(),
            )),
        }
    } else {
        let wide = key == KeyType::I64;
        let values: Vec<i64> = rows
            .map(|i| {
                let i = i as i64;
                match dist {
                    Dist::Uniform if wide => rng.next() as i64,
                    Dist::Uniform => i64::from(rng.next() as u32 as i32),
                    Dist::AllEqual => 0x0123_4567,
                    Dist::Narrow => 1_000_000 + (rng.next() % 4096) as i64,
                    Dist::SortedAsc => i - half,
                    Dist::SortedDesc => half - i,
                    Dist::ZipfTies | Dist::NanMix => zipf_value(&mut rng),
                }
            })
            .collect();
        if wide {
            Arc::new(Int64Array::from(values))
        } else {
            Arc::new(Int32Array::from(
                values.into_iter().map(|v| v as i32).collect::<Vec<i32>>(),
            ))
        }
    }
}

/// A key word in the device layout (the composite, right-aligned).
trait Word: Copy + Ord + Send + Sync + Default + std::fmt::Debug + 'static {
    const BYTES: usize;
    fn from_composite(v: u64) -> Self;
    fn from_le_slice(b: &[u8]) -> Self;
    fn to_u64(self) -> u64;
}

impl Word for u32 {
    const BYTES: usize = 4;
    fn from_composite(v: u64) -> Self {
        u32::try_from(v).expect("a 32-bit layout's composite fits 32 bits")
    }
    fn from_le_slice(b: &[u8]) -> Self {
        u32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
}

impl Word for u64 {
    const BYTES: usize = 8;
    fn from_composite(v: u64) -> Self {
        v
    }
    fn from_le_slice(b: &[u8]) -> Self {
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
    fn to_u64(self) -> u64 {
        self
    }
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |p| p.get())
}

/// The encoded keys of a column: generated and encoded in parallel chunks.
fn generate<W: Word>(key: KeyType, dist: Dist, n: usize, seed: u64) -> Result<Vec<W>, String> {
    let spec = KeySpec::new(
        key.data_type(),
        SortOptions {
            descending: false,
            nulls_first: false,
        },
        false,
    );
    let layout = KeyLayout::try_new(vec![spec])?;
    if KeyWidth::for_total_bits(layout.total_bits()) != key.kind()
        || key.kind().key_bytes() != W::BYTES
    {
        return Err(format!(
            "{} keys do not encode to {} bytes",
            key.name(),
            W::BYTES
        ));
    }
    let mut out = vec![W::default(); n];
    let next = AtomicUsize::new(0);
    let chunks: Vec<&mut [W]> = out.chunks_mut(GEN_CHUNK).collect();
    let chunks: Vec<std::sync::Mutex<&mut [W]>> =
        chunks.into_iter().map(std::sync::Mutex::new).collect();
    let error = std::sync::Mutex::new(None::<String>);
    std::thread::scope(|s| {
        for _ in 0..threads().min(chunks.len()) {
            s.spawn(|| {
                loop {
                    let c = next.fetch_add(1, Ordering::Relaxed);
                    let Some(chunk) = chunks.get(c) else { break };
                    let mut chunk = chunk.lock().unwrap_or_else(|e| e.into_inner());
                    let start = c * GEN_CHUNK;
                    let array = gen_chunk(key, dist, n, start, chunk.len(), seed);
                    match layout.encode(&[array]) {
                        Ok(EncodedKeys::W64(v)) if v.len() == chunk.len() => {
                            for (o, &x) in chunk.iter_mut().zip(&v) {
                                *o = W::from_composite(x);
                            }
                        }
                        Ok(_) => {
                            *error.lock().unwrap_or_else(|e| e.into_inner()) =
                                Some("unexpected encoding width".into());
                        }
                        Err(e) => {
                            *error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                        }
                    }
                }
            });
        }
    });
    match error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// The words as their little-endian bytes (the device layout) without a copy.
fn as_bytes<W: Word>(words: &[W]) -> &[u8] {
    const {
        assert!(
            cfg!(target_endian = "little"),
            "the device layout is little-endian"
        )
    };
    // SAFETY: `W` is u32 or u64 (plain integers without padding); the byte slice covers exactly
    // the same memory and lives as long as `words`; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

// ---- host checks --------------------------------------------------------------------------------

/// Row ids of the `kmax` smallest (key, row id) pairs, sorted (row ids are 0..n).
fn oracle<W: Word>(keys: &[W], kmax: usize) -> Vec<u32> {
    let mut pairs: Vec<(W, u32)> = keys
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, i as u32))
        .collect();
    let kmax = kmax.min(pairs.len());
    if kmax == 0 {
        return vec![];
    }
    if kmax < pairs.len() {
        pairs.select_nth_unstable(kmax - 1);
    }
    pairs.truncate(kmax);
    pairs.sort_unstable();
    pairs.into_iter().map(|(_, id)| id).collect()
}

/// How many input pairs (keys[i], i) are below (key, id); in parallel.
fn count_below<W: Word>(keys: &[W], key: W, id: u64) -> usize {
    count_kept_below(keys, key, id, None)
}

/// Pairs below (key, id) among the rows a fraction filter with this cut keeps (all: `None`).
fn count_kept_below<W: Word>(keys: &[W], key: W, id: u64, cut: Option<u32>) -> usize {
    let part = keys.len().div_ceil(threads()).max(1 << 16);
    std::thread::scope(|s| {
        let handles: Vec<_> = keys
            .chunks(part)
            .enumerate()
            .map(|(c, chunk)| {
                s.spawn(move || {
                    let base = (c * part) as u64;
                    chunk
                        .iter()
                        .enumerate()
                        .filter(|&(i, &k)| {
                            let row = base + i as u64;
                            (k < key || (k == key && row < id))
                                && cut.is_none_or(|c| fraction_hash(row) < c)
                        })
                        .count()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("count thread"))
            .sum()
    })
}

/// Checks a selection's output (see the module documentation).
fn check<W: Word>(
    keys: &[W],
    oracle: Option<&[u32]>,
    k: usize,
    ids: &[u64],
    out_keys: &[W],
) -> Result<(), String> {
    check_kept(keys, oracle, None, k, ids, out_keys)
}

/// [`check`] of a selection among the rows a fraction filter kept: `kept` is (cut, rows
/// kept); every output row must be a kept one, and the counting check counts kept rows only.
fn check_kept<W: Word>(
    keys: &[W],
    oracle: Option<&[u32]>,
    kept: Option<(u32, usize)>,
    k: usize,
    ids: &[u64],
    out_keys: &[W],
) -> Result<(), String> {
    let n = keys.len();
    let m = kept.map_or(n, |(_, rows)| rows).min(k);
    if ids.len() != m || out_keys.len() != m {
        return Err(format!(
            "{} ids and {} keys, expected {m}",
            ids.len(),
            out_keys.len()
        ));
    }
    for (j, (&id, &key)) in ids.iter().zip(out_keys).enumerate() {
        if id >= n as u64 {
            return Err(format!("output {j}: row id {id} out of range (n = {n})"));
        }
        if let Some((cut, _)) = kept
            && fraction_hash(id) >= cut
        {
            return Err(format!("output {j}: row {id} did not pass the filter"));
        }
        if keys[id as usize] != key {
            return Err(format!(
                "output {j}: key {key:?} but row {id} holds {:?}",
                keys[id as usize]
            ));
        }
        if j > 0 && (out_keys[j - 1], ids[j - 1]) >= (key, id) {
            return Err(format!(
                "output not strictly ascending at {j}: ({:?}, {}) then ({key:?}, {id})",
                out_keys[j - 1],
                ids[j - 1]
            ));
        }
    }
    if m == 0 {
        return Ok(());
    }
    match oracle.filter(|_| kept.is_none()) {
        Some(expected) => {
            if let Some(j) = (0..m).find(|&j| u64::from(expected[j]) != ids[j]) {
                return Err(format!(
                    "output {j}: row id {} but the host sort has {}",
                    ids[j], expected[j]
                ));
            }
        }
        None => {
            // m distinct real pairs, ascending; exactly m − 1 input pairs below the last one
            // means they are the m smallest.
            let below = count_kept_below(keys, out_keys[m - 1], ids[m - 1], kept.map(|k| k.0));
            if below != m - 1 {
                return Err(format!(
                    "{below} input pairs are below the last output pair, expected {}",
                    m - 1
                ));
            }
        }
    }
    Ok(())
}

// ---- device helpers -----------------------------------------------------------------------------

/// Host sort oracle up to this n; beyond, the counting check.
const ORACLE_MAX_N: usize = 1 << 24;

/// Median read-floor time over the keys of `pairs`, and the maximum word the kernel saw.
fn measure_floor(
    floor: &ReadFloor,
    engine: &mut TopKEngine,
    pairs: &DevicePairs,
    n: usize,
    reps: usize,
) -> GpuResult<(f64, u64)> {
    let width = pairs.kind().key_bytes();
    let mut times = Vec::with_capacity(reps);
    let mut seen = 0;
    for rep in 0..=reps {
        let ms = floor.time_read(engine, pairs.key_at(0), n, width)?;
        if rep > 0 {
            times.push(ms);
        }
        let value = floor.result(engine, width)?;
        if rep > 0 && value != seen {
            return Err(GpuError(format!(
                "read floor gave {value:#x}, then {seen:#x} before"
            )));
        }
        seen = value;
    }
    Ok((median(&mut times), seen))
}

/// Device bytes one (n, key width) needs: the input pairs, the radix scratch (2 × n pairs),
/// bitonic's first-round output (≤ n/4 pairs), the sort of ≤ 2 k pairs (twice), the flush
/// buffer, and 1 GiB of slack.
fn device_bytes_needed(n: usize, kind: KeyWidth, kmax: usize, sel: f64) -> usize {
    let pair = kind.key_bytes() + 8;
    let kmax = kmax.min(n).next_power_of_two();
    // A filter's kept pairs (below selectivity 1) and their selection's scratch.
    let kept = if sel < 1.0 { 3.2 * sel * n as f64 } else { 0.0 } as usize;
    (n + kept) * pair * 3 + (n / 4) * pair + 4 * kmax * pair + FLUSH_BYTES + (1 << 30)
}

/// Completes a measured row: times, or the error that stopped the case, and the verdict.
fn finish_row(
    row: &mut Row,
    outcome: GpuResult<()>,
    mut times: Vec<f64>,
    verdict: Result<(), String>,
) {
    match outcome {
        Err(e) => row.ok = format!("ERROR {e}"),
        Ok(()) => {
            let lo = times.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            row.times = Some((median(&mut times), lo, hi));
            row.ok = match verdict {
                Ok(()) => "ok".into(),
                Err(e) => format!("WRONG {e}"),
            };
        }
    }
}

/// Share of a sorted key sample that agrees with its element at `rank` above the lowest byte
/// ([`Case::ties`]; 0 when that element is alone there).
fn tie_share<W: Word>(sample: &[W], rank: usize) -> f64 {
    let Some(&key) = sample.get(rank.min(sample.len().saturating_sub(1))) else {
        return 0.0;
    };
    let high = key.to_u64() >> 8;
    let equal = sample.iter().filter(|w| w.to_u64() >> 8 == high).count();
    if equal <= 1 {
        0.0
    } else {
        equal as f64 / sample.len() as f64
    }
}

/// The grid point of a measured row (`kept`: the rows its filter kept).
fn grid_point(row: &Row, kept: usize) -> GridPoint {
    GridPoint {
        n: row.n,
        k: row.k,
        kind: row.key.kind(),
        key: row.key.name().to_string(),
        dist: row.dist.name().to_string(),
        sel: row.sel,
        kept,
        ties: row.ties,
        algorithm: row.algo,
        measured_s: row.times.map_or(f64::NAN, |t| t.0 / 1e3),
    }
}

/// The cost model's report (see [`assess`]).
fn model_report(a: &Assessment) -> String {
    let mut t = String::new();
    for miss in &a.misses {
        let _ = writeln!(t, "  {miss}");
    }
    let _ = writeln!(
        t,
        "cost model: choice within 10% of the fastest measured in {}/{} cases ({:.1}%); worst \
         regret {:.1}% ({})",
        a.within_10,
        a.cases,
        100.0 * a.within_share(),
        100.0 * a.worst_regret,
        a.worst
    );
    let _ = writeln!(
        t,
        "cost model: median |predicted - measured| / measured {:.1}% over {} (case, algorithm) \
         pairs, {:.1}% over the chosen ones",
        100.0 * a.median_error,
        a.points,
        100.0 * a.median_chosen_error
    );
    t
}

// ---- the sweep ----------------------------------------------------------------------------------

struct Row {
    n: usize,
    k: usize,
    key: KeyType,
    dist: Dist,
    algo: DeviceAlgorithm,
    /// Filter selectivity (1: no filter).
    sel: f64,
    /// (median, min, max) ms; `None`: n/a.
    times: Option<(f64, f64, f64)>,
    /// The cost model's prediction, ms (with `--cost-model`), and the tie share it was told.
    predicted_ms: Option<f64>,
    ties: f64,
    floor_ms: f64,
    ok: String,
}

struct Sweep {
    opts: Options,
    started: Instant,
    /// Data sets left out because the budget ran out.
    over_budget: usize,
    device: Arc<GpuDevice>,
    rows: Vec<Row>,
    wrong: usize,
    csv: Option<std::fs::File>,
    /// The calibrated cost model (with `--cost-model`).
    model: Option<CostModel>,
}

impl Sweep {
    fn record(&mut self, row: Row) {
        let (median, min, max) = row.times.unwrap_or((f64::NAN, f64::NAN, f64::NAN));
        let key_bytes = row.n * row.key.kind().key_bytes();
        let line = format!(
            "{},{},{},{},{},{},{:.5},{:.5},{:.5},{:.5},{:.3},{:.1},{},{},{},{}",
            row.n,
            row.k,
            row.key.name(),
            row.dist.name(),
            row.algo.name(),
            self.opts.reps,
            median,
            min,
            max,
            row.floor_ms,
            median / row.floor_ms,
            key_bytes as f64 / (row.floor_ms * 1e6),
            row.ok.replace(',', ";"),
            row.sel,
            row.predicted_ms
                .map_or(String::new(), |p| format!("{p:.5}")),
            row.ties
        );
        if let Some(f) = &mut self.csv
            && let Err(e) = writeln!(f, "{line}").and_then(|_| f.flush())
        {
            eprintln!("cannot write the CSV: {e}");
        }
        let mut shown = match row.times {
            Some((m, _, _)) => format!("{m:.3} ms ({:.1}x floor)", m / row.floor_ms),
            None => "n/a".into(),
        };
        if let (Some(p), Some(_)) = (row.predicted_ms, row.times) {
            shown.push_str(&format!(", predicted {p:.3} ms"));
        }
        println!(
            "  n={} k={} {} {}{} {}: {shown} {}",
            size_name(row.n),
            size_name(row.k),
            row.key.name(),
            row.dist.name(),
            if row.sel < 1.0 {
                format!(" sel={}", row.sel)
            } else {
                String::new()
            },
            row.algo.name(),
            row.ok
        );
        self.rows.push(row);
    }

    fn fail(&mut self, what: &str, message: &str) {
        self.wrong += 1;
        eprintln!("\n!!!!!!!! WRONG: {what}: {message} !!!!!!!!\n");
    }

    fn run(&mut self) -> GpuResult<()> {
        let device = Arc::clone(&self.device);
        let ns = self.opts.ns.clone();
        let keys = self.opts.keys.clone();
        let mut engines: Vec<(KeyWidth, TopKEngine)> = Vec::new();
        let mut floor: Option<ReadFloor> = None;
        for &n in &ns {
            for &key in &keys {
                let kind = key.kind();
                let engine_at = match engines.iter().position(|(k, _)| *k == kind) {
                    Some(i) => i,
                    None => {
                        engines.push((kind, TopKEngine::new(&device, kind)?));
                        engines.len() - 1
                    }
                };
                let engine = &mut engines[engine_at].1;
                if floor.is_none() {
                    floor = Some(ReadFloor::new(&device, engine)?);
                }
                let floor = floor.as_ref().expect("set above");
                // Free what earlier sizes left cached, then see whether this one fits.
                engine.synchronize()?;
                device.pool.trim();
                device.context.bind_to_thread()?;
                let (free, _) = result::mem_get_info()?;
                let kmax = self.opts.ks.iter().copied().filter(|&k| k <= n).max();
                let sel = self
                    .opts
                    .sels
                    .iter()
                    .copied()
                    .filter(|&s| s < 1.0)
                    .fold(0.0, f64::max);
                let need = device_bytes_needed(n, kind, kmax.unwrap_or(1), sel);
                if need > free {
                    println!(
                        "skipping n={} {}: needs about {:.1} GiB of device memory, {:.1} GiB free",
                        size_name(n),
                        key.name(),
                        need as f64 / (1u64 << 30) as f64,
                        free as f64 / (1u64 << 30) as f64
                    );
                    continue;
                }
                if kmax.is_none() {
                    println!("skipping n={}: every k is larger", size_name(n));
                    continue;
                }
                match kind {
                    KeyWidth::W32 => self.run_key::<u32>(engine, floor, n, key)?,
                    _ => self.run_key::<u64>(engine, floor, n, key)?,
                }
            }
        }
        for (_, engine) in &engines {
            engine.synchronize()?;
        }
        Ok(())
    }

    /// Every distribution, k and algorithm of one (n, key type).
    fn run_key<W: Word>(
        &mut self,
        engine: &mut TopKEngine,
        floor: &ReadFloor,
        n: usize,
        key: KeyType,
    ) -> GpuResult<()> {
        let mut pairs: Option<DevicePairs> = None;
        let dists = self.opts.dists.clone();
        for dist in dists.into_iter().filter(|d| d.applies_to(key)) {
            if let Some(budget) = self.opts.budget
                && self.started.elapsed().as_secs_f64() > budget
            {
                self.over_budget += 1;
                continue;
            }
            let started = Instant::now();
            let seed = splitmix64(n as u64) ^ ((key as u64) << 8) ^ (dist as u64);
            let keys: Vec<W> = generate(key, dist, n, seed).map_err(GpuError)?;
            let generated = started.elapsed().as_secs_f64();
            match &pairs {
                None => {
                    // Row ids 0..n, uploaded once per (n, key type).
                    let ids: Vec<u64> = (0..n as u64).collect();
                    let mut uploaded = engine.upload_pairs(as_bytes(&keys), &ids)?;
                    uploaded.set_positional(true);
                    pairs = Some(uploaded);
                }
                Some(p) => engine.upload_bytes(as_bytes(&keys), p.key_at(0))?,
            }
            let pairs = pairs.as_ref().expect("uploaded above");
            engine.synchronize()?;
            let uploaded = started.elapsed().as_secs_f64() - generated;
            let what = format!("n={} {} {}", size_name(n), key.name(), dist.name());

            let (floor_ms, seen) = measure_floor(floor, engine, pairs, n, self.opts.reps)?;
            let host_max = keys.iter().max().map_or(0, |w| w.to_u64());
            if seen != host_max {
                self.fail(
                    &what,
                    &format!("read floor kernel saw max {seen:#x}, host {host_max:#x}"),
                );
            }
            let ks: Vec<usize> = self.opts.ks.iter().copied().filter(|&k| k <= n).collect();
            let kmax = ks.iter().copied().max().unwrap_or(0);
            let expected = (n <= ORACLE_MAX_N).then(|| oracle(&keys, kmax));
            println!(
                "{what}: data {generated:.2} s, upload {uploaded:.2} s, read floor {floor_ms:.4} ms \
                 ({:.0} GB/s){}",
                (n * W::BYTES) as f64 / (floor_ms * 1e6),
                if expected.is_some() {
                    ", host oracle"
                } else {
                    ""
                }
            );
            // What a planner's statistics would say of ties: from a sorted sample of the
            // keys, the share of the sample equal to the k-th key's estimate.
            let sample: Vec<W> = {
                let step = (n / 65536).max(1);
                let mut v: Vec<W> = keys.iter().step_by(step).copied().collect();
                v.sort_unstable();
                v
            };
            for sel in self.opts.sels.clone() {
                // Below 1: the kept rows, as (key, row id) pairs, fill this buffer per run.
                let filtered = if sel < 1.0 {
                    let cap = ((n as f64 * sel * 1.05) as usize + 65536).min(n);
                    let out = engine.alloc_pairs(cap)?;
                    let kept = engine.filter_fraction(pairs, n, sel, &out)?;
                    Some((out, kept, fraction_cut(sel)))
                } else {
                    None
                };
                for algo in self.opts.algos.clone() {
                    for &k in &ks {
                        let filter = filtered.as_ref().map(|(out, kept, cut)| (out, *kept, *cut));
                        let mut row = self.run_case(
                            engine,
                            floor,
                            (pairs, filter, sel),
                            &keys,
                            expected.as_deref(),
                            (n, k, key, dist, algo),
                        );
                        row.floor_ms = floor_ms;
                        if let Some(model) = &self.model {
                            let rows = filtered.as_ref().map_or(n, |f| f.1);
                            row.ties = tie_share(&sample, k * sample.len() / rows.max(1));
                            row.predicted_ms =
                                grid_point(&row, rows).predict(model).map(|t| t * 1e3);
                        }
                        if row.ok != "ok" && row.ok != "n/a" {
                            self.fail(
                                &format!("{what} sel={sel} k={} {}", size_name(k), algo.name()),
                                &row.ok,
                            );
                        }
                        self.record(row);
                    }
                }
            }
        }
        Ok(())
    }

    /// One case: warm-up, R timed repetitions, the first one checked. With `filter` (the
    /// kept pairs' buffer, their count and the filter's cut, at selectivity `sel`) each
    /// repetition first runs the fraction filter (its count read back, as the operator does
    /// before selecting) and selects among the kept pairs; both are timed.
    fn run_case<W: Word>(
        &self,
        engine: &mut TopKEngine,
        floor: &ReadFloor,
        (pairs, filter, sel): (&DevicePairs, Option<(&DevicePairs, usize, u32)>, f64),
        keys: &[W],
        expected: Option<&[u32]>,
        (n, k, key, dist, algo): (usize, usize, KeyType, Dist, DeviceAlgorithm),
    ) -> Row {
        let mut row = Row {
            n,
            k,
            key,
            dist,
            algo,
            sel,
            times: None,
            predicted_ms: None,
            ties: 0.0,
            floor_ms: f64::NAN,
            ok: "n/a".into(),
        };
        if algo == DeviceAlgorithm::Bitonic && k > engine.bitonic_max_k() {
            return row;
        }
        let mut times = Vec::with_capacity(self.opts.reps);
        let mut verdict = Ok(());
        let mut timed = || -> GpuResult<()> {
            for rep in 0..=self.opts.reps {
                floor.flush_l2(engine)?;
                let (source, rows, filter_ms) = match filter {
                    None => (pairs, n, 0.0),
                    Some((out, kept, _)) => {
                        let timer = GpuTimer::start(engine.stream())?;
                        let count = engine.filter_fraction(pairs, n, sel, out)?;
                        let filter_ms = f64::from(timer.stop()?);
                        if count != kept {
                            return Err(GpuError(format!(
                                "the filter kept {count} rows, then {kept} before"
                            )));
                        }
                        (out, kept, filter_ms)
                    }
                };
                // The selection's device time: from its first kernel to its last. A pending
                // sampled selection's status read-back comes after (callers read it with the
                // result); when work ran after it, the round trip and that work count too.
                let (ms, sorted, m) = time_selection(engine, source, rows, k, algo)?;
                if rep == 0 {
                    continue; // warm-up (fills the buffer pool)
                }
                times.push(filter_ms + ms);
                if rep == 1 {
                    let ids = engine.download_ids(&sorted, m)?;
                    let out_keys: Vec<W> = engine
                        .download_keys(&sorted, m)?
                        .chunks_exact(W::BYTES)
                        .map(W::from_le_slice)
                        .collect();
                    let kept = filter.map(|(_, kept, cut)| (cut, kept));
                    verdict = check_kept(keys, expected, kept, k, &ids, &out_keys);
                }
            }
            Ok(())
        };
        let outcome = timed();
        finish_row(&mut row, outcome, times, verdict);
        row
    }

    /// The cost model's report: per case (n, k, key, distribution, selectivity) the
    /// algorithm it predicts fastest against the fastest measured, and its prediction errors.
    fn model_report(&self) -> Option<String> {
        self.model.as_ref()?;
        let rows: Vec<&Row> = self.rows.iter().filter(|r| r.ok == "ok").collect();
        let points: Vec<GridPoint> = rows.iter().map(|r| grid_point(r, r.n)).collect();
        let predicted: Vec<Option<f64>> = rows
            .iter()
            .map(|r| r.predicted_ms.map(|p| p / 1e3))
            .collect();
        Some(model_report(&assess(&points, &predicted)))
    }

    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:>6} {:>6} {:>4} {:>11} {:>5} {:>7} {:>10} {:>9} {:>8} {:>9} ok",
            "n", "k", "key", "dist", "sel", "algo", "median_ms", "floor_ms", "x_floor", "predicted"
        );
        for r in &self.rows {
            let (median, x) = match r.times {
                Some((m, _, _)) => (format!("{m:.4}"), format!("{:.2}", m / r.floor_ms)),
                None => ("n/a".into(), "n/a".into()),
            };
            let ok = if r.ok.starts_with("WRONG") || r.ok.starts_with("ERROR") {
                r.ok.split_whitespace().next().unwrap_or("WRONG")
            } else {
                r.ok.as_str()
            };
            let predicted = r.predicted_ms.map_or("-".into(), |p| format!("{p:.4}"));
            let _ = writeln!(
                t,
                "{:>6} {:>6} {:>4} {:>11} {:>5} {:>7} {median:>10} {:>9.4} {x:>8} {predicted:>9} {ok}",
                size_name(r.n),
                size_name(r.k),
                r.key.name(),
                r.dist.name(),
                r.sel,
                r.algo.name(),
                r.floor_ms
            );
        }
        t
    }
}

// ---- host self-check (no GPU) -------------------------------------------------------------------

/// `--host-check`: exercises the generators, the oracle and both checks on the host (the part
/// of the benchmark that can be verified without a GPU): outputs equal to the oracle must pass
/// both checks, corrupted ones must fail them. Returns the number of failures.
fn host_check() -> usize {
    fn one<W: Word>(key: KeyType, dist: Dist, n: usize, ks: &[usize]) -> Result<String, String> {
        let keys: Vec<W> = generate(key, dist, n, 7)?;
        if generate::<W>(key, dist, n, 7)? != keys {
            return Err("generation is not deterministic".into());
        }
        let distinct = keys.iter().collect::<BTreeSet<_>>().len();
        let kmax = ks.iter().copied().filter(|&k| k <= n).max().unwrap_or(0);
        let expected = oracle(&keys, kmax);
        // The oracle against a full sort.
        let mut all: Vec<(W, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, i as u64))
            .collect();
        all.sort_unstable();
        if (0..kmax).any(|j| all[j].1 != u64::from(expected[j])) {
            return Err("oracle differs from a full sort".into());
        }
        for &k in ks.iter().filter(|&&k| k <= n) {
            let m = k.min(n);
            let ids: Vec<u64> = expected[..m].iter().map(|&i| u64::from(i)).collect();
            let out: Vec<W> = ids.iter().map(|&i| keys[i as usize]).collect();
            for (name, o) in [("oracle", Some(&expected[..])), ("count", None)] {
                check(&keys, o, k, &ids, &out).map_err(|e| format!("k={k} {name} check: {e}"))?;
                // Corruptions every check must catch.
                let mut bad = Vec::new();
                if m >= 2 {
                    let (mut i2, mut o2) = (ids.clone(), out.clone());
                    i2.swap(0, m - 1);
                    o2.swap(0, m - 1);
                    bad.push(("swapped", i2, o2));
                }
                if m < n {
                    // The last winner replaced by the first loser.
                    let (mut i2, mut o2) = (ids.clone(), out.clone());
                    let loser = all[m].1;
                    i2[m - 1] = loser;
                    o2[m - 1] = keys[loser as usize];
                    if (o2[m - 1], loser) > (o2[m.saturating_sub(2)], i2[m.saturating_sub(2)])
                        || m == 1
                    {
                        bad.push(("loser", i2, o2));
                    }
                }
                {
                    let (mut i2, o2) = (ids.clone(), out.clone());
                    i2[m / 2] = n as u64;
                    bad.push(("out of range", i2, o2));
                }
                bad.push(("short", ids[..m - 1].to_vec(), out[..m - 1].to_vec()));
                for (what, i2, o2) in bad {
                    if check(&keys, o, k, &i2, &o2).is_ok() {
                        return Err(format!("k={k} {name} check accepted a {what} output"));
                    }
                }
            }
        }
        Ok(format!("{distinct} distinct keys"))
    }
    let ks = [1, 8, 32, 256, 1024, 4096, 1 << 16];
    let mut failures = 0;
    for n in [1000, 100_003, 1 << 18] {
        for key in KeyType::ALL {
            for dist in Dist::ALL.into_iter().filter(|d| d.applies_to(key)) {
                let outcome = match key.kind() {
                    KeyWidth::W32 => one::<u32>(key, dist, n, &ks),
                    _ => one::<u64>(key, dist, n, &ks),
                };
                let what = format!("n={n} {} {}", key.name(), dist.name());
                match outcome {
                    Ok(info) => println!("host check {what}: ok ({info})"),
                    Err(e) => {
                        failures += 1;
                        println!("host check {what}: WRONG {e}");
                    }
                }
            }
        }
    }
    // Host costs of one large (n, key, distribution), for run-time estimates.
    let n = 1 << 24;
    let t = Instant::now();
    let keys: Vec<u64> = generate(KeyType::F64, Dist::Uniform, n, 7).expect("generates");
    let generated = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let expected = oracle(&keys, 1 << 20);
    let sorted = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let last = expected[expected.len() - 1];
    let below = count_below(&keys, keys[last as usize], u64::from(last));
    let counted = t.elapsed().as_secs_f64();
    println!(
        "host costs at n=2^24 f64 on {} threads: generate+encode {generated:.2} s, oracle \
         (k=2^20) {sorted:.2} s, count check {counted:.3} s ({})",
        threads(),
        if below == expected.len() - 1 {
            "agrees"
        } else {
            "DISAGREES"
        }
    );
    failures + usize::from(below != expected.len() - 1)
}

/// `--replay CSV --calibration FILE`: the cost model's report over the measurements of an
/// earlier run (its CSV), predicted anew with a calibration file; no GPU needed. The kept
/// rows of a filtered case are taken as sel × n.
fn replay(args: &[String]) -> Result<String, String> {
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .ok_or_else(|| format!("--replay needs {flag} FILE"))
    };
    let csv_path = value("--replay")?;
    let model_path = value("--calibration")?;
    let model = calibration_model(std::path::Path::new(model_path))
        .ok_or_else(|| format!("{model_path}: not a calibration file"))?;
    let text = std::fs::read_to_string(csv_path).map_err(|e| format!("{csv_path}: {e}"))?;
    let points = parse_grid_csv(&text).map_err(|e| format!("{csv_path}: {e}"))?;
    let predicted: Vec<Option<f64>> = points.iter().map(|p| p.predict(&model)).collect();
    let mut out = String::from("n,k,key_bits,dist,sel,algo,measured_ms,predicted_ms\n");
    for (p, t) in points.iter().zip(&predicted) {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{:.5},{:.5}",
            p.n,
            p.k,
            p.kind.bits(),
            p.dist,
            p.sel,
            p.algorithm.name(),
            p.measured_s * 1e3,
            t.map_or(f64::NAN, |t| t * 1e3)
        );
    }
    out.push('\n');
    out.push_str(&model_report(&assess(&points, &predicted)));
    Ok(out)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--replay") {
        match replay(&args) {
            Ok(report) => print!("{report}"),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
        return;
    }
    if args.iter().any(|a| a == "--host-check") {
        let failures = host_check();
        println!("host check: {failures} failure(s)");
        std::process::exit(i32::from(failures > 0));
    }
    let opts = match parse_options(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let device = match gpu_status() {
        GpuStatus::Available(d) => Arc::clone(d),
        GpuStatus::Unavailable(reason) => {
            println!("no GPU: {reason}");
            return;
        }
    };
    device.pool.set_poison(false);
    let csv = match &opts.csv {
        None => None,
        Some(path) => {
            match std::fs::File::create(path).and_then(|mut f| {
                writeln!(
                    f,
                    "n,k,key,dist,algo,reps,median_ms,min_ms,max_ms,floor_ms,x_floor,floor_gbps,ok,\
                     sel,predicted_ms,ties"
                )?;
                Ok(f)
            }) {
                Ok(f) => Some(f),
                Err(e) => {
                    eprintln!("cannot create {path}: {e}");
                    std::process::exit(2);
                }
            }
        }
    };
    let algos: BTreeSet<&str> = opts.algos.iter().map(|a| a.name()).collect();
    println!(
        "device: {} ({} SMs, {} KiB shared/block); n {:?}; k {:?}; keys {:?}; dists {:?}; \
         algos {:?}; {} reps (+1 warm-up), median; L2 flushed before each",
        device.describe(),
        device.sm_count,
        device.max_shared_per_block / 1024,
        opts.ns.iter().map(|&n| size_name(n)).collect::<Vec<_>>(),
        opts.ks.iter().map(|&k| size_name(k)).collect::<Vec<_>>(),
        opts.keys.iter().map(|k| k.name()).collect::<Vec<_>>(),
        opts.dists.iter().map(|d| d.name()).collect::<Vec<_>>(),
        algos,
        opts.reps
    );
    let model = if opts.cost_model {
        match calibration(&device, None, opts.recalibrate) {
            Ok(c) => {
                println!("{}", c.describe());
                for r in &c.references {
                    println!(
                        "  reference {}: measured {:.4} ms, fitted {:.4} ms",
                        r.what,
                        r.measured_s * 1e3,
                        r.predicted_s * 1e3
                    );
                }
                Some(c.model)
            }
            Err(e) => {
                println!("ERROR: the calibration failed: {e}");
                std::process::exit(1);
            }
        }
    } else {
        None
    };
    let started = Instant::now();
    let mut sweep = Sweep {
        opts,
        started,
        over_budget: 0,
        device,
        rows: Vec::new(),
        wrong: 0,
        csv,
        model,
    };
    let outcome = sweep.run();
    println!(
        "\n{} cases in {:.1} s\n\n{}",
        sweep.rows.len(),
        started.elapsed().as_secs_f64(),
        sweep.table()
    );
    if sweep.over_budget > 0 {
        println!(
            "BUDGET: {} (n, key, distribution) data sets left out after --budget {:.0} s",
            sweep.over_budget,
            sweep.opts.budget.unwrap_or(0.0)
        );
    }
    if let Some(report) = sweep.model_report() {
        println!("\n{report}");
    }
    if let Err(e) = outcome {
        println!("ERROR: the sweep stopped: {e}");
        std::process::exit(1);
    }
    if sweep.wrong > 0 {
        println!("WRONG: {} check(s) failed (see above)", sweep.wrong);
        std::process::exit(1);
    }
    println!(
        "all {} checked cases ok",
        sweep.rows.iter().filter(|r| r.ok == "ok").count()
    );
}
