use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;

use super::*;
use crate::cost::calibration::cpu::CpuRates;
use crate::cost::model::h100_like;
use crate::device::{DeviceSlot, GROUP_SAMPLE, GroupAlgorithm};
use crate::device::{GpuError, GpuResult};
use crate::keys::KeySpec;

/// Few large groups drop pairs by their limits (30 languages, 3 each); many small groups
/// (a user's tweets), a K as large as the groups, and an unknown count sort them all.
#[test]
fn the_group_algorithm_follows_groups_and_k() {
    let rows = 20_000_000;
    let (algorithm, sorted) = group_algorithm(Some(30), 3, rows);
    assert_eq!(algorithm, GroupAlgorithm::Threshold);
    assert_eq!(sorted, 30 * 3 * rows.div_ceil(GROUP_SAMPLE));
    assert_eq!(
        group_algorithm(Some(4_500_000), 10, rows),
        (GroupAlgorithm::SegmentedSort, rows)
    );
    assert_eq!(
        group_algorithm(Some(30), 100_000, rows).0,
        GroupAlgorithm::SegmentedSort
    );
    assert_eq!(
        group_algorithm(None, 2, rows).0,
        GroupAlgorithm::SegmentedSort
    );
    assert_eq!(
        group_algorithm(Some(4_500_000), 1, rows),
        (GroupAlgorithm::Min, 4_500_000)
    );
    assert_eq!(group_algorithm(Some(30), 1, rows).0, GroupAlgorithm::Min);
    assert_eq!(group_algorithm(None, 1, rows), (GroupAlgorithm::Min, rows));
    assert_eq!(
        group_algorithm(Some(1), 2, 0).0,
        GroupAlgorithm::SegmentedSort
    );
    assert_eq!(
        group_algorithm(Some(40), 3, 20_000).0,
        GroupAlgorithm::Threshold
    );
}

/// Before the device is started, `auto` keeps a query the CPU path ends first off the
/// device (and still loads a whole table for the next query); a larger or unknown input
/// starts it; other backends never ask.
#[test]
fn the_cpu_path_runs_while_starting_the_device_would_take_longer() {
    let estimate = |rows: Option<usize>, whole_table: bool| Estimate {
        rows,
        bytes_per_row: 8,
        compile: false,
        resident: 0.0,
        whole_table,
        decoded: false,
        pages: false,
    };
    let small = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), true), &RATES);
    match small {
        Some(Placement::Run {
            plan: SelectionPlan::Cpu { warm_up: true },
            reason,
            prediction: None,
        }) => assert!(reason.contains("GPU is not started"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let streamed = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), false), &RATES);
    assert!(matches!(
        streamed,
        Some(Placement::Run {
            plan: SelectionPlan::Cpu { warm_up: false },
            ..
        })
    ));
    assert_eq!(
        cpu_before_start(Backend::Auto, &estimate(Some(1_000_000_000), true), &RATES),
        None
    );
    assert_eq!(
        cpu_before_start(Backend::Auto, &estimate(None, true), &RATES),
        None
    );
    assert_eq!(
        before_start(
            Backend::Cuda,
            &estimate(Some(1_000), true),
            &StartFacts {
                started: false,
                slow_start: true,
                cpu: Some(RATES),
            }
        ),
        None
    );
}

/// The whole-table path ships only the columns not resident, and a resident table costs
/// a pass at device bandwidth: far below the CPU path, and below streaming the input.
#[test]
fn a_whole_table_costs_its_missing_columns_and_one_pass() {
    let m = h100_like();
    let (n, k, kind) = (250_000_000, 50, KeyWidth::W32);
    let estimate = |resident: f64, whole_table: bool| Estimate {
        rows: Some(n),
        bytes_per_row: 12,
        compile: false,
        resident,
        whole_table,
        decoded: false,
        pages: false,
    };
    let time =
        |e: &Estimate| operator_seconds(&m, 0.0, DeviceAlgorithm::Sample, n, k, kind, e).unwrap();
    let cold = time(&estimate(0.0, true));
    let half = time(&estimate(0.5, true));
    let warm = time(&estimate(1.0, true));
    let shipped = STAGED_TRANSFER * m.transfer_time(n * 12);
    assert!(
        cold > shipped && cold < 1.2 * shipped,
        "{cold} vs {shipped}"
    );
    assert!(warm < half && half < cold, "{warm} {half} {cold}");
    // Files loaded as their pages: the host reads them before they are staged.
    let pages = time(&Estimate {
        pages: true,
        ..estimate(0.0, true)
    });
    let read = PAGES_TRANSFER * m.transfer_time(n * 12);
    assert!(pages > read && pages < cold + read, "{pages} vs {read}");
    assert!(warm < 0.05 * m.cpu_time(n), "{warm} vs {}", m.cpu_time(n));
    assert!(
        warm < time(&estimate(1.0, false)),
        "streaming reduces in pushes"
    );
}

