use super::super::tests::{RATES, STARTED, calibrated, ready, settings};
use super::*;
use crate::config::Algorithm;
use crate::cost::calibration::cpu::CpuRates;
use crate::cost::facts::GpuFacts;
use crate::device::GpuError;

/// A table of `rows` rows whose device path reads three 8-byte columns (two keys, one value),
/// `resident` of them in the column cache, with `groups` groups, computing two accumulators
/// and selecting 10 groups.
fn aggregate(rows: usize, groups: Option<usize>, resident: f64) -> AggregateEstimate {
    AggregateEstimate {
        table: Estimate {
            rows: Some(rows),
            bytes_per_row: 24,
            compile: false,
            resident,
            whole_table: true,
            decoded: false,
            pages: false,
        },
        groups,
        keys: 2,
        accumulators: 2,
        k: 10,
        interned_rows: 0,
    }
}

/// A calibrated device whose host aggregates `aggregate_rows_per_s` rows a second a core
/// (into few groups or many) on 16 cores.
fn device(aggregate_rows_per_s: f64) -> DeviceFacts {
    match ready(calibrated()) {
        DeviceFacts::Ready(facts) => DeviceFacts::Ready(GpuFacts {
            cpu: Some(CpuRates {
                aggregate_rows_per_s,
                aggregate_many_rows_per_s: aggregate_rows_per_s,
                ..RATES
            }),
            ..facts
        }),
        other => other,
    }
}

/// `cpu` (the backend or the algorithm) keeps the device out before any fact is read; under
/// `auto` an unstarted device is left alone where DataFusion's aggregation ends before it
/// could start, and every other query gathers the device's facts and the CPU rates.
#[test]
fn cpu_forced_and_small_queries_leave_the_device_alone() {
    let forced = Err(AggregateCpu::from(String::from(
        "CPU path forced by settings",
    )));
    let big = aggregate(1_000_000_000, Some(1000), 0.0);
    for cpu in [
        settings(Backend::Cpu, Algorithm::Auto),
        settings(Backend::Auto, Algorithm::Cpu),
    ] {
        assert_eq!(aggregate_before_device(cpu, &big, &STARTED), forced);
    }
    let unstarted = StartFacts {
        started: false,
        slow_start: true,
        cpu: Some(RATES),
    };
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let small = aggregate(1_000_000, Some(1000), 0.0);
    let left = aggregate_before_device(auto, &small, &unstarted).unwrap_err();
    assert!(
        left.reason.contains("GPU is not started"),
        "{}",
        left.reason
    );
    assert_eq!(left.warm_up, None);
    // The partial aggregation's rows, then up to the groups of every core's partition.
    let cpu = (1_000_000.0 + 16.0 * 1000.0) / (20e6 * 16.0);
    assert_eq!(left.weighed.unwrap().cpu, cpu);
    assert_eq!(
        left.weighed.unwrap().describe(),
        format!("predicted_cpu={}", format_seconds(cpu))
    );
    let gather = Ok(Needs {
        calibration: true,
        cpu: true,
    });
    assert_eq!(aggregate_before_device(auto, &big, &unstarted), gather);
    assert_eq!(aggregate_before_device(auto, &small, &STARTED), gather);
    let cuda = settings(Backend::Cuda, Algorithm::Auto);
    assert_eq!(aggregate_before_device(cuda, &small, &unstarted), gather);
}

/// Under `auto` a small table stays on DataFusion's aggregation (the device's launches and
/// read-backs outlast it, warm or not) and a large one goes to the device, with the selection
/// the model picked; `cuda` takes the device even for the small one, and even without a GPU
/// or a calibration (the run falls back), where `auto` takes the CPU path.
#[test]
fn auto_weighs_the_table_and_cuda_takes_the_device() {
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let cuda = settings(Backend::Cuda, Algorithm::Auto);
    let facts = device(20e6);
    let small = aggregate(2000, Some(50), 0.0);
    let cpu = choose_aggregate(auto, small, &facts).unwrap_err();
    let weighed = cpu.weighed.unwrap();
    assert!(weighed.gpu_warm.unwrap() > weighed.cpu, "{weighed:?}");
    assert_eq!(cpu.warm_up, None);
    assert!(cpu.reason.ends_with(": CPU path"), "{}", cpu.reason);
    let forced = choose_aggregate(cuda, small, &facts).unwrap();
    assert_eq!(forced.weighed, Some(weighed));
    assert!(forced.reason.contains("backend=cuda"), "{}", forced.reason);
    let large = aggregate(200_000_000, Some(1000), 0.0);
    let chosen = choose_aggregate(auto, large, &facts).unwrap();
    let weighed = chosen.weighed.unwrap();
    assert!(weighed.gpu.unwrap() < weighed.cpu, "{weighed:?}");
    assert!(
        chosen
            .reason
            .contains(&format!("hash and {}", chosen.selection.name())),
        "{}",
        chosen.reason
    );
    for facts in [
        DeviceFacts::NoGpu("none here".into()),
        DeviceFacts::NoKernels("no compiler".into()),
        ready(Some(Err(GpuError("busy".into())))),
    ] {
        let forced = choose_aggregate(cuda, large, &facts).unwrap();
        assert_eq!(forced.weighed, None);
        assert_eq!(forced.selection, UNWEIGHED_SELECTION);
        assert!(forced.reason.contains("backend=cuda"), "{}", forced.reason);
        let cpu = choose_aggregate(auto, large, &facts).unwrap_err();
        assert!(cpu.reason.ends_with(": CPU path"), "{}", cpu.reason);
        assert_eq!(cpu.warm_up, None);
    }
}

