//! The device selections of host-encoded keys against an oracle: every width, size, k and
//! distribution, enqueued selections, and each route of the top-bits selection.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dist {
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

pub(super) const DISTS: [Dist; 7] = [
    Dist::Uniform,
    Dist::AllEqual,
    Dist::AllMax,
    Dist::Narrow,
    Dist::SortedAsc,
    Dist::SortedDesc,
    Dist::HeavyTies,
];

pub(super) fn f32_key(x: f32) -> u32 {
    let b = x.to_bits();
    b ^ if b >> 31 == 1 { u32::MAX } else { 1 << 31 }
}

/// Primary values (the most significant 32 or 64 key bits) and unique, shuffled row ids.
pub(super) fn generate(dist: Dist, n: usize, wide: bool, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let mut rng = Rng::new(seed);
    let keys = (0..n as u64)
        .map(|i| match dist {
            Dist::Uniform if wide => rng.next_u64(),
            Dist::Uniform => rng.next_u64() >> 32,
            Dist::AllEqual => 0x1234_5678,
            Dist::AllMax if wide => u64::MAX,
            Dist::AllMax => u64::from(u32::MAX),
            Dist::Narrow => {
                let v = u64::from(f32_key(128.6 + 0.1 * rng.unit() as f32));
                if wide {
                    v << 32 | (rng.next_u64() >> 62)
                } else {
                    v
                }
            }
            Dist::SortedAsc => i * 3,
            Dist::SortedDesc => (n as u64 - i) * 3,
            Dist::HeavyTies => u64::from(rng.next_u64().leading_zeros()),
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
pub(super) fn check_select(device: &Arc<GpuDevice>, dist: Dist, n: usize, k: usize, seed: u64) {
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

/// The low 32 bits of each primary value, and the little-endian bytes of the keys of `kind`
/// (those 32 bits for `W32`, the whole value for `W64`).
pub(super) fn keys_as(
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

/// `enqueue_select` leaves a sampled selection pending (its status unread, no host round trip
/// inside it) when its survivors are sorted on the device's count (small k, or few enough for
/// the chunk rank sort), and `finish` completes it; other selections are complete at once.
/// 2^20 positional 64-bit keys at k = 1024 leave ~4000–6000 survivors, more than the rank sort
/// takes; k = n sorts the positional input by its keys alone.
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
            0 => rng.next_u64() >> 52,
            _ => (1 << 30) + (rng.next_u64() >> 34),
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