/// Files not yet resident run on the CPU path under `auto` (and load in the background);
/// resident ones, in-memory tables and a forced backend are the model's to choose.
#[test]
fn cold_files_under_auto_take_the_cpu_path() {
    let options = [
        (SelectionChoice::Cuda(DeviceAlgorithm::Sample), 0.01),
        (SelectionChoice::Cpu, 0.2),
    ];
    let files = |resident: f64, decoded: bool| Estimate {
        rows: Some(1 << 20),
        bytes_per_row: 12,
        compile: false,
        resident,
        whole_table: true,
        decoded,
        pages: false,
    };
    let cpu = Some((SelectionChoice::Cpu, 0.2));
    assert_eq!(cold_files(Backend::Auto, &files(0.0, true), &options), cpu);
    assert_eq!(cold_files(Backend::Auto, &files(0.5, true), &options), cpu);
    assert_eq!(cold_files(Backend::Auto, &files(1.0, true), &options), None);
    assert_eq!(
        cold_files(Backend::Auto, &files(0.0, false), &options),
        None
    );
    assert_eq!(cold_files(Backend::Cuda, &files(0.0, true), &options), None);
}

fn table(whole_table: bool, resident: f64) -> Estimate {
    Estimate {
        rows: Some(1 << 20),
        bytes_per_row: 8,
        compile: false,
        resident,
        whole_table,
        decoded: false,
        pages: false,
    }
}

/// The device reads a whole table at once wherever the input can be read so; it streams
/// where there is nothing to select, and where a selector-level fault tests the streaming
/// selector's fallback (device-operation faults are injected on either form).
#[test]
fn the_input_is_read_as_a_whole_table_where_it_can_be() {
    use crate::config::DeviceOp;
    let whole = |k, estimate: &Estimate, fault| input_form(k, estimate, fault);
    assert_eq!(
        whole(10, &table(true, 0.0), FaultPoint::None),
        InputForm::WholeTable
    );
    assert_eq!(
        whole(
            10,
            &table(true, 1.0),
            FaultPoint::Device(DeviceOp::Alloc, 1)
        ),
        InputForm::WholeTable
    );
    assert_eq!(
        whole(10, &table(false, 0.0), FaultPoint::None),
        InputForm::Streamed
    );
    assert_eq!(
        whole(0, &table(true, 1.0), FaultPoint::None),
        InputForm::Streamed
    );
    for fault in [FaultPoint::Create, FaultPoint::Push(1), FaultPoint::Finish] {
        assert_eq!(whole(10, &table(true, 1.0), fault), InputForm::Streamed);
    }
}

/// A run on the CPU path is followed by loading the columns only under `auto`, over a
/// whole table whose columns are not all resident.
#[test]
fn a_cpu_run_warms_the_cache_under_auto_over_a_table_not_resident() {
    assert!(warm_up(Backend::Auto, &table(true, 0.0)));
    assert!(warm_up(Backend::Auto, &table(true, 0.5)));
    assert!(!warm_up(Backend::Auto, &table(true, 1.0)));
    assert!(!warm_up(Backend::Auto, &table(false, 0.0)));
    assert!(!warm_up(Backend::Cuda, &table(true, 0.0)));
    assert!(!warm_up(Backend::Cpu, &table(true, 0.0)));
}

/// The bitonic top-k's k limit is one rule with one message, which the planner and the
/// device both give.
#[test]
fn the_bitonic_limit_is_one_rule() {
    let limit = plan::bitonic_max_k(227 * 1024, KeyWidth::W64);
    assert!(plan::bitonic_takes(limit, 227 * 1024, KeyWidth::W64).is_ok());
    let why = plan::bitonic_takes(limit + 1, 227 * 1024, KeyWidth::W64).unwrap_err();
    assert!(why.contains(&format!("up to {limit}")), "{why}");
}