/// Unknown groups are priced as one a row, on both sides: more than any estimate below
/// them. DataFusion's final aggregation and the device's table and selection grow with the
/// groups.
#[test]
fn unknown_groups_are_priced_as_one_a_row() {
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let facts = device(20e6);
    let rows = 50_000_000;
    let weigh = |groups| {
        let estimate = aggregate(rows, groups, 0.0);
        match choose_aggregate(auto, estimate, &facts) {
            Ok(chosen) => chosen.weighed.unwrap(),
            Err(cpu) => cpu.weighed.unwrap(),
        }
    };
    let unknown = weigh(None);
    assert_eq!(unknown, weigh(Some(rows)));
    assert_eq!(unknown.cpu, RATES_AT_20M.aggregate_time(rows, rows));
    let few = weigh(Some(1000));
    let many = weigh(Some(1_000_000));
    assert!(few.cpu < many.cpu && many.cpu < unknown.cpu);
    assert!(
        few.gpu < many.gpu && many.gpu < unknown.gpu,
        "{few:?} {many:?}"
    );
}

const RATES_AT_20M: CpuRates = CpuRates {
    aggregate_rows_per_s: 20e6,
    aggregate_many_rows_per_s: 20e6,
    ..RATES
};

/// On a host whose aggregation outpaces PCIe, a table not resident stays on the CPU path and
/// its columns are loaded after it, where the device wins warm; the same table resident runs
/// on the device; a table that is not a whole table is not loaded.
#[test]
fn resident_columns_decide_and_cold_ones_are_loaded_after_the_cpu_path() {
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let facts = device(200e6);
    let rows = 200_000_000;
    let cold = choose_aggregate(auto, aggregate(rows, Some(1000), 0.0), &facts).unwrap_err();
    let weighed = cold.weighed.unwrap();
    assert!(weighed.gpu.unwrap() > weighed.cpu, "{weighed:?}");
    assert!(weighed.gpu_warm.unwrap() < weighed.cpu, "{weighed:?}");
    assert_eq!(cold.warm_up, Some(DeviceSlot::default()));
    assert!(
        cold.reason.ends_with("CPU path, then loaded"),
        "{}",
        cold.reason
    );
    let resident = aggregate(rows, Some(1000), 1.0);
    let warm = choose_aggregate(auto, resident, &facts).unwrap();
    assert_eq!(warm.weighed.unwrap().gpu, weighed.gpu_warm);
    // Half resident ships half the bytes.
    let half = choose_aggregate(auto, aggregate(rows, Some(1000), 0.5), &facts);
    let half = half.map_or_else(|c| c.weighed, |c| c.weighed).unwrap();
    assert!(
        half.gpu < weighed.gpu && half.gpu > weighed.gpu_warm,
        "{half:?}"
    );
    let mut streamed = aggregate(rows, Some(1000), 0.0);
    streamed.table.whole_table = false;
    let streamed = choose_aggregate(auto, streamed, &facts).unwrap_err();
    assert_eq!(streamed.warm_up, None);
}

/// A generated pass still to compile adds the compile (the process's last one, else the
/// estimate) to this run's device time, and nothing to a warm run's.
#[test]
fn an_uncompiled_pass_costs_its_compile_this_run_only() {
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let facts = device(200e6);
    let weigh = |compile| {
        let mut estimate = aggregate(1_000_000, Some(1000), 1.0);
        estimate.table.compile = compile;
        let choice = choose_aggregate(auto, estimate, &facts);
        choice.map_or_else(|c| c.weighed, |c| c.weighed).unwrap()
    };
    let (compiled, compiling) = (weigh(false), weigh(true));
    let DeviceFacts::Ready(ready) = &facts else {
        panic!("a ready device");
    };
    let estimated = super::super::COMPILE_ESTIMATE;
    let compile = ready.last_compile.unwrap_or(estimated).as_secs_f64();
    let added = compiling.gpu.unwrap() - compiled.gpu.unwrap();
    assert!((added - compile).abs() < 1e-9, "{added} against {compile}");
    assert_eq!(compiling.gpu_warm, compiled.gpu_warm);
}

/// String keys whose codes are not resident add their interning, at the host's aggregation
/// rate, to this run's device time, and nothing to a warm run's; where that leaves the device
/// winning only warm, the CPU path runs and loads the columns.
#[test]
fn interning_string_keys_costs_this_run_only() {
    let auto = settings(Backend::Auto, Algorithm::Auto);
    let facts = device(20e6);
    let weigh = |interned_rows| {
        let mut estimate = aggregate(10_000_000, Some(1_000_000), 0.0);
        estimate.interned_rows = interned_rows;
        choose_aggregate(auto, estimate, &facts)
    };
    let weighed = |c: &std::result::Result<AggregateChoice, AggregateCpu>| {
        c.as_ref()
            .map_or_else(|c| c.weighed, |c| c.weighed)
            .unwrap()
    };
    let (plain, interning) = (weigh(0), weigh(10_000_000));
    let (plain_weighed, interning_weighed) = (weighed(&plain), weighed(&interning));
    let added = interning_weighed.gpu.unwrap() - plain_weighed.gpu.unwrap();
    assert!(
        (added - interning_weighed.cpu).abs() < 1e-9,
        "{added} against {}",
        interning_weighed.cpu
    );
    assert_eq!(interning_weighed.gpu_warm, plain_weighed.gpu_warm);
    let loaded = interning.unwrap_err();
    assert!(
        loaded.reason.ends_with("CPU path, then loaded"),
        "{}",
        loaded.reason
    );
    assert!(loaded.warm_up.is_some());
}
