use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;

use super::*;
use crate::cost::model::h100_like;
use crate::device::{GpuError, GpuResult};
use crate::device::{GROUP_SAMPLE, GroupAlgorithm};
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
    let small = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), true), 16);
    match small {
        Some(Placement::Run {
            plan: SelectionPlan::Cpu { warm_up: true },
            reason,
            prediction: None,
        }) => assert!(reason.contains("GPU is not started"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let streamed = cpu_before_start(Backend::Auto, &estimate(Some(1_000_000), false), 16);
    assert!(matches!(
        streamed,
        Some(Placement::Run {
            plan: SelectionPlan::Cpu { warm_up: false },
            ..
        })
    ));
    assert_eq!(
        cpu_before_start(Backend::Auto, &estimate(Some(1_000_000_000), true), 16),
        None
    );
    assert_eq!(
        cpu_before_start(Backend::Auto, &estimate(None, true), 16),
        None
    );
    assert_eq!(
        before_start(
            Backend::Cuda,
            &estimate(Some(1_000), true),
            &StartFacts {
                started: false,
                slow_start: true,
                cores: 16,
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

fn settings(backend: Backend, algorithm: Algorithm) -> Settings<'static> {
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

const STARTED: StartFacts = StartFacts {
    started: true,
    slow_start: false,
    cores: 16,
};

fn ready(calibration: Option<GpuResult<Arc<Calibration>>>) -> DeviceFacts {
    DeviceFacts::Ready(GpuFacts {
        slot: Default::default(),
        describe: "Test GPU (sm_90, 80 GiB)".into(),
        max_shared_per_block: 227 * 1024,
        last_compile: None,
        calibration,
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
    let calibrated = Stage::Gather(Needs { calibration: true });
    let uncalibrated = Stage::Gather(Needs { calibration: false });
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
        groups.err().as_deref(),
        Some("no GPU found (no driver): CPU path")
    );
}
