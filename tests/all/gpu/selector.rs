//! The CUDA selector against the CPU selector: partitions pushing concurrently, reductions,
//! empty inputs, mismatched input, and randomised layouts against a full sort.

use super::*;

/// One pushed batch of `n` random rows for `specs`, with the explicit row ids a filtered batch
/// would carry (increasing, with gaps) starting at `next_row` of `partition`.
pub(super) fn pushed_batch(
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
pub(super) fn batch_row_ids(
    batch: usize,
    partition: usize,
    next_row: u64,
    explicit: &[u64],
) -> RowIds<'_> {
    if batch % 2 == 1 {
        RowIds::Explicit(explicit)
    } else {
        RowIds::Range(row_id(partition, next_row))
    }
}

#[allow(clippy::too_many_arguments)]
/// Pushes the same batches (from several threads, one per partition) to a CUDA selector and
/// to the CPU selector and compares their results.
pub(super) fn check_selector(
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
    let spec = SelectionSpec::new(layout, k);
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
        let spec = SelectionSpec::new(layout.clone(), k);
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
    let spec1 = SelectionSpec::new(layout, 3);
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
    let spec1 = SelectionSpec::new(layout.clone(), 5);
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
    let big = SelectionSpec::new(layout.clone(), bitonic_max_k(&device, &layout) + 1);
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
pub(super) fn widen(keys: EncodedKeys) -> Vec<U256> {
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
        let seed = rng0.next_u64();
        let spec1 = SelectionSpec::new(layout.clone(), k);
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