pub(super) fn settings(backend: Backend, algorithm: Algorithm) -> Settings<'static> {
    Settings {
        backend,
        algorithm,
        kernel_cache_dir: None,
        recalibrate: false,
        fault: FaultPoint::None,
    }
}

fn layout(data_type: DataType) -> KeyLayout {
    KeyLayout::with_prefixes(vec![KeySpec {
        data_type,
        descending: false,
        nulls_first: false,
        nullable: false,
    }])
    .unwrap()
}

pub(super) const STARTED: StartFacts = StartFacts {
    started: true,
    slow_start: false,
    cpu: None,
};

/// A 16-core host's CPU rates.
pub(super) const RATES: CpuRates = CpuRates {
    topk_rows_per_s: 100e6,
    group_rows_per_s: 10e6,
    aggregate_rows_per_s: 20e6,
    aggregate_many_rows_per_s: 20e6,
    cores: 16,
};

pub(super) fn ready(calibration: Option<GpuResult<Arc<Calibration>>>) -> DeviceFacts {
    DeviceFacts::Ready(GpuFacts {
        slot: Default::default(),
        describe: "Test GPU (sm_90, 80 GiB)".into(),
        max_shared_per_block: 227 * 1024,
        last_compile: None,
        calibration,
        cpu: Some(RATES),
    })
}

/// The settings decide without the device; otherwise the device's facts are gathered, the
/// calibration only where a prefix layout does not send the query to the CPU path anyway.
#[test]
fn the_decision_before_the_device_asks_only_for_what_it_needs() {
    let int = layout(DataType::Int64);
    let strings = layout(DataType::Utf8);
    let forced = before_device(
        settings(Backend::Cpu, Algorithm::Auto),
        &int,
        10,
        &table(true, 0.0),
        &STARTED,
    );
    assert_eq!(
        forced,
        Stage::Decided(Placement::Run {
            plan: SelectionPlan::CPU,
            reason: "CPU path forced by settings".into(),
            prediction: None,
        })
    );
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let gather = |layout: &KeyLayout, estimate: Estimate| {
        before_device(auto, layout, 10, &estimate, &STARTED)
    };
    let calibrated = Stage::Gather(Needs {
        calibration: true,
        cpu: false,
    });
    let uncalibrated = Stage::Gather(Needs {
        calibration: false,
        cpu: false,
    });
    assert_eq!(gather(&int, table(true, 0.0)), calibrated);
    assert_eq!(gather(&strings, table(false, 1.0)), uncalibrated);
    assert_eq!(gather(&strings, table(true, 0.5)), uncalibrated);
    assert_eq!(gather(&strings, table(true, 1.0)), calibrated);
}

