//! The CUDA backend: kernels compile under NVRTC for sm_90 (no GPU needed), the CUBIN cache,
//! and, on a machine with a GPU, the device encoding and both selection algorithms against the
//! CPU path, element by element. Tests that need NVRTC or a GPU print `SKIP: …` and pass
//! without them.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Date32Array, Date64Array, Decimal32Array, Decimal64Array,
    Decimal128Array, DurationMicrosecondArray, DurationMillisecondArray, DurationNanosecondArray,
    DurationSecondArray, Float16Array, Float32Array, Float64Array, Int8Array, Int16Array,
    Int32Array, Int64Array, Time32MillisecondArray, Time32SecondArray, Time64MicrosecondArray,
    Time64NanosecondArray, TimestampMicrosecondArray, TimestampMillisecondArray,
    TimestampNanosecondArray, TimestampSecondArray, UInt8Array, UInt16Array, UInt32Array,
    UInt64Array,
};
use datafusion::arrow::datatypes::DataType;
use datafusion_gpu_topk::internal::config::Algorithm;
use datafusion_gpu_topk::internal::device::kernels::{
    self, KernelSources, cache_key, compile_cubin, compile_program, cubin_cached, entry_points,
    kernels_without_dependency_wait, nvrtc_available, read_cache_file, write_cache_file,
};
use datafusion_gpu_topk::internal::device::{
    DeviceAlgorithm, GpuDevice, GpuStatus, gpu, gpu_status,
};
use datafusion_gpu_topk::internal::keys::{EncodedKeys, KeyLayout, KeySpec, U256};
use datafusion_gpu_topk::internal::select::cuda::{
    HostKeys, bitonic_max_k, encode_keys_device, new_cuda_selector_with_capacity,
    select_topk_device,
};
use datafusion_gpu_topk::internal::select::{RowIds, SelectInput, SelectionSpec, cpu, row_id};

// ---- helpers ----------------------------------------------------------------------------------

/// xorshift64*: tiny, deterministic, good enough for test data.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        true
    } else {
        eprintln!(
            "SKIP: {test}: no NVRTC library (run .ci/install-nvrtc.sh and put its output on LD_LIBRARY_PATH)"
        );
        false
    }
}

fn gpu_or_skip(test: &str) -> Option<Arc<GpuDevice>> {
    match gpu_status() {
        GpuStatus::Available(device) => {
            device.pool.set_poison(true);
            Some(Arc::clone(device))
        }
        GpuStatus::Unavailable(why) => {
            eprintln!("SKIP: {test}: no GPU ({why})");
            None
        }
    }
}

/// The reference: row ids of the min(n, k) smallest (key, id) pairs, in order.
fn oracle<K: Ord + Copy>(keys: &[K], ids: &[u64], k: usize) -> Vec<u64> {
    let mut pairs: Vec<(K, u64)> = keys.iter().copied().zip(ids.iter().copied()).collect();
    if k == 0 {
        return vec![];
    }
    if pairs.len() > k {
        pairs.select_nth_unstable(k - 1);
        pairs.truncate(k);
    }
    pairs.sort_unstable();
    pairs.into_iter().map(|(_, id)| id).collect()
}

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gpu-topk-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// ---- NVRTC (no GPU needed) --------------------------------------------------------------------

/// The engine launches kernels with programmatic stream serialisation (Hopper on): each kernel
/// must wait for the previous one's writes before it touches memory.
#[test]
fn every_kernel_waits_for_the_previous_kernel_first() {
    let sources = KernelSources::embedded();
    let mut kernels = 0;
    for (name, source) in sources.programs() {
        kernels += source.matches("__global__").count();
        let missing = kernels_without_dependency_wait(source);
        assert!(
            missing.is_empty(),
            "{name}: no grid_dependency_wait first in {missing:?}"
        );
    }
    assert!(kernels >= 39, "{kernels} kernel definitions");
    // The check itself: a wait after a store, or none, is reported; one first (in a macro too) is not.
    let late = "extern \"C\" __global__ void f(int *p) { *p = 1; grid_dependency_wait(); }";
    assert_eq!(kernels_without_dependency_wait(late).len(), 1);
    let none = "extern \"C\" __global__ void g(int *p) {}\n__global__ void h() { grid_dependency_wait(); }";
    assert_eq!(
        kernels_without_dependency_wait(none),
        vec!["__global__ void g(int *p)"]
    );
    let macro_def = "#define E(S) \\\n    extern \"C\" __global__ void e_##S() { \\\n  grid_dependency_wait(); }";
    assert!(kernels_without_dependency_wait(macro_def).is_empty());
}

#[test]
fn every_kernel_compiles_for_sm_90_without_spills_or_stack() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm_90_without_spills_or_stack") {
        return;
    }
    let sources = KernelSources::embedded();
    let headers = sources.headers();
    assert!(!sources.programs().is_empty());
    for (name, source) in sources.programs() {
        let compiled = compile_program(name, source, &headers, "sm_90", &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(compiled.cubin.len() > 64, "{name}: empty CUBIN");
        // The report has one "Function properties for NAME" block per entry point.
        let mut current = String::new();
        let mut reported = 0;
        for line in compiled.log.lines() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                current = f.trim().to_string();
            }
            if line.contains("spill stores") {
                assert!(
                    line.contains(" 0 bytes spill stores") && line.contains(" 0 bytes spill loads"),
                    "{name}: {current} spills: {line}"
                );
            }
            // Register arrays indexed at run time land in local memory (a stack frame).
            assert!(
                !line.contains("cumulative stack size"),
                "{name}: {current} uses a stack: {line}"
            );
            if line.contains("Used") && line.contains("registers") {
                eprintln!("{name:14} {current:28} {}", line.trim());
                reported += 1;
            }
        }
        // Every entry point is in the CUBIN's symbol table.
        for entry in entry_points(name) {
            let symbol = entry.as_bytes();
            assert!(
                compiled.cubin.windows(symbol.len()).any(|w| w == symbol),
                "{name}: no kernel {entry} in the CUBIN"
            );
        }
        // ptxas reports every kernel, unless the compile was served from a cache (seen on the
        // GPU machine: an empty log on repeated runs).
        if reported == 0 {
            eprintln!("{name}: NVRTC's log has no ptxas report (cached compile?)");
        } else {
            assert_eq!(
                reported,
                entry_points(name).len(),
                "{name}: {reported} register reports for {} entry points; NVRTC's log:\n{}",
                entry_points(name).len(),
                compiled.log
            );
        }
    }
}

#[test]
fn spill_bytes_adds_the_stores_and_loads_of_every_function() {
    let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
               ptxas info    : Function properties for a\n\
               \x20   8 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads\n\
               ptxas info    : Used 51 registers\n\
               ptxas info    : Function properties for b\n\
               \x20   0 bytes stack frame, 0 bytes spill stores, 4 bytes spill loads";
    assert_eq!(kernels::spill_bytes(log), 56);
    assert_eq!(kernels::spill_bytes("ptxas info    : Used 40 registers"), 0);
}

#[test]
fn compile_cubin_reports_errors_with_the_log_and_rejects_virtual_targets() {
    if !nvrtc_or_skip("compile_cubin_reports_errors_with_the_log_and_rejects_virtual_targets") {
        return;
    }
    let ok =
        "#include \"common.cuh\"\nextern \"C\" __global__ void f(u64 *p) { p[threadIdx.x] = 1; }";
    assert!(!compile_cubin(ok, "sm_90", &[]).unwrap().is_empty());
    let err = compile_cubin(
        "extern \"C\" __global__ void f() { undeclared(); }",
        "sm_90",
        &[],
    )
    .unwrap_err();
    assert!(
        err.contains("undeclared"),
        "the error carries NVRTC's log: {err}"
    );
    let err = compile_cubin(ok, "compute_90", &[]).unwrap_err();
    assert!(err.contains("compute_90"), "{err}");
}

