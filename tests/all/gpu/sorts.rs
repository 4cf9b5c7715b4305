//! The device sorts against an oracle: the merge sort (pairs and packed words) at every
//! width and truncation, and the radix sort through every pass kind.

use super::*;

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
                    "ties" => 0x5a00_0000 | u64::from(rng.next_u64().leading_zeros()),
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
pub(super) fn keys_of_width(
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