/// Over gathered facts: no GPU declines under `auto` and runs the CPU path under `cuda`; an
/// uncalibrated device takes the rule of thumb; a prefix layout over a table not resident
/// runs on the CPU path and loads it, without a calibration.
#[test]
fn the_decision_over_the_facts_names_what_it_found() {
    let int = layout(DataType::Int64);
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let cuda = settings(Backend::Cuda, Algorithm::Auto);
    let none = DeviceFacts::NoGpu("no driver".into());
    assert_eq!(
        choose(auto, &int, 10, table(true, 0.0), &none),
        Placement::Decline("no GPU found (no driver)".into())
    );
    match choose(cuda, &int, 10, table(true, 0.0), &none) {
        Placement::Run { plan, reason, .. } => {
            assert_eq!(plan, SelectionPlan::CPU);
            assert_eq!(
                reason,
                "backend=cuda, but no GPU found (no driver): CPU path"
            );
        }
        other => panic!("{other:?}"),
    }
    let failed = ready(Some(Err(GpuError("busy".into()))));
    match choose(auto, &int, 10, table(false, 0.0), &failed) {
        Placement::Run { plan, reason, .. } => {
            assert_eq!(plan, SelectionPlan::streamed(DeviceAlgorithm::Bitonic));
            assert_eq!(
                reason,
                "GPU Test GPU (sm_90, 80 GiB); uncalibrated (busy): rule of thumb, k=10, \
                 64-bit keys"
            );
        }
        other => panic!("{other:?}"),
    }
    let strings = layout(DataType::Utf8);
    match choose(auto, &strings, 10, table(true, 0.0), &ready(None)) {
        Placement::Run { plan, reason, .. } => {
            assert_eq!(plan, SelectionPlan::Cpu { warm_up: true });
            assert!(
                reason.ends_with("not resident: CPU path, then loaded"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    let groups = choose_groups(auto, &int, table(true, 0.0), Some(30), 3, &none);
    assert_eq!(
        groups.err(),
        Some(GroupCpu::from(String::from(
            "no GPU found (no driver): CPU path"
        )))
    );
}

/// A calibration of the H100-like model, as the device's facts carry it.
pub(super) fn calibrated() -> Option<GpuResult<Arc<Calibration>>> {
    use crate::cost::calibration::DeviceParams;
    let params = DeviceParams {
        name: "Test GPU".into(),
        arch: "sm_90".into(),
        driver_version: 13000,
        sm_count: 132,
        shared_per_sm: 228 * 1024,
        shared_per_block: 227 * 1024,
        l2_bytes: 50 << 20,
        clock_khz: 1_755_000,
        memory_clock_khz: 2_619_000,
        bus_width_bits: 5120,
    };
    Some(Ok(Arc::new(Calibration {
        params,
        model: h100_like(),
        references: Vec::new(),
        took: None,
        file: None,
    })))
}

/// A calibrated device whose host runs the per-group CPU path at `group_rows_per_s` a core on
/// 16 cores.
fn calibrated_device(group_rows_per_s: f64) -> DeviceFacts {
    match ready(calibrated()) {
        DeviceFacts::Ready(facts) => DeviceFacts::Ready(GpuFacts {
            cpu: Some(CpuRates {
                group_rows_per_s,
                ..RATES
            }),
            ..facts
        }),
        other => other,
    }
}

/// A group key then an order key, both 64-bit.
fn group_layout() -> KeyLayout {
    let spec = |descending| KeySpec {
        data_type: DataType::Int64,
        descending,
        nulls_first: false,
        nullable: false,
    };
    KeyLayout::with_prefixes(vec![spec(false), spec(true)]).unwrap()
}

/// An in-memory table of `rows` rows, its columns `resident` (0 to 1), its program compiled
/// where `compiled`.
fn group_table(rows: usize, resident: f64, compiled: bool) -> Estimate {
    Estimate {
        rows: Some(rows),
        bytes_per_row: 16,
        compile: !compiled,
        resident,
        whole_table: true,
        decoded: false,
        pages: false,
    }
}

/// Under `auto` a per-group top-k runs on the device where its run beats the CPU path's
/// calibrated time (warm, or even cold: the device's start, the compile and the columns
/// shipped included); where only a warm run would, the CPU path runs and the columns are
/// loaded after it; where the device never wins, the CPU path runs alone. `cuda` takes the
/// device whatever the times.
#[test]
fn per_group_decisions_weigh_the_cpu_path_against_a_cold_and_a_warm_device() {
    let layout = group_layout();
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let cuda = settings(Backend::Cuda, Algorithm::Auto);
    let rows = 100_000_000;
    let groups = Some(rows / 20);
    let decide = |settings, estimate, device: &DeviceFacts| {
        choose_groups(settings, &layout, estimate, groups, 10, device)
    };
    // A slow CPU path (a core's heaps at a million rows a second): the device wins cold.
    let slow = calibrated_device(1e6);
    let cold = decide(auto, group_table(rows, 0.0, false), &slow).unwrap();
    assert_eq!(cold.algorithm, GroupAlgorithm::SegmentedSort);
    let weighed = cold.weighed.unwrap();
    let (gpu, warm) = (weighed.gpu.unwrap(), weighed.gpu_warm.unwrap());
    assert!(warm < gpu && gpu < weighed.cpu, "{weighed:?}");
    assert_eq!(weighed.cpu, rows as f64 / (1e6 * 16.0));
    assert_eq!(cold.prediction.unwrap().seconds, gpu);
    // The compile and the columns shipped are what the cold run adds.
    let shipped = STAGED_TRANSFER * h100_like().transfer_time(rows * 16);
    let extra = COMPILE_ESTIMATE.as_secs_f64() + shipped;
    assert!(
        (gpu - warm - extra).abs() < 1e-9,
        "{gpu} - {warm} vs {extra}"
    );
    assert!(
        cold.reason
            .starts_with("GPU Test GPU (sm_90, 80 GiB); segmented-sort "),
        "{}",
        cold.reason
    );

    // The CPU path between the warm and the cold run: CPU path, then the columns loaded.
    let between = (gpu + warm) / 2.0;
    let middle = calibrated_device(rows as f64 / (between * 16.0));
    let loaded = decide(auto, group_table(rows, 0.0, false), &middle).unwrap_err();
    assert_eq!(loaded.warm_up, Some(DeviceSlot::default()));
    assert!(
        loaded.reason.ends_with(": CPU path, then loaded"),
        "{}",
        loaded.reason
    );
    let weighed = loaded.weighed.unwrap();
    assert!((weighed.cpu - between).abs() < 1e-9 * between);
    // The same host once the columns are resident and the program compiled: the device.
    let warmed = calibrated_device(rows as f64 / (between * 16.0));
    let next = decide(auto, group_table(rows, 1.0, true), &warmed).unwrap();
    assert_eq!(next.weighed.unwrap().gpu, Some(warm));
    // Under `cuda` the device runs the cold query too.
    assert!(decide(cuda, group_table(rows, 0.0, false), &middle).is_ok());

    // A CPU path faster than even the warm device: CPU path, nothing loaded.
    let fast = calibrated_device(rows as f64 / (0.5 * warm * 16.0));
    let alone = decide(auto, group_table(rows, 0.0, false), &fast).unwrap_err();
    assert_eq!(alone.warm_up, None);
    assert!(alone.reason.ends_with(": CPU path"), "{}", alone.reason);
    assert!(decide(cuda, group_table(rows, 0.0, false), &fast).is_ok());
    // A small table on a device started before: the device's launches outlast the heaps.
    let small = decide(auto, group_table(1000, 1.0, true), &calibrated_device(10e6));
    let small = small.unwrap_err();
    assert_eq!(small.warm_up, None);
    let weighed = small.weighed.unwrap();
    assert!(weighed.gpu_warm.unwrap() > weighed.cpu, "{weighed:?}");
}

/// Before the device is started, `auto` runs a per-group top-k whose CPU path ends before
/// the device could start on the CPU path, without starting it or loading anything; a larger
/// input, a started device and `cuda` gather the device's facts; `cpu` never does.
#[test]
fn a_small_per_group_query_leaves_the_device_unstarted() {
    let unstarted = StartFacts {
        started: false,
        slow_start: true,
        cpu: Some(RATES),
    };
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let gather = Ok(Needs {
        calibration: true,
        cpu: true,
    });
    let small = groups_before_device(auto, &group_table(1_000_000, 0.0, false), &unstarted);
    let small = small.unwrap_err();
    assert_eq!(small.warm_up, None);
    assert!(
        small.reason.contains("GPU is not started"),
        "{}",
        small.reason
    );
    let weighed = small.weighed.unwrap();
    assert_eq!(weighed.cpu, 1_000_000.0 / (10e6 * 16.0));
    assert_eq!(
        weighed.describe(),
        format!("predicted_cpu={}", format_seconds(weighed.cpu))
    );
    let big = group_table(1_000_000_000, 0.0, false);
    assert_eq!(groups_before_device(auto, &big, &unstarted), gather);
    let small = group_table(1_000, 0.0, false);
    assert_eq!(groups_before_device(auto, &small, &STARTED), gather);
    let cuda = settings(Backend::Cuda, Algorithm::Auto);
    assert_eq!(groups_before_device(cuda, &small, &unstarted), gather);
    let forced = groups_before_device(settings(Backend::Cpu, Algorithm::Auto), &big, &STARTED);
    assert_eq!(
        forced,
        Err(GroupCpu::from(String::from("CPU path forced by settings")))
    );
    // What EXPLAIN shows of a decision that weighed the device.
    let weighed = Weighed {
        cpu: 1.5,
        gpu: Some(0.25),
        gpu_warm: Some(0.0125),
    };
    assert_eq!(
        weighed.describe(),
        "predicted_cpu=1.50s, predicted_gpu=250.00ms, predicted_gpu_warm=12.50ms"
    );
}