#[test]
fn kernel_sources_load_from_a_directory() {
    let dir = tmp_dir("sources");
    for (name, text) in kernels::EMBEDDED {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let from_dir = KernelSources::from_dir(&dir).unwrap();
    for (name, text) in kernels::EMBEDDED {
        assert_eq!(from_dir.get(name), Some(*text));
    }
    std::fs::remove_file(dir.join("radix.cu")).unwrap();
    assert!(
        KernelSources::from_dir(&dir)
            .unwrap_err()
            .contains("radix.cu")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cache_files_detect_corruption_truncation_and_stale_keys() {
    let dir = tmp_dir("cache-files");
    let path = dir.join("x.cubin");
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let key = cache_key(&[b"source", b"sm_90"]);
    assert_ne!(key, cache_key(&[b"source", b"sm_80"]));
    assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
    write_cache_file(&path, key, &payload).unwrap();
    assert_eq!(read_cache_file(&path, key), Some(payload.clone()));
    assert_eq!(read_cache_file(&path, key ^ 1), None, "another key");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(read_cache_file(&path, key), None, "corrupt payload");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_eq!(read_cache_file(&path, key), None, "truncated");
    std::fs::write(&path, b"").unwrap();
    assert_eq!(read_cache_file(&path, key), None, "empty");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cubin_cache_stores_reuses_and_rebuilds() {
    if !nvrtc_or_skip("cubin_cache_stores_reuses_and_rebuilds") {
        return;
    }
    let dir = tmp_dir("cubin-cache");
    let sources = KernelSources::embedded();
    let first = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one cache file: {files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with("candidates-sm_90-") && name.ends_with(".cubin"),
        "{name}"
    );
    let bytes = std::fs::read(&files[0]).unwrap();
    assert_eq!(&bytes[48..], &first[..]);
    // A valid entry is used as is: a marker payload under the same key comes back.
    let key = u128::from_le_bytes(bytes[16..32].try_into().unwrap());
    write_cache_file(&files[0], key, b"marker").unwrap();
    let marker = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    assert_eq!(marker, b"marker");
    // A corrupt entry is rebuilt and rewritten.
    let mut corrupt = bytes.clone();
    corrupt[100] ^= 0xff;
    std::fs::write(&files[0], &corrupt).unwrap();
    let again = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    assert_eq!(again, first);
    assert_eq!(std::fs::read(&files[0]).unwrap(), bytes);
    // Another driver version is another key, another file.
    cubin_cached("candidates.cu", &sources, "sm_90", &[], 13010, Some(&dir)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- selection of host-encoded keys ------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dist {
    Uniform,
    AllEqual,
    /// Every key all ones and one row id all ones: indistinguishable from the padding pair.
    AllMax,
    /// f32 Uniform[128.6, 128.7], order-encoded, in the top bits.
    Narrow,
    SortedAsc,
    SortedDesc,
    /// Geometric: key = leading zeros of a random word (most keys 0 or 1).
    HeavyTies,
}

const DISTS: [Dist; 7] = [
    Dist::Uniform,
    Dist::AllEqual,
    Dist::AllMax,
    Dist::Narrow,
    Dist::SortedAsc,
    Dist::SortedDesc,
    Dist::HeavyTies,
];

fn f32_key(x: f32) -> u32 {
    let b = x.to_bits();
    b ^ if b >> 31 == 1 { u32::MAX } else { 1 << 31 }
}

/// Primary values (the most significant 32 or 64 key bits) and unique, shuffled row ids.
fn generate(dist: Dist, n: usize, wide: bool, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let mut rng = Rng::new(seed);
    let keys = (0..n as u64)
        .map(|i| match dist {
            Dist::Uniform if wide => rng.next(),
            Dist::Uniform => rng.next() >> 32,
            Dist::AllEqual => 0x1234_5678,
            Dist::AllMax if wide => u64::MAX,
            Dist::AllMax => u64::from(u32::MAX),
            Dist::Narrow => {
                let v = u64::from(f32_key(128.6 + 0.1 * rng.unit() as f32));
                if wide {
                    v << 32 | (rng.next() >> 62)
                } else {
                    v
                }
            }
            Dist::SortedAsc => i * 3,
            Dist::SortedDesc => (n as u64 - i) * 3,
            Dist::HeavyTies => u64::from(rng.next().leading_zeros()),
        })
        .collect();
    // Unique ids (an odd multiplier is a bijection) in shuffled order.
    let mut ids: Vec<u64> = (0..n as u64)
        .map(|i| i.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 1)
        .collect();
    if dist == Dist::AllMax && n > 0 {
        ids[n / 2] = u64::MAX;
    }
    (keys, ids)
}

/// Checks every algorithm (bitonic where k allows) for one input of every key width against
/// the oracle.
fn check_select(device: &Arc<GpuDevice>, dist: Dist, n: usize, k: usize, seed: u64) {
    let (p32, ids) = generate(dist, n, false, seed);
    let (p64, _) = generate(dist, n, true, seed);
    let k32: Vec<u32> = p32.iter().map(|&v| v as u32).collect();
    let k64 = p64.clone();
    // Lower words derived from the primary value keep ties tied; all ones stays all ones.
    let k128: Vec<u128> = p64
        .iter()
        .map(|&v| (u128::from(v) << 64) | u128::from(v.rotate_left(17) | (v >> 1)))
        .collect();
    let k256: Vec<U256> = k128
        .iter()
        .map(|&v| U256 {
            hi: v,
            lo: v.rotate_left(41),
        })
        .collect();
    let cases: [(HostKeys<'_>, Vec<u64>); 4] = [
        (HostKeys::U32(&k32), oracle(&k32, &ids, k)),
        (HostKeys::U64(&k64), oracle(&k64, &ids, k)),
        (HostKeys::U128(&k128), oracle(&k128, &ids, k)),
        (HostKeys::U256(&k256), oracle(&k256, &ids, k)),
    ];
    for (keys, expected) in cases {
        let kind = keys.kind();
        let mut algorithms = vec![
            DeviceAlgorithm::Radix,
            DeviceAlgorithm::Sample,
            DeviceAlgorithm::Delegate,
        ];
        let chunk = datafusion_gpu_topk::internal::device::plan::bitonic_chunk(
            device.max_shared_per_block,
            kind,
        );
        if k.max(1).next_power_of_two() * 4 <= chunk {
            algorithms.push(DeviceAlgorithm::Bitonic);
        }
        for algorithm in algorithms {
            let got = select_topk_device(device, keys, &ids, k, algorithm)
                .unwrap_or_else(|e| panic!("{kind:?} {algorithm:?} {dist:?} n={n} k={k}: {e}"));
            if got != expected {
                let first = got.iter().zip(&expected).position(|(a, b)| a != b);
                panic!(
                    "{kind:?} {algorithm:?} {dist:?} n={n} k={k}: {} ids, expected {}; first \
                     difference at {first:?}",
                    got.len(),
                    expected.len()
                );
            }
        }
    }
}

#[test]
fn gpu_selection_matches_the_oracle_for_every_width_size_k_and_distribution() {
    let Some(device) = gpu_or_skip("gpu_selection_matches_the_oracle") else {
        return;
    };
    let mut seed = 1;
    for k in [1usize, 7, 32, 100, 1024, 5000, 100_000] {
        let mut sizes = vec![1, k.saturating_sub(1).max(1), k, k + 1, 3 * k + 17, 10_007];
        if k <= 5000 {
            sizes.push(100_003);
        }
        sizes.sort_unstable();
        sizes.dedup();
        for n in sizes {
            for dist in DISTS {
                seed += 1;
                check_select(&device, dist, n, k, seed);
            }
        }
    }
}

#[test]
fn gpu_selection_edge_cases() {
    let Some(device) = gpu_or_skip("gpu_selection_edge_cases") else {
        return;
    };
    // Empty input, k = 0, k > n, n = 2^k boundaries of the bitonic chunk.
    check_select(&device, Dist::Uniform, 0, 5, 1);
    check_select(&device, Dist::Uniform, 10, 0, 2);
    check_select(&device, Dist::Uniform, 10, 1000, 3);
    for n in [8191, 8192, 8193, 16384, 16385, 32768 + 5] {
        for k in [1, 2, 3, 255, 256, 257, 1000] {
            check_select(&device, Dist::HeavyTies, n, k, n as u64 * 31 + k as u64);
            check_select(&device, Dist::Uniform, n, k, n as u64 * 37 + k as u64);
        }
    }
}

#[test]
fn gpu_selection_large_inputs() {
    let Some(device) = gpu_or_skip("gpu_selection_large_inputs") else {
        return;
    };
    // 2^20 + 7 over every distribution and a large k, then one 2^27 case per algorithm.
    for dist in DISTS {
        let n = (1 << 20) + 7;
        let (keys, ids) = generate(dist, n, true, 99);
        for (k, algorithm) in [
            (50, DeviceAlgorithm::Bitonic),
            (50, DeviceAlgorithm::Radix),
            (300_000, DeviceAlgorithm::Radix),
            (50, DeviceAlgorithm::Sample),
            (5000, DeviceAlgorithm::Sample),
            (300_000, DeviceAlgorithm::Sample),
            (50, DeviceAlgorithm::Delegate),
            (5000, DeviceAlgorithm::Delegate),
        ] {
            let got =
                select_topk_device(&device, HostKeys::U64(&keys), &ids, k, algorithm).unwrap();
            assert!(
                got == oracle(&keys, &ids, k),
                "{dist:?} n={n} k={k} {algorithm:?}"
            );
        }
    }
    let n = 1 << 27;
    let (keys, ids) = generate(Dist::Uniform, n, true, 7);
    for (k, algorithm) in [
        (100, DeviceAlgorithm::Bitonic),
        (1000, DeviceAlgorithm::Radix),
        (1000, DeviceAlgorithm::Sample),
        (100_000, DeviceAlgorithm::Sample),
        (1000, DeviceAlgorithm::Delegate),
        (100_000, DeviceAlgorithm::Delegate),
    ] {
        let got = select_topk_device(&device, HostKeys::U64(&keys), &ids, k, algorithm).unwrap();
        assert!(got == oracle(&keys, &ids, k), "2^27 k={k} {algorithm:?}");
    }
    // Row ids 0..n (positional: the sampled threshold's filter reads keys only), every width
    // and an odd length (a partial last vector).
    for dist in DISTS {
        let n = (1 << 21) + 3;
        let (p64, _) = generate(dist, n, true, 5);
        let ids: Vec<u64> = (0..n as u64).collect();
        let k32: Vec<u32> = p64.iter().map(|&v| v as u32).collect();
        let k128: Vec<u128> = p64
            .iter()
            .map(|&v| (u128::from(v) << 64) | u128::from(!v))
            .collect();
        let k256: Vec<U256> = k128
            .iter()
            .map(|&v| U256 {
                hi: v,
                lo: v.rotate_left(9),
            })
            .collect();
        // 300 000: the survivors are radix-sorted with the id bound n (3 of 8 id bytes).
        for k in [1, 100, 4000, 300_000] {
            for (keys, expected) in [
                (HostKeys::U32(&k32), oracle(&k32, &ids, k)),
                (HostKeys::U64(&p64), oracle(&p64, &ids, k)),
                (HostKeys::U128(&k128), oracle(&k128, &ids, k)),
                (HostKeys::U256(&k256), oracle(&k256, &ids, k)),
            ] {
                for algorithm in [DeviceAlgorithm::Sample, DeviceAlgorithm::Delegate] {
                    let got = select_topk_device(&device, keys, &ids, k, algorithm).unwrap();
                    assert!(
                        got == expected,
                        "positional {dist:?} {:?} k={k} {algorithm:?}",
                        keys.kind()
                    );
                }
            }
        }
    }
}

// ---- device encoding vs KeyLayout::encode --------------------------------------------------------

fn spec(data_type: DataType, descending: bool, nulls_first: bool, nullable: bool) -> KeySpec {
    KeySpec {
        data_type,
        descending,
        nulls_first,
        nullable,
    }
}

/// A column of `data_type` with n rows: random values (with the type's edge values mixed in)
/// and, when `nulls`, about a fifth NULL.
fn column(data_type: &DataType, n: usize, nulls: bool, rng: &mut Rng) -> ArrayRef {
    let valid: Vec<bool> = (0..n).map(|_| !nulls || rng.below(5) != 0).collect();
    let pick = |rng: &mut Rng, edges: &[i128], random: i128| -> i128 {
        if rng.below(4) == 0 {
            edges[rng.below(edges.len() as u64) as usize]
        } else {
            random
        }
    };
    macro_rules! ints {
        ($array:ty, $t:ty) => {{
            let edges = [<$t>::MIN as i128, <$t>::MAX as i128, 0, 1, -1];
            let values: Vec<Option<$t>> = (0..n)
                .map(|i| {
                    let r = rng.next() as $t as i128;
                    let v = pick(rng, &edges, r) as $t;
                    valid[i].then_some(v)
                })
                .collect();
            Arc::new(<$array>::from(values)) as ArrayRef
        }};
    }
    macro_rules! floats {
        ($array:ty, $t:ty, $from:expr) => {{
            let edges: [$t; 10] = [
                $from(0.0),
                $from(-0.0),
                $from(f64::INFINITY),
                $from(f64::NEG_INFINITY),
                $from(f64::NAN),
                -$from(f64::NAN),
                $from(1.5),
                $from(-1.5),
                $from(f64::MIN_POSITIVE),
                $from(65504.0),
            ];
            let values: Vec<Option<$t>> = (0..n)
                .map(|i| {
                    let v = if rng.below(3) == 0 {
                        edges[rng.below(edges.len() as u64) as usize]
                    } else {
                        $from((rng.unit() - 0.5) * 1000.0)
                    };
                    valid[i].then_some(v)
                })
                .collect();
            Arc::new(<$array>::from(values)) as ArrayRef
        }};
    }
    macro_rules! with_tz {
        ($a:expr, $array:ty, $tz:expr) => {{
            let a = $a;
            let a = a.as_any().downcast_ref::<$array>().unwrap().clone();
            Arc::new(a.with_timezone_opt($tz.clone())) as ArrayRef
        }};
    }
    match data_type {
        DataType::Boolean => {
            let values: Vec<Option<bool>> = (0..n)
                .map(|i| valid[i].then_some(rng.below(2) == 1))
                .collect();
            Arc::new(BooleanArray::from(values))
        }
        DataType::UInt8 => ints!(UInt8Array, u8),
        DataType::UInt16 => ints!(UInt16Array, u16),
        DataType::UInt32 => ints!(UInt32Array, u32),
        DataType::UInt64 => ints!(UInt64Array, u64),
        DataType::Int8 => ints!(Int8Array, i8),
        DataType::Int16 => ints!(Int16Array, i16),
        DataType::Int32 => ints!(Int32Array, i32),
        DataType::Int64 => ints!(Int64Array, i64),
        DataType::Date32 => ints!(Date32Array, i32),
        DataType::Date64 => ints!(Date64Array, i64),
        DataType::Time32(u) => match u {
            datafusion::arrow::datatypes::TimeUnit::Second => ints!(Time32SecondArray, i32),
            _ => ints!(Time32MillisecondArray, i32),
        },
        DataType::Time64(u) => match u {
            datafusion::arrow::datatypes::TimeUnit::Microsecond => {
                ints!(Time64MicrosecondArray, i64)
            }
            _ => ints!(Time64NanosecondArray, i64),
        },
        DataType::Timestamp(u, tz) => {
            use datafusion::arrow::datatypes::TimeUnit::*;
            // with_timezone_opt keeps the values (a cast would convert, and null overflows).
            match u {
                Second => with_tz!(ints!(TimestampSecondArray, i64), TimestampSecondArray, tz),
                Millisecond => {
                    with_tz!(
                        ints!(TimestampMillisecondArray, i64),
                        TimestampMillisecondArray,
                        tz
                    )
                }
                Microsecond => {
                    with_tz!(
                        ints!(TimestampMicrosecondArray, i64),
                        TimestampMicrosecondArray,
                        tz
                    )
                }
                Nanosecond => {
                    with_tz!(
                        ints!(TimestampNanosecondArray, i64),
                        TimestampNanosecondArray,
                        tz
                    )
                }
            }
        }
        DataType::Duration(u) => {
            use datafusion::arrow::datatypes::TimeUnit::*;
            match u {
                Second => ints!(DurationSecondArray, i64),
                Millisecond => ints!(DurationMillisecondArray, i64),
                Microsecond => ints!(DurationMicrosecondArray, i64),
                Nanosecond => ints!(DurationNanosecondArray, i64),
            }
        }
        DataType::Decimal32(p, s) => {
            let a = ints!(Decimal32Array, i32);
            let a = a.as_any().downcast_ref::<Decimal32Array>().unwrap().clone();
            Arc::new(a.with_precision_and_scale(*p, *s).unwrap())
        }
        DataType::Decimal64(p, s) => {
            let a = ints!(Decimal64Array, i64);
            let a = a.as_any().downcast_ref::<Decimal64Array>().unwrap().clone();
            Arc::new(a.with_precision_and_scale(*p, *s).unwrap())
        }
        DataType::Decimal128(p, s) => {
            let edges = [i128::MIN, i128::MAX, 0, 1, -1, i128::from(i64::MIN) - 1];
            let values: Vec<Option<i128>> = (0..n)
                .map(|i| {
                    let r =
                        (i128::from(rng.next()) << 64 | i128::from(rng.next())) >> rng.below(100);
                    valid[i].then_some(pick(rng, &edges, r))
                })
                .collect();
            Arc::new(
                Decimal128Array::from(values)
                    .with_precision_and_scale(*p, *s)
                    .unwrap(),
            )
        }
        DataType::Float16 => floats!(Float16Array, half::f16, half::f16::from_f64),
        DataType::Float32 => floats!(Float32Array, f32, |x: f64| x as f32),
        DataType::Float64 => floats!(Float64Array, f64, |x: f64| x),
        other => panic!("no generator for {other}"),
    }
}

fn all_key_types() -> Vec<DataType> {
    use datafusion::arrow::datatypes::TimeUnit::*;
    vec![
        DataType::Boolean,
        DataType::UInt8,
        DataType::UInt16,
        DataType::UInt32,
        DataType::UInt64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Date32,
        DataType::Date64,
        DataType::Time32(Second),
        DataType::Time32(Millisecond),
        DataType::Time64(Microsecond),
        DataType::Time64(Nanosecond),
        DataType::Timestamp(Second, None),
        DataType::Timestamp(Millisecond, None),
        DataType::Timestamp(Microsecond, Some("+02:00".into())),
        DataType::Timestamp(Nanosecond, None),
        DataType::Duration(Second),
        DataType::Duration(Millisecond),
        DataType::Duration(Microsecond),
        DataType::Duration(Nanosecond),
        DataType::Decimal32(9, 2),
        DataType::Decimal64(18, 3),
        DataType::Decimal128(38, 10),
    ]
}

fn assert_same_encoding(
    device: &Arc<GpuDevice>,
    layout: &KeyLayout,
    columns: &[ArrayRef],
    what: &str,
) {
    let expected = layout.encode(columns).unwrap();
    let got = encode_keys_device(device, layout, columns).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.width(), expected.width(), "{what}");
    if got != expected {
        panic!("{what}: the device encoding differs from KeyLayout::encode");
    }
}

#[test]
fn gpu_encoding_matches_the_keys_module_for_every_type_and_option() {
    let Some(device) = gpu_or_skip("gpu_encoding_matches_the_keys_module") else {
        return;
    };
    let mut rng = Rng::new(5);
    for data_type in all_key_types() {
        for nullable in [false, true] {
            for descending in [false, true] {
                for nulls_first in [false, true] {
                    let n = 1000 + rng.below(100) as usize;
                    let full = column(&data_type, n + 13, nullable, &mut rng);
                    // Sliced at an odd offset: bit offsets of booleans and validity bitmaps.
                    for array in [full.slice(0, n), full.slice(5, n), full.slice(13, n)] {
                        let s = spec(data_type.clone(), descending, nulls_first, nullable);
                        let layout = KeyLayout::try_new(vec![s]).unwrap();
                        let what = format!(
                            "{data_type} nullable={nullable} desc={descending} \
                             nulls_first={nulls_first} offset={}",
                            array.offset()
                        );
                        assert_same_encoding(&device, &layout, &[array], &what);
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_encoding_matches_for_composite_layouts_of_every_width() {
    let Some(device) = gpu_or_skip("gpu_encoding_matches_for_composite_layouts") else {
        return;
    };
    let types = all_key_types();
    let mut rng = Rng::new(11);
    let mut kinds_seen = std::collections::HashSet::new();
    for round in 0..400 {
        let keys = 1 + rng.below(4) as usize;
        let specs: Vec<KeySpec> = (0..keys)
            .map(|_| {
                let t = types[rng.below(types.len() as u64) as usize].clone();
                spec(t, rng.below(2) == 1, rng.below(2) == 1, rng.below(2) == 1)
            })
            .collect();
        let Ok(layout) = KeyLayout::try_new(specs.clone()) else {
            continue; // over 256 bits
        };
        kinds_seen.insert(layout.width());
        let n = 1 + rng.below(3000) as usize;
        let columns: Vec<ArrayRef> = specs
            .iter()
            .map(|s| column(&s.data_type, n + 3, s.nullable, &mut rng).slice(3, n))
            .collect();
        assert_same_encoding(
            &device,
            &layout,
            &columns,
            &format!("round {round}: {specs:?}"),
        );
    }
    assert_eq!(
        kinds_seen.len(),
        4,
        "layouts of every width were drawn: {kinds_seen:?}"
    );
}

// ---- the selector vs the CPU selector -------------------------------------------------------------

/// One pushed batch of `n` random rows for `specs`, with the explicit row ids a filtered batch
/// would carry (increasing, with gaps) starting at `next_row` of `partition`.
fn pushed_batch(
    specs: &[KeySpec],
    n: usize,
    partition: usize,
    next_row: u64,
    rng: &mut Rng,
) -> (Vec<ArrayRef>, Vec<u64>) {
    let columns = specs
        .iter()
        .map(|s| column(&s.data_type, n, s.nullable, rng))
        .collect();
    let explicit = (0..n as u64)
        .map(|i| row_id(partition, next_row + 2 * i))
        .collect();
    (columns, explicit)
}

/// Every other batch is filtered (explicit ids); the others are consecutive ids.
fn batch_row_ids(batch: usize, partition: usize, next_row: u64, explicit: &[u64]) -> RowIds<'_> {
    if batch % 2 == 1 {
        RowIds::Explicit(explicit)
    } else {
        RowIds::Range(row_id(partition, next_row))
    }
}

#[allow(clippy::too_many_arguments)]
/// Pushes the same batches (from several threads, one per partition) to a CUDA selector and
/// to the CPU selector and compares their results.
fn check_selector(
    device: &Arc<GpuDevice>,
    specs: Vec<KeySpec>,
    k: usize,
    partitions: usize,
    batches: usize,
    rows: usize,
    algorithm: Algorithm,
    capacity: usize,
    seed: u64,
) {
    let layout = KeyLayout::try_new(specs.clone()).unwrap();
    let spec = SelectionSpec {
        layout,
        k,
        program: None,
        final_choice: None,
        fault: Default::default(),
        watch: None,
    };
    let cpu = cpu::new_selector(&spec);
    let algorithm = resolve(device, &spec, algorithm).expect("a device algorithm for this k");
    let gpu = new_cuda_selector_with_capacity(&spec, Arc::clone(device), algorithm, capacity)
        .unwrap_or_else(|e| panic!("{e}"));
    std::thread::scope(|scope| {
        for partition in 0..partitions {
            let (cpu, gpu, specs) = (Arc::clone(&cpu), Arc::clone(&gpu), specs.clone());
            scope.spawn(move || {
                let mut rng = Rng::new(seed * 1000 + partition as u64);
                let mut next_row = 0u64;
                for batch in 0..batches {
                    let n = 1 + rng.below(rows as u64) as usize;
                    let (columns, explicit) =
                        pushed_batch(&specs, n, partition, next_row, &mut rng);
                    let row_ids = batch_row_ids(batch, partition, next_row, &explicit);
                    next_row += 2 * n as u64;
                    let input = SelectInput {
                        keys: &columns,
                        row_ids,
                    };
                    cpu.push(input).unwrap();
                    gpu.push(input).unwrap_or_else(|e| panic!("push: {e}"));
                }
            });
        }
    });
    let expected = cpu.finish().unwrap();
    let got = gpu.finish().unwrap_or_else(|e| panic!("finish: {e}"));
    assert!(
        got == expected,
        "{} k={k} {algorithm:?} capacity={capacity}: {} ids, expected {}",
        gpu.describe(),
        got.len(),
        expected.len()
    );
}

#[test]
fn gpu_selector_matches_the_cpu_selector() {
    let Some(device) = gpu_or_skip("gpu_selector_matches_the_cpu_selector") else {
        return;
    };
    let specs_list = vec![
        // retweet_count DESC: heavy ties are broken by row id.
        vec![spec(DataType::Int64, true, true, false)],
        // 32-bit device keys: a nullable f16, a non-nullable f32 (NaNs, ±0, ±inf).
        vec![spec(DataType::Float16, false, false, true)],
        vec![spec(DataType::Float32, true, false, false)],
        vec![spec(DataType::Float32, true, false, true)],
        // Composite keys: 64 and 128 bits and beyond.
        vec![
            spec(DataType::Int32, true, true, true),
            spec(DataType::Boolean, false, false, true),
        ],
        vec![
            spec(DataType::Float64, false, true, true),
            spec(DataType::Int32, true, false, false),
        ],
        vec![
            spec(DataType::Decimal128(38, 2), false, false, true),
            spec(DataType::Int64, true, true, true),
        ],
    ];
    let mut seed = 0;
    for specs in specs_list {
        for (k, algorithm) in [
            (1, Algorithm::Auto),
            (10, Algorithm::Bitonic),
            (10, Algorithm::Radix),
            (300, Algorithm::Auto),
            (3000, Algorithm::Radix),
        ] {
            for capacity in [1, 5000, 1 << 22] {
                seed += 1;
                check_selector(
                    &device,
                    specs.clone(),
                    k,
                    4,
                    6,
                    3000,
                    algorithm,
                    capacity,
                    seed,
                );
            }
        }
        // Narrow value domain: ties everywhere.
        seed += 1;
        check_selector(
            &device,
            specs.clone(),
            100,
            3,
            20,
            500,
            Algorithm::Radix,
            300,
            seed,
        );
    }
}

#[test]
fn gpu_selector_without_rows_or_with_k_zero() {
    let Some(device) = gpu_or_skip("gpu_selector_without_rows_or_with_k_zero") else {
        return;
    };
    let layout = KeyLayout::try_new(vec![spec(DataType::Int64, false, false, true)]).unwrap();
    for k in [0, 5] {
        let spec = SelectionSpec {
            layout: layout.clone(),
            k,
            program: None,
            final_choice: None,
            fault: Default::default(),
            watch: None,
        };
        let gpu =
            new_cuda_selector_with_capacity(&spec, Arc::clone(&device), DeviceAlgorithm::Radix, 1)
                .unwrap();
        let empty: ArrayRef = Arc::new(Int64Array::from(Vec::<i64>::new()));
        gpu.push(SelectInput {
            keys: &[empty],
            row_ids: RowIds::Range(0),
        })
        .unwrap();
        assert_eq!(gpu.finish().unwrap(), Vec::<u64>::new());
    }
    // All NULL: ties broken by row id.
    let spec1 = SelectionSpec {
        layout,
        k: 3,
        program: None,
        final_choice: None,
        fault: Default::default(),
        watch: None,
    };
    let gpu =
        new_cuda_selector_with_capacity(&spec1, Arc::clone(&device), DeviceAlgorithm::Radix, 1)
            .unwrap();
    let nulls: ArrayRef = Arc::new(Int64Array::from(vec![None::<i64>; 10]));
    gpu.push(SelectInput {
        keys: &[nulls],
        row_ids: RowIds::Range(100),
    })
    .unwrap();
    assert_eq!(gpu.finish().unwrap(), vec![100, 101, 102]);
}

#[test]
fn gpu_selector_rejects_mismatched_input_and_algorithms() {
    let Some(device) = gpu_or_skip("gpu_selector_rejects_mismatched_input") else {
        return;
    };
    let layout = KeyLayout::try_new(vec![spec(DataType::Int64, false, false, false)]).unwrap();
    let spec1 = SelectionSpec {
        layout: layout.clone(),
        k: 5,
        program: None,
        final_choice: None,
        fault: Default::default(),
        watch: None,
    };
    let gpu =
        new_cuda_selector_with_capacity(&spec1, Arc::clone(&device), DeviceAlgorithm::Bitonic, 1)
            .unwrap();
    let wrong: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
    assert!(
        gpu.push(SelectInput {
            keys: &[wrong],
            row_ids: RowIds::Range(0)
        })
        .is_err()
    );
    let with_nulls: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None]));
    assert!(
        gpu.push(SelectInput {
            keys: &[with_nulls],
            row_ids: RowIds::Range(0)
        })
        .is_err()
    );
    assert_eq!(resolve(&device, &spec1, Algorithm::Cpu), None);
    let big = SelectionSpec {
        layout: layout.clone(),
        k: bitonic_max_k(&device, &layout) + 1,
        program: None,
        final_choice: None,
        fault: Default::default(),
        watch: None,
    };
    assert!(
        new_cuda_selector_with_capacity(&big, Arc::clone(&device), DeviceAlgorithm::Bitonic, 1)
            .is_err()
    );
    assert_eq!(resolve(&device, &big, Algorithm::Bitonic), None);
    let algorithm = resolve(&device, &big, Algorithm::Auto).unwrap();
    let auto = new_cuda_selector_with_capacity(&big, Arc::clone(&device), algorithm, 1).unwrap();
    assert!(
        auto.describe().starts_with("cuda radix"),
        "{}",
        auto.describe()
    );
}

#[test]
fn gpu_detection_and_kernels_load() {
    match gpu() {
        None => eprintln!(
            "SKIP: gpu_detection_and_kernels_load: no GPU ({:?})",
            gpu_status()
        ),
        Some(device) => {
            eprintln!(
                "{} sm={} smem={}",
                device.describe(),
                device.sm_count,
                device.max_shared_per_block
            );
            device.kernels().unwrap();
        }
    }
}

/// Composite keys widened to 256 bits (an order-preserving embedding of every width).
fn widen(keys: EncodedKeys) -> Vec<U256> {
    match keys {
        EncodedKeys::W64(v) => v.into_iter().map(|x| U256::from_u128(x.into())).collect(),
        EncodedKeys::W128(v) => v.into_iter().map(U256::from_u128).collect(),
        EncodedKeys::W256(v) => v,
    }
}

#[test]
fn gpu_selector_randomised_against_both_the_cpu_selector_and_a_full_sort() {
    let Some(device) = gpu_or_skip("gpu_selector_randomised") else {
        return;
    };
    let types = all_key_types();
    let mut rng0 = Rng::new(424_242);
    let mut failures = Vec::new();
    for round in 0..150 {
        let specs: Vec<KeySpec> = (0..1 + rng0.below(2))
            .map(|_| {
                let t = match rng0.below(2) {
                    0 => DataType::Int64,
                    _ => types[rng0.below(types.len() as u64) as usize].clone(),
                };
                spec(
                    t,
                    rng0.below(2) == 1,
                    rng0.below(2) == 1,
                    rng0.below(2) == 1,
                )
            })
            .collect();
        let layout = KeyLayout::try_new(specs.clone()).unwrap();
        let k = [1, 2, 10, 100, 3000][rng0.below(5) as usize];
        let algorithm = [
            Algorithm::Auto,
            Algorithm::Radix,
            Algorithm::Bitonic,
            Algorithm::Sample,
        ][rng0.below(4) as usize];
        let capacity = [1, 100, 5000, 1 << 22][rng0.below(4) as usize];
        let (threads, batches) = (1 + rng0.below(8) as usize, 1 + rng0.below(8) as usize);
        let rows = [10, 500, 3000][rng0.below(3) as usize];
        let seed = rng0.next();
        let spec1 = SelectionSpec {
            layout: layout.clone(),
            k,
            program: None,
            final_choice: None,
            fault: Default::default(),
            watch: None,
        };
        let Some(algorithm) = resolve(&device, &spec1, algorithm) else {
            continue; // bitonic with too large a k
        };
        let gpu = new_cuda_selector_with_capacity(&spec1, Arc::clone(&device), algorithm, capacity)
            .unwrap();
        let cpu = cpu::new_selector(&spec1);
        let all = std::sync::Mutex::new(Vec::<(U256, u64)>::new());
        std::thread::scope(|scope| {
            for partition in 0..threads {
                let (cpu, gpu, specs, all, layout) = (
                    Arc::clone(&cpu),
                    Arc::clone(&gpu),
                    specs.clone(),
                    &all,
                    &layout,
                );
                scope.spawn(move || {
                    let mut rng = Rng::new(seed ^ (partition as u64 * 7919));
                    let mut next_row = 0u64;
                    for batch in 0..batches {
                        let n = 1 + rng.below(rows) as usize;
                        let (columns, explicit) =
                            pushed_batch(&specs, n, partition, next_row, &mut rng);
                        let row_ids = batch_row_ids(batch, partition, next_row, &explicit);
                        next_row += 2 * n as u64;
                        let keys = widen(layout.encode(&columns).unwrap());
                        all.lock().unwrap().extend(
                            keys.into_iter()
                                .enumerate()
                                .map(|(i, key)| (key, row_ids.get(i))),
                        );
                        let input = SelectInput {
                            keys: &columns,
                            row_ids,
                        };
                        cpu.push(input).unwrap();
                        gpu.push(input).unwrap();
                    }
                });
            }
        });
        let (expected, got) = (cpu.finish().unwrap(), gpu.finish().unwrap());
        let mut all = all.into_inner().unwrap();
        all.sort_unstable();
        let truth: Vec<u64> = all.iter().take(k).map(|p| p.1).collect();
        if got != truth || expected != truth {
            failures.push(format!(
                "round {round}: {} k={k} capacity={capacity} threads={threads} \
                 batches={batches} rows={rows} {specs:?}: cpu ok {}, gpu ok {}",
                gpu.describe(),
                expected == truth,
                got == truth
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `enqueue_select` leaves a sampled selection pending (its status unread, no host round trip
/// inside it) when its survivors are sorted on the device's count (small k, or few enough for
/// the chunk rank sort), and `finish` completes it; other selections are complete at once.
/// 2^20 positional 64-bit keys at k = 1024 leave ~4000–6000 survivors, past what the rank sort
/// took before it grew to 16384 pairs; k = n sorts the positional input by its keys alone.
/// The low 32 bits of each primary value, and the little-endian bytes of the keys of `kind`
/// (those 32 bits for `K32`, the whole value for `K64`).
fn keys_as(
    kind: datafusion_gpu_topk::internal::device::KeyWidth,
    p: &[u64],
) -> (Vec<u32>, Vec<u8>) {
    let k32: Vec<u32> = p.iter().map(|&v| v as u32).collect();
    let bytes = match kind {
        datafusion_gpu_topk::internal::device::KeyWidth::W32 => {
            k32.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        _ => p.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    (k32, bytes)
}

#[test]
fn gpu_enqueued_selections_finish_with_the_oracle_result() {
    use datafusion_gpu_topk::internal::device::{KeyWidth, TopKEngine};
    let Some(device) = gpu_or_skip("gpu_enqueued_selections_finish_with_the_oracle_result") else {
        return;
    };
    let n = 1 << 20;
    for dist in DISTS {
        let (p, _) = generate(dist, n, true, 17);
        let ids: Vec<u64> = (0..n as u64).collect();
        for kind in [KeyWidth::W32, KeyWidth::W64] {
            let (k32, bytes) = keys_as(kind, p.as_slice());
            let expected_of = |k| match kind {
                KeyWidth::W32 => oracle(&k32, &ids, k),
                _ => oracle(&p, &ids, k),
            };
            let mut engine = TopKEngine::new(&device, kind).unwrap();
            let mut pairs = engine.upload_pairs(&bytes, &ids).unwrap();
            pairs.set_positional(true);
            for (k, algorithm, pending) in [
                (1, DeviceAlgorithm::Sample, true),
                (1024, DeviceAlgorithm::Sample, true),
                (6000, DeviceAlgorithm::Sample, true),
                (1024, DeviceAlgorithm::Radix, false),
                // From k = n / 256 to n / 4 (32-bit keys) or below 3n / 4 (64-bit) the
                // top-bits selection (`top_bits_sorts`), read back at the finish; beyond, all
                // n sorted by their radix passes (`sample_sorts_whole`), complete when
                // enqueued.
                (50_000, DeviceAlgorithm::Sample, true),
                (100_000, DeviceAlgorithm::Sample, true),
                (200_000, DeviceAlgorithm::Sample, true),
                (300_000, DeviceAlgorithm::Sample, kind == KeyWidth::W64),
                (800_000, DeviceAlgorithm::Sample, false),
                // All of them: positional ids let the radix sort skip the id digits.
                (n, DeviceAlgorithm::Radix, false),
                (n, DeviceAlgorithm::Sample, false),
            ] {
                let what = format!("{dist:?} {kind:?} k={k} {algorithm:?}");
                let selection = engine.enqueue_select(&pairs, n, k, algorithm).unwrap();
                assert_eq!(selection.is_pending(), pending, "{what}");
                let (sorted, m) = engine.finish(selection).unwrap();
                assert_eq!(m, k, "{what}");
                let got = engine.download_ids(&sorted, m).unwrap();
                assert!(got == expected_of(k), "{what}");
            }
        }
    }
}

/// The top-bits selection (`top_bits_sorts`) against the oracle: positional 32- and 64-bit
/// keys of every distribution, up to the largest k it takes for each; a partial last tile,
/// several segment-sort blocks, the largest size it takes; big bins (kept bins too large for a
/// segment-sort block, split by their own sample: tie groups the bins' sample missed); its
/// second route (a kept bin too large for those too: the rank, chunk rank or merge sort of the
/// kept pairs, in no order inside their bins); equal keys split by position; quantile bins
/// where the sample shows a cluster; and the whole-input fallback when the sample foresees a
/// crowded bin.
#[test]
fn gpu_top_bits_selection_matches_the_oracle_on_each_route() {
    use datafusion_gpu_topk::internal::device::plan::top_bits_sorts;
    use datafusion_gpu_topk::internal::device::{KeyWidth, TopKEngine};
    let Some(device) = gpu_or_skip("gpu_top_bits_selection_matches_the_oracle") else {
        return;
    };
    // Uniform keys with one small value repeated on every `every`-th row from row `from`: from
    // row 1 (off the sampled rows, multiples of n / 256 here), on every 8th a bin of ~131K
    // equal keys below the k-th smallest, too large for the big-bin blocks; on every 64th one
    // of ~16K, a big bin (~1024 on every 1024th), and on every 4096th
    // a bin of ~256 in one of the octave bins below the sampled keys, which the segment sort
    // does not split in parts (its register network); from
    // row 0, on every 4th: a quarter of the sample, split by position where the bins span only
    // those (k = 20000), foreseen as one crowded bin where they span uniform keys too
    // (k = 200000).
    let repeated = |n: usize, seed: u64, every: usize, from: usize| -> Vec<u64> {
        let (mut p, _) = generate(Dist::Uniform, n, true, seed);
        for (i, v) in p.iter_mut().enumerate() {
            if i % every == from {
                *v = 77;
            }
        }
        p
    };
    let mut inputs: Vec<(String, usize, Vec<usize>, Vec<u64>)> = Vec::new();
    for (n, ks) in [
        (
            (1usize << 20) + 7,
            vec![
                8200usize,
                60_000,
                1 << 17,
                200_000,
                262_144,
                500_000,
                700_000,
            ],
        ),
        (1_500_001, vec![1 << 15]),
        (300_007, vec![4000]),
    ] {
        for dist in DISTS {
            let (p, _) = generate(dist, n, true, n as u64 ^ 0x70b);
            inputs.push((format!("{dist:?}"), n, ks.clone(), p));
        }
    }
    let n = (1 << 20) + 7;
    inputs.push((
        "crowded".into(),
        n,
        vec![200_000, 262_144],
        repeated(n, 4, 8, 1),
    ));
    inputs.push((
        "big".into(),
        n,
        vec![20_000, 60_000, 1 << 17],
        repeated(n, 5, 64, 1),
    ));
    inputs.push((
        "medium".into(),
        n,
        vec![20_000, 60_000],
        repeated(n, 6, 4096, 1),
    ));
    // ~1024 equal keys, one big bin below the k-th smallest.
    inputs.push((
        "cluster".into(),
        n,
        vec![4200, 30_000],
        repeated(n, 8, 1024, 1),
    ));
    inputs.push((
        "quarter".into(),
        n,
        vec![20_000, 200_000],
        repeated(n, 7, 4, 0),
    ));
    // Clusters that linear bins over the sample's range crowd, which the sample sees: 5% of
    // the keys below 2^12, the rest in [2^30, 2^31) (a NaN mix's −NaN payloads), so that the
    // bins are quantile bins and every kept bin fits the segment sort (at k = n/8 to 3n/8
    // too: its sampled keys are distinct); and zipf-like counts
    // below 2^31 (ties below a heavy tail, split by position).
    let mut rng = Rng::new(9);
    let gap: Vec<u64> = (0..n)
        .map(|_| match rng.below(20) {
            0 => rng.next() >> 52,
            _ => (1 << 30) + (rng.next() >> 34),
        })
        .collect();
    inputs.push((
        "gap".into(),
        n,
        vec![4200, 20_000, 60_000, 1 << 17, 3 << 16, 1 << 18, 3 << 17],
        gap,
    ));
    let zipf: Vec<u64> = (0..n)
        .map(|_| {
            let count = ((1.0 - rng.unit()).powf(-1.0 / 1.1) - 1.0).floor().min(1e9) as u64;
            (1 << 31) - count
        })
        .collect();
    inputs.push(("zipf".into(), n, vec![4200, 20_000, 60_000, 1 << 17], zipf));
    // Floats of zipf-like counts (the encodings of −count as f32): tie groups between sampled
    // keys sit in gaps of 2^20 encodings, which no bin splits: big bins; from k = n/6, 32-bit
    // keys' sampled tie groups that far apart are foreseen as crowding (the whole sort).
    let zipf_float: Vec<u64> = (0..n)
        .map(|_| {
            let count = ((1.0 - rng.unit()).powf(-1.0 / 1.1) - 1.0).floor().min(1e9) as f32;
            u64::from(!(-count).to_bits())
        })
        .collect();
    inputs.push((
        "zipf-float".into(),
        n,
        vec![4200, 20_000, 1 << 15, 60_000, 1 << 17, 3 << 16, 1 << 18],
        zipf_float,
    ));
    // The same as f64 (64-bit keys only): their words span exponents, so the coordinates are
    // the words alone, and each sampled count's ties take a tie piece, split by position.
    let zipf_double: Vec<u64> = (0..n)
        .map(|_| {
            let count = ((1.0 - rng.unit()).powf(-1.0 / 1.1) - 1.0).floor().min(1e9);
            !(-count).to_bits()
        })
        .collect();
    inputs.push((
        "zipf-double".into(),
        n,
        vec![4200, 60_000, 65_536, 1 << 17, 3 << 16, 1 << 18, 3 << 17],
        zipf_double,
    ));
    for (dist, n, ks, p) in &inputs {
        let n = *n;
        let ids: Vec<u64> = (0..n as u64).collect();
        for kind in [KeyWidth::W32, KeyWidth::W64] {
            if dist == "zipf-double" && kind == KeyWidth::W32 {
                continue;
            }
            let (k32, bytes) = keys_as(kind, p.as_slice());
            let mut engine = TopKEngine::new(&device, kind).unwrap();
            let mut pairs = engine.upload_pairs(&bytes, &ids).unwrap();
            pairs.set_positional(true);
            for &k in ks {
                if !top_bits_sorts(kind, n, k, true, None) {
                    continue;
                }
                let what = format!("{dist} {kind:?} n={n} k={k}");
                let expected = match kind {
                    KeyWidth::W32 => oracle(&k32, &ids, k),
                    _ => oracle(p, &ids, k),
                };
                let selection = engine
                    .enqueue_select(&pairs, n, k, DeviceAlgorithm::Sample)
                    .unwrap();
                assert!(selection.is_pending(), "{what}");
                let (sorted, m, more) = engine.finish_reporting(selection).unwrap();
                assert_eq!(m, k, "{what}");
                let got = engine.download_ids(&sorted, m).unwrap();
                assert!(got == expected, "{what}");
                match dist.as_str() {
                    // Uniform keys take the segment sort, and so do equal keys (their bins
                    // split them by position) and big bins; the crowded bin the second route.
                    "Uniform" | "medium" | "AllEqual" | "gap" | "big" | "cluster"
                    | "zipf-double" => {
                        assert!(!more, "{what}: the segment sort")
                    }
                    "zipf-float" if kind == KeyWidth::W32 && 6 * k >= n => {
                        assert!(more, "{what}: foreseen crowding")
                    }
                    "zipf-float" if k <= 1 << 17 => assert!(!more, "{what}: the segment sort"),
                    "crowded" => assert!(more, "{what}: the second route"),
                    "quarter" => assert_eq!(more, k == 200_000, "{what}: foreseen crowding"),
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn gpu_merge_sort_matches_the_oracle_at_every_width_and_truncation() {
    use datafusion_gpu_topk::internal::device::{KeyWidth, TopKEngine};
    let Some(device) =
        gpu_or_skip("gpu_merge_sort_matches_the_oracle_at_every_width_and_truncation")
    else {
        return;
    };
    // Sizes of hundreds of tiles (an odd number: runs without a partner in most rounds) and
    // of a few, ties, sorted inputs and shuffled or positional ids; the sort called directly
    // (host count), whole and truncated at k, then the device-counted sort of a sampled
    // selection's survivors.
    for kind in [KeyWidth::W32, KeyWidth::W64, KeyWidth::W128, KeyWidth::W256] {
        let big = if kind.bits() <= 64 {
            3_000_017
        } else {
            1_200_007
        };
        for (n, dist, positional) in [
            (big, Dist::Uniform, false),
            (big, Dist::HeavyTies, true),
            (big / 3, Dist::Narrow, false),
            (big / 3, Dist::AllEqual, false),
            (big / 3, Dist::SortedDesc, true),
            (5000, Dist::HeavyTies, false),
        ] {
            let (p, shuffled) = generate(dist, n, true, n as u64 ^ 41);
            let ids: Vec<u64> = if positional {
                (0..n as u64).collect()
            } else {
                shuffled
            };
            let (bytes, expected) = keys_of_width(kind, &p, &ids);
            let mut engine = TopKEngine::new(&device, kind).unwrap();
            let mut pairs = engine.upload_pairs(&bytes, &ids).unwrap();
            pairs.set_positional(positional);
            let what = format!("{kind:?} {dist:?} positional={positional} n={n}");
            // The merge sort, whole and truncated at k (host count; positional inputs' ids
            // not read); planned for n pairs, and for more (rounds past the one that leaves a
            // single run, an odd or an even number of them, then copy nothing but maybe once).
            for (k, cap) in [
                (n, n),
                (n / 2 + 7, n),
                (3000, n),
                (1, n),
                (n, 2 * n + 1),
                (n / 2 + 7, 4 * n + 3),
                (3000, 8 * n + 5),
            ] {
                let sorted = engine
                    .merge_sort(&pairs, n, 0, cap, k, 0)
                    .unwrap()
                    .into_pairs(n);
                let got = engine.download_ids(&sorted, k).unwrap();
                assert!(got == expected[..k], "{what} k={k} cap={cap}: merge sort");
            }
            // Device-counted: a sampled selection of most of them (beyond the chunk rank
            // sort's capacity, the merge sort takes its survivors; positional 32- and 64-bit
            // keys of the wide passes' sizes are sorted whole instead).
            let k = n * 4 / 5;
            let selection = engine
                .enqueue_select(&pairs, n, k, DeviceAlgorithm::Sample)
                .unwrap();
            let (sorted, m) = engine.finish(selection).unwrap();
            assert_eq!(m, k, "{what}");
            let got = engine.download_ids(&sorted, m).unwrap();
            assert!(got == expected[..k], "{what} k={k}: sampled selection");
        }
    }
}

#[test]
fn gpu_packed_merge_sort_matches_the_oracle() {
    use datafusion_gpu_topk::internal::device::{KeyWidth, TopKEngine};
    let Some(device) = gpu_or_skip("gpu_packed_merge_sort_matches_the_oracle") else {
        return;
    };
    // Pairs whose varying key bits and row ids fit a 64-bit word, sorted through packed words
    // (a fused selection's large-k route) with the count known to the host: ties, runs, all
    // equal and shuffled ids, from two tiles (one round, the unpacking one) to 2.6M words
    // (eleven); whole and truncated at k.
    for kind in [KeyWidth::W32, KeyWidth::W64] {
        for (n, dist) in [
            (1_000_003, "uniform"),
            (2_600_000, "ties"),
            (300_007, "runs"),
            (200_000, "equal"),
            (4097, "uniform"),
        ] {
            let mut rng = Rng::new(n as u64 ^ 97);
            let mut ids: Vec<u64> = (0..n as u64).collect();
            for i in (1..n).rev() {
                ids.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let keys: Vec<u64> = (0..n)
                .map(|i| match dist {
                    "uniform" => 0x5a00_0000 | rng.below(1 << 24),
                    "ties" => 0x5a00_0000 | u64::from(rng.next().leading_zeros()),
                    "runs" => 0x5a00_0000 | (i as u64 / 977),
                    _ => 0x5a00_0000,
                })
                .map(|v| if kind == KeyWidth::W64 { v << 29 } else { v })
                .collect();
            let (bytes, expected) = match kind {
                KeyWidth::W32 => {
                    let k32: Vec<u32> = keys.iter().map(|&v| v as u32).collect();
                    let bytes = k32.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>();
                    (bytes, oracle(&k32, &ids, n))
                }
                _ => {
                    let bytes = keys.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (bytes, oracle(&keys, &ids, n))
                }
            };
            let mut engine = TopKEngine::new(&device, kind).unwrap();
            let pairs = engine.upload_pairs(&bytes, &ids).unwrap();
            for k in [n, n / 2 + 7, 5000, 1] {
                let what = format!("{kind:?} {dist} n={n} k={k}");
                let sorted = engine
                    .sort_pairs_packed(&pairs, n, k, n as u64)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{what}: not packed"));
                let m = k.min(n);
                let got = engine.download_ids(&sorted, m).unwrap();
                assert!(got == expected[..m], "{what}: packed merge sort");
            }
        }
    }
}

/// Keys of `kind` derived from the 64-bit words `p` (as the merge sort's test spreads them
/// over the wider widths): their bytes, and the ids of all n pairs in sorted order.
fn keys_of_width(
    kind: datafusion_gpu_topk::internal::device::KeyWidth,
    p: &[u64],
    ids: &[u64],
) -> (Vec<u8>, Vec<u64>) {
    use datafusion_gpu_topk::internal::device::KeyWidth;
    let n = p.len();
    let words: Vec<[u64; 4]> = p
        .iter()
        .map(|&v| [v.rotate_left(29), v.rotate_left(7), v >> 3, v])
        .collect();
    match kind {
        KeyWidth::W32 => {
            let keys: Vec<u32> = p.iter().map(|&v| (v >> 32) as u32).collect();
            let bytes = keys.iter().flat_map(|v| v.to_le_bytes()).collect();
            (bytes, oracle(&keys, ids, n))
        }
        KeyWidth::W64 => {
            let bytes = p.iter().flat_map(|v| v.to_le_bytes()).collect();
            (bytes, oracle(p, ids, n))
        }
        KeyWidth::W128 => {
            let keys: Vec<u128> = words
                .iter()
                .map(|w| (u128::from(w[3]) << 64) | u128::from(w[2]))
                .collect();
            let bytes = keys.iter().flat_map(|v| v.to_le_bytes()).collect();
            (bytes, oracle(&keys, ids, n))
        }
        KeyWidth::W256 => {
            let keys: Vec<U256> = words
                .iter()
                .map(|w| U256 {
                    hi: (u128::from(w[3]) << 64) | u128::from(w[2]),
                    lo: (u128::from(w[1]) << 64) | u128::from(w[0]),
                })
                .collect();
            let bytes = words
                .iter()
                .flat_map(|w| w.iter().flat_map(|x| x.to_le_bytes()))
                .collect();
            (bytes, oracle(&keys, ids, n))
        }
    }
}

#[test]
fn gpu_radix_sort_matches_the_oracle_through_every_pass_kind() {
    use datafusion_gpu_topk::internal::device::plan::{
        ONESWEEP_MAX_TILES, ONESWEEP_WIDE_MAX_TILES, radix_sort_tile, radix_sort_wide_tile,
    };
    use datafusion_gpu_topk::internal::device::{KeyWidth, TopKEngine};
    let Some(device) = gpu_or_skip("gpu_radix_sort_matches_the_oracle_through_every_pass_kind")
    else {
        return;
    };
    // Sizes on both sides of each pass kind's bounds: narrow Onesweep tiles, wide tiles with
    // the grouped look-back (one group, a partial last group, the most tiles), and
    // reduce-then-scan; ties, sorted inputs, positional ids (key digits only) and shuffled
    // ones (row id digits too).
    for kind in [KeyWidth::W32, KeyWidth::W64, KeyWidth::W128, KeyWidth::W256] {
        let narrow = ONESWEEP_MAX_TILES * radix_sort_tile(kind);
        let wide = radix_sort_wide_tile(kind);
        for (n, dist, positional) in [
            (narrow, Dist::Uniform, false),
            (narrow + 1, Dist::HeavyTies, true),
            (16 * wide - 5, Dist::AllEqual, false),
            (37 * wide + 11, Dist::Uniform, true),
            (37 * wide + 11, Dist::HeavyTies, false),
            (ONESWEEP_WIDE_MAX_TILES * wide, Dist::SortedDesc, true),
            (ONESWEEP_WIDE_MAX_TILES * wide + 1, Dist::Uniform, false),
        ] {
            let (p, _) = generate(dist, n, true, n as u64 ^ 43);
            // Positional ids, or a permutation of them (the prime multiplier is coprime with
            // every n here): row id digits below the bound n.
            let ids: Vec<u64> = (0..n as u64)
                .map(|i| {
                    if positional {
                        i
                    } else {
                        i * 1_000_000_007 % n as u64
                    }
                })
                .collect();
            let (bytes, expected) = keys_of_width(kind, &p, &ids);
            let mut engine = TopKEngine::new(&device, kind).unwrap();
            let mut pairs = engine.upload_pairs(&bytes, &ids).unwrap();
            // Positional: the passes write positions instead of reading the input's ids.
            pairs.set_positional(positional);
            let id_bound = if positional { 1 } else { n as u64 };
            let sorted = engine.radix_sort(&pairs, n, id_bound).unwrap();
            let got = engine.download_ids(&sorted, n).unwrap();
            assert!(
                got == expected,
                "{kind:?} {dist:?} positional={positional} n={n}: radix sort"
            );
        }
    }
}

/// Device times of the selection kernels on resident data (`cargo test -- --ignored
/// gpu_timing`): a first look, not the benchmark.
#[test]
#[ignore]
fn gpu_timing_of_select_sorted() {
    use datafusion_gpu_topk::internal::device::{GpuTimer, KeyWidth, TopKEngine};
    let Some(device) = gpu_or_skip("gpu_timing_of_select_sorted") else {
        return;
    };
    device.pool.set_poison(false);
    let n = 1 << 27;
    for (dist, kind) in [
        (Dist::Uniform, KeyWidth::W32),
        (Dist::Uniform, KeyWidth::W64),
        (Dist::Narrow, KeyWidth::W64),
        (Dist::AllEqual, KeyWidth::W64),
        (Dist::Uniform, KeyWidth::W128),
    ] {
        let (p, ids) = generate(dist, n, kind != KeyWidth::W32, 3);
        let bytes: Vec<u8> = match kind {
            KeyWidth::W32 => p.iter().flat_map(|&v| (v as u32).to_le_bytes()).collect(),
            KeyWidth::W64 => p.iter().flat_map(|&v| v.to_le_bytes()).collect(),
            _ => p
                .iter()
                .flat_map(|&v| (u128::from(v) << 64).to_le_bytes())
                .collect(),
        };
        let mut engine = TopKEngine::new(&device, kind).unwrap();
        let pairs = engine.upload_pairs(&bytes, &ids).unwrap();
        for (k, algorithm) in [
            (50, DeviceAlgorithm::Bitonic),
            (1024, DeviceAlgorithm::Bitonic),
            (50, DeviceAlgorithm::Radix),
            (100_000, DeviceAlgorithm::Radix),
        ] {
            let mut times = Vec::new();
            for run in 0..6 {
                let timer = GpuTimer::start(engine.stream()).unwrap();
                let (sorted, _) = engine.select_sorted(&pairs, n, k, algorithm).unwrap();
                let ms = timer.stop().unwrap();
                drop(sorted);
                if run > 0 {
                    times.push(ms); // the first run warms up the pool
                }
            }
            times.sort_by(f32::total_cmp);
            // Read floor: the pairs once at ~3 TB/s.
            let floor = (n * (kind.key_bytes() + 8)) as f32 / 3.0e9;
            eprintln!(
                "n=2^27 {kind:?} {dist:?} k={k} {algorithm:?}: {:.2} ms median of {} \
                 ({:.1}x the {floor:.2} ms read floor)",
                times[times.len() / 2],
                times.len(),
                times[times.len() / 2] / floor
            );
        }
    }
}

// ---- generated programs (src/fusion) ------------------------------------------------------------

/// The generated program of a query (planned with the CPU backend, which plans fusion too)
/// run by the CUDA selector with a tiny candidate buffer (many reductions and threshold
/// updates), against the CPU selector fed by DataFusion's own evaluation of the same
/// predicate and keys. Random batches with NULLs, NaNs and edge values (the differential
/// tests' table), explicit consecutive ids.
#[tokio::test]
async fn generated_programs_match_datafusion_evaluation_across_reductions() {
    use datafusion::arrow::array::{AsArray, RecordBatch};
    use datafusion::arrow::compute::{filter_record_batch, prep_null_mask_filter};
    fn null_as_false(
        mask: &datafusion::arrow::array::BooleanArray,
    ) -> datafusion::arrow::array::BooleanArray {
        match mask.null_count() {
            0 => mask.clone(),
            _ => prep_null_mask_filter(mask),
        }
    }
    use datafusion_gpu_topk::{Backend, GpuTopKConfig, GpuTopKExec, SessionStateBuilderExt};

    let data = crate::differential::table(11, &[&[700, 1, 333, 2048, 999, 64, 1500, 5]]);
    let ctx = {
        let state = datafusion::execution::SessionStateBuilder::new()
            .with_default_features()
            .with_gpu_topk(GpuTopKConfig::default().with_backend(Backend::Cpu))
            .build();
        datafusion::prelude::SessionContext::new_with_state(state)
    };
    crate::common::register(&ctx, "t", vec![data[0][..1].to_vec()]);
    let queries = [
        (
            "WHERE i32 > 0 OR b",
            "f64 * 2.0 - CAST(i16 AS DOUBLE) DESC NULLS LAST, i64",
            10,
        ),
        ("", "f32 / f32, CAST(f32 AS DOUBLE) * f64 DESC", 37),
        (
            "WHERE NOT (i16 >= -3) AND i8 IS NOT NULL",
            "i8 + i8 DESC, u64 * u64",
            100,
        ),
        (
            "WHERE nan_only = nan_only AND f64 <> -0.0",
            "-f64, ts_ns",
            5,
        ),
        ("WHERE s LIKE 'a%'", "g DESC, u8 - u8", 64),
        (
            "WHERE ts_ns < TIMESTAMP '2000-01-01 00:00:00'",
            "i64 / 7, i64 % 5 DESC",
            1,
        ),
        ("", "b NULLS FIRST, d32 DESC", 300),
        (
            "WHERE i8 IN (1, NULL, -128) OR f64 NOT IN (0.0, -0.0, 1.5)",
            "CASE g WHEN 1 THEN f64 WHEN 2 THEN -f64 END DESC, round(f32, 1)",
            40,
        ),
        (
            "WHERE CASE WHEN i8 IS NULL THEN b ELSE i8 > 0 END",
            "floor(f64) DESC, ceil(f32), abs(f64), round(f64)",
            70,
        ),
        (
            "WHERE ds IN ('en', 'zz', NULL) OR ds <> 'es'",
            "i16 DESC",
            90,
        ),
        // Guarded operations; the table's edge values make some batches rerun on the host.
        (
            "WHERE i32 / 7 > 1 OR u8 % 3 = 0",
            "sqrt(abs(f64)) DESC, i64 / 3",
            30,
        ),
        ("WHERE i16 > 0", "sqrt(f64), abs(i8) DESC", 30),
        (
            "WHERE ts_ns + INTERVAL '1 day' < TIMESTAMP '2000-01-01 00:00:00'",
            "ts_us - INTERVAL '2 days 3 hours' DESC, ts_s + INTERVAL '1 minute'",
            45,
        ),
    ];
    fn find(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Option<&GpuTopKExec> {
        plan.downcast_ref::<GpuTopKExec>()
            .or_else(|| plan.children().into_iter().find_map(|c| find(c)))
    }
    // Planned first (also without a GPU): every query must get a program.
    let mut planned = Vec::new();
    for (filter, order, k) in queries {
        let sql = format!("SELECT rid FROM t {filter} ORDER BY {order} LIMIT {k}");
        let plan = crate::common::physical_plan(&ctx, &sql).await.unwrap();
        let spec = find(&plan)
            .unwrap_or_else(|| panic!("{sql}: no operator"))
            .spec()
            .clone();
        let program = spec
            .fusion
            .program
            .clone()
            .unwrap_or_else(|| panic!("{sql}: no program: {}", spec.fusion.describe(true)));
        // The operator's input is a projection of the table: its columns, by name.
        let input = find(&plan).unwrap().input().schema();
        let columns: Vec<usize> = input
            .fields()
            .iter()
            .map(|f| data[0][0].schema().index_of(f.name()).unwrap())
            .collect();
        planned.push((sql, spec, program, k, columns));
    }
    let Some(device) =
        gpu_or_skip("generated_programs_match_datafusion_evaluation_across_reductions")
    else {
        return;
    };
    let mut compared = 0;
    'queries: for (sql, spec, program, k, projection) in planned {
        for algorithm in [Algorithm::Radix, Algorithm::Auto] {
            let selection = SelectionSpec {
                layout: spec.layout.clone(),
                k,
                program: Some(Arc::clone(&program)),
                final_choice: None,
                fault: Default::default(),
                watch: None,
            };
            let gpu = new_cuda_selector_with_capacity(
                &selection,
                Arc::clone(&device),
                resolve(&device, &selection, algorithm).unwrap(),
                256,
            )
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let cpu = cpu::new_selector(&selection);
            let (mut first_id, mut passed_gpu, mut passed_cpu) = (0u64, 0usize, 0usize);
            for batch in &data[0] {
                let batch = &batch.project(&projection).unwrap();
                let n = batch.num_rows();
                // Reference: DataFusion evaluates the predicate, then the keys on the survivors.
                // Its evaluation may fail on a row (sqrt of a negative number, a timestamp out
                // of range): the generated program must then send the query to the host
                // (checked below).
                let reference = || -> datafusion::error::Result<(Vec<ArrayRef>, Vec<u64>)> {
                    let (filtered, ids): (RecordBatch, Vec<u64>) = match &spec.filter {
                        Some(predicate) => {
                            let mask = predicate.evaluate(batch)?.into_array(n)?;
                            let mask = null_as_false(mask.as_boolean());
                            let ids = mask
                                .values()
                                .set_indices()
                                .map(|i| first_id + i as u64)
                                .collect();
                            (filter_record_batch(batch, &mask)?, ids)
                        }
                        None => (batch.clone(), (first_id..first_id + n as u64).collect()),
                    };
                    let keys = spec
                        .sort_exprs
                        .iter()
                        .map(|s| s.expr.evaluate(&filtered)?.into_array(ids.len()))
                        .collect::<datafusion::error::Result<_>>()?;
                    Ok((keys, ids))
                };
                let reference = reference();
                let datafusion_fails = reference.is_err();
                if let Ok((keys, ids)) = &reference {
                    passed_cpu += ids.len();
                    cpu.push(SelectInput {
                        keys,
                        row_ids: RowIds::Explicit(ids),
                    })
                    .unwrap();
                }
                // The program reads the raw columns (and the host predicate, when it has one).
                use datafusion_gpu_topk::internal::fusion::{self, KernelInput};
                // Two chunks per row input (the operator pushes several batches at once); one
                // lookup table per dictionary input.
                let h = n / 3;
                let columns: Vec<Vec<ArrayRef>> = program
                    .inputs
                    .iter()
                    .map(|input| {
                        let whole = match input {
                            KernelInput::Column(c) => Arc::clone(batch.column(*c)),
                            KernelInput::HostPredicate => {
                                let predicate = spec.filter.as_ref().unwrap();
                                let mask =
                                    predicate.evaluate(batch).unwrap().into_array(n).unwrap();
                                Arc::new(null_as_false(mask.as_boolean())) as ArrayRef
                            }
                            KernelInput::DictionaryCodes(c) => {
                                fusion::dictionary_codes(batch.column(*c)).unwrap()
                            }
                            KernelInput::DictionaryMatch { column, values } => {
                                return vec![
                                    fusion::dictionary_match(batch.column(*column), values)
                                        .unwrap(),
                                ];
                            }
                        };
                        vec![whole.slice(0, h), whole.slice(h, n - h)]
                    })
                    .collect();
                let admitted =
                    match gpu.push_columns(datafusion_gpu_topk::internal::select::ColumnsInput {
                        columns: &columns,
                        first_id,
                    }) {
                        Ok(_) if datafusion_fails => {
                            panic!("{sql}: DataFusion fails on this batch, the program did not")
                        }
                        Ok(admitted) => admitted,
                        // Two different NaNs added or multiplied, or a row DataFusion fails on: the
                        // operator reruns such a query on the host (the differential tests check
                        // that end to end).
                        Err(e) if e.to_string().contains("only the host reproduces") => {
                            eprintln!("{sql}: rerun on the host: {e}");
                            continue 'queries;
                        }
                        Err(e) => panic!("{sql}: {e}"),
                    };
                passed_gpu += admitted.passed;
                assert!(
                    admitted.rows.windows(2).all(|w| w[0] < w[1])
                        && admitted.rows.iter().all(|&r| (r as usize) < n)
                );
                first_id += n as u64;
            }
            assert_eq!(passed_gpu, passed_cpu, "{sql}: rows passing the predicate");
            let expected = cpu.finish().unwrap();
            let got = gpu.finish().unwrap_or_else(|e| panic!("{sql}: {e}"));
            assert_eq!(got, expected, "{sql} ({algorithm}): winners differ");
            assert_eq!(got.len(), k.min(passed_cpu), "{sql}");
            compared += 1;
        }
    }
    assert!(compared >= 10, "only {compared} of 14 selections compared");
}

/// The device algorithm a setting resolves to for `spec`, as the cost model resolves it
/// (`None`: it cannot run this k).
fn resolve(
    device: &GpuDevice,
    spec: &SelectionSpec,
    algorithm: Algorithm,
) -> Option<DeviceAlgorithm> {
    datafusion_gpu_topk::internal::cost::device_algorithm(device, &spec.layout, spec.k, algorithm)
        .ok()
}
