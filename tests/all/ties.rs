//! String keys whose 16-byte prefixes tie a large share of the table (a prefix layout's
//! composite): the rows that tie the k-th's prefix are ranked by their whole keys, on the
//! host where they are few and on the CPU path where they are too many to rank for less than
//! it costs. Every answer is DataFusion's, over memory (several partitions), Parquet, CSV and
//! `GpuTable`s, on the test backend (the CPU path in CI, the device on the GPU machine).

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::prelude::SessionContext;

use crate::common::{
    Rng, STORAGES, Storage, partitioned, plain_session, register_as, same_rows_with_metrics,
    session, session_with, test_dir,
};
use crate::strings::metric;

/// TPC-H's ship instructions: "TAKE BACK RETURN" is 16 bytes, the composite's whole prefix,
/// and "DELIVER IN PERSON" one byte longer.
const INSTRUCTIONS: [&str; 4] = [
    "DELIVER IN PERSON",
    "COLLECT COD",
    "NONE",
    "TAKE BACK RETURN",
];

/// Besides those: longer strings sharing a 16-byte prefix with "TAKE BACK RETURN" (which
/// ties them on the composite), one differing in its 16th byte, and the empty string.
const RARE_INSTRUCTIONS: [&str; 5] = [
    "TAKE BACK RETURN AT ONCE",
    "TAKE BACK RETURN!",
    "TAKE BACK RETURM",
    "DELIVER IN PERSON, LATER",
    "",
];

const MODES: [&str; 7] = ["AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"];

/// `rows` lineitem-shaped rows over `partitions` partitions: `okey` and `line` (unique
/// together, in no relation to the input order), `instr` (a ship instruction), `mode`, `n`
/// (three values), `note` (strings sharing a 25-byte prefix) and `tag` (unique, its
/// 16-byte prefix shared by groups of eight rows). With `rare`, `instr`, `mode` and `note`
/// also take [`RARE_INSTRUCTIONS`] and NULLs.
fn lineitem(rows: usize, partitions: usize, rare: bool) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("okey", DataType::Int64, false),
        Field::new("line", DataType::Int32, false),
        Field::new("instr", DataType::Utf8, true),
        Field::new("mode", DataType::Utf8, true),
        Field::new("n", DataType::Int64, false),
        Field::new("note", DataType::Utf8, true),
        Field::new("tag", DataType::Utf8, false),
    ]));
    let per = rows.div_ceil(partitions);
    let mut sizes: Vec<Vec<usize>> = Vec::new();
    for p in 0..partitions {
        let n = per.min(rows - (p * per).min(rows));
        // Batches of uneven sizes, the last one short.
        let mut batches = Vec::new();
        let mut left = n;
        while left > 0 {
            let take = left.min(if batches.len() % 2 == 0 { 4096 } else { 1000 });
            batches.push(take);
            left -= take;
        }
        sizes.push(batches);
    }
    let sizes: Vec<&[usize]> = sizes.iter().map(Vec::as_slice).collect();
    partitioned(41, &sizes, |rng: &mut Rng, first: i64, n: usize| {
        let ids = first..first + n as i64;
        // An odd multiplier permutes the order keys.
        let okey = ids
            .clone()
            .map(|id| i64::from(((id / 4) as u32).wrapping_mul(2_654_435_761)));
        let line = ids.clone().map(|id| (id % 4) as i32 + 1);
        let mut instr = Vec::with_capacity(n);
        let mut mode = Vec::with_capacity(n);
        let mut note = Vec::with_capacity(n);
        for _ in 0..n {
            instr.push(match rare && rng.chance(0.03) {
                true if rng.chance(0.3) => None,
                true => Some(RARE_INSTRUCTIONS[rng.below(5) as usize]),
                false => Some(INSTRUCTIONS[rng.below(4) as usize]),
            });
            mode.push(match rare && rng.chance(0.01) {
                true => None,
                false => Some(MODES[rng.below(7) as usize]),
            });
            let tail: String = (0..rng.below(3))
                .map(|_| ['a', 'b', 'é'][rng.below(3) as usize])
                .collect();
            note.push(
                (!rare || !rng.chance(0.02)).then(|| format!("https://example.com/ties/{tail}")),
            );
        }
        let n_values = ids.clone().map(|id| (id * 7 + id / 3) % 3);
        // "ties-" and ten digits and "-": 16 bytes.
        let tag = ids.clone().map(|id| {
            let group = ((id / 8) as u32).wrapping_mul(2_654_435_761);
            format!("ties-{group:010}-{}", id % 8)
        });
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(okey)),
            Arc::new(Int32Array::from_iter_values(line)),
            Arc::new(StringArray::from(instr)),
            Arc::new(StringArray::from(mode)),
            Arc::new(Int64Array::from_iter_values(n_values)),
            Arc::new(StringArray::from(note)),
            Arc::new(StringArray::from_iter_values(tag)),
        ];
        RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
    })
}

/// The query over TPC-H lineitem whose first key ties a quarter of the table on its prefix.
const LINEITEM_QUERY: &str = "SELECT mode, instr, okey, line FROM t \
     ORDER BY instr DESC, mode, okey, line LIMIT 100";

/// Queries whose answers the whole keys decide after long prefix ties: in the first key, or
/// in the second or third after it; both directions, NULLs first and last, `OFFSET`s, a
/// filter. Every `ORDER BY` ends in a unique key, so the answer is one.
const QUERIES: [&str; 11] = [
    LINEITEM_QUERY,
    "SELECT okey, line, instr FROM t ORDER BY instr, mode DESC, okey, line LIMIT 50 OFFSET 20",
    "SELECT okey, line FROM t ORDER BY instr DESC NULLS LAST, n, okey DESC, line LIMIT 30",
    "SELECT okey, line, mode FROM t \
     ORDER BY instr NULLS FIRST, mode NULLS FIRST, okey, line LIMIT 40 OFFSET 5",
    "SELECT okey, line, note FROM t ORDER BY note DESC, n, okey, line LIMIT 10",
    "SELECT okey, line FROM t ORDER BY note NULLS FIRST, instr DESC, n DESC, okey, line LIMIT 25",
    "SELECT okey, line, instr FROM t WHERE line > 2 \
     ORDER BY instr DESC, mode, okey, line LIMIT 100",
    "SELECT okey, line FROM t ORDER BY instr DESC, okey, line LIMIT 2000 OFFSET 100",
    "SELECT okey, line, instr FROM t ORDER BY instr, okey DESC, line DESC LIMIT 7",
    SMALL_TIE_QUERY,
    "SELECT okey, line, tag FROM t ORDER BY n DESC, tag LIMIT 15 OFFSET 3",
];

/// A key whose k-th prefix ties seven more rows: few enough to rank on the host.
const SMALL_TIE_QUERY: &str = "SELECT okey, line, tag FROM t ORDER BY tag DESC LIMIT 10";

/// [`same_rows_with_metrics`] of `sql`, its own oracle (its keys end in a unique column).
async fn same_rows(ours: &SessionContext, plain: &SessionContext, sql: &str, what: &str) -> String {
    same_rows_with_metrics(ours, plain, (sql, sql), what).await
}

/// A session with CUDA forced and plain DataFusion, both over `data` as `t` in `storage`.
async fn cuda_and_plain(
    data: &[Vec<RecordBatch>],
    storage: Storage,
    dir: &std::path::Path,
) -> (SessionContext, SessionContext) {
    let config =
        crate::sessions::test_config(true).with_backend(datafusion_gpu_topk::Backend::Cuda);
    let ours = session_with(4, 8192, config);
    let plain = plain_session(4, storage);
    register_as(&ours, "t", data, storage, dir).await;
    register_as(&plain, "t", data, storage, dir).await;
    (ours, plain)
}

/// Long prefix ties, rare longer strings past the 16-byte prefix and NULLs, over every
/// storage: DataFusion's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_prefix_ties_match_datafusion() {
    let data = lineitem(24_000, 3, true);
    let dir = test_dir("ties-storages");
    for storage in STORAGES {
        let ours = session(true, 3, 1000);
        let plain = plain_session(3, storage);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        for sql in QUERIES {
            same_rows(&ours, &plain, sql, &format!("{storage:?}")).await;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lineitem-shaped query (the four ship instructions, a quarter of the rows tying
/// "TAKE BACK RETURN") over a larger table in memory, Parquet and CSV.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lineitem_tie_matches_datafusion() {
    let data = lineitem(200_000, 4, false);
    let dir = test_dir("ties-lineitem");
    for storage in [Storage::Memory, Storage::Parquet, Storage::Csv] {
        let ours = session(true, 4, 8192);
        let plain = plain_session(4, storage);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        let plan = same_rows(&ours, &plain, LINEITEM_QUERY, &format!("{storage:?}")).await;
        // Wherever the rows were ranked, those tying the prefix were compared in full.
        assert!(metric(&plan, "rows_refined") > 0, "{storage:?}: {plan}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// With the device selecting (CUDA forced, on a GPU): a tie of a quarter of the table's rows
/// takes the CPU path after the device's selection (`tie_fallbacks`, no device error), and
/// the seven rows tying the k-th's prefix of [`SMALL_TIE_QUERY`] are ranked on the host; both
/// give DataFusion's rows, three times (the later runs from the column cache). Once an
/// in-memory table's ship instructions and modes are cached (the instructions by the first
/// run, the modes by the second, which reads them once the instructions are exact), their
/// prefix words tell their values apart: the keys are exact, the next keys rank their ties on
/// the device, and at most a few rows are refined.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_prefix_ties_leave_the_device_and_small_ones_do_not() {
    use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
    if let GpuStatus::Unavailable(why) = gpu_status() {
        eprintln!("SKIP: prefix ties on the device: no GPU ({why})");
        return;
    }
    let data = lineitem(200_000, 4, false);
    let dir = test_dir("ties-device");
    for storage in [Storage::Memory, Storage::GpuTable, Storage::Parquet] {
        let (ours, plain) = cuda_and_plain(&data, storage, &dir).await;
        for round in 0..3 {
            let what = format!("{storage:?}, round {round}");
            let plan = same_rows(&ours, &plain, LINEITEM_QUERY, &what).await;
            assert!(plan.contains("backend=cuda"), "{what}: {plan}");
            assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{what}: {plan}");
            match (round, storage) {
                (2, Storage::Memory | Storage::GpuTable) => {
                    assert_eq!(metric(&plan, "tie_fallbacks"), 0, "{what}: {plan}");
                    assert!(metric(&plan, "rows_refined") < 16, "{what}: {plan}");
                }
                (0, _) | (_, Storage::Parquet) => {
                    assert_eq!(metric(&plan, "tie_fallbacks"), 1, "{what}: {plan}");
                }
                // The modes are loaded by this run: its plan could not count on them.
                _ => {}
            }
            let plan = same_rows(&ours, &plain, SMALL_TIE_QUERY, &what).await;
            assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{what}: {plan}");
            assert_eq!(metric(&plan, "tie_fallbacks"), 0, "{what}: {plan}");
            assert_eq!(metric(&plan, "rows_refined"), 7, "{what}: {plan}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A short string key (every `mode` at most 16 bytes) tying a seventh of the rows, with CUDA
/// forced: once the column cache holds its prefix image, the key is laid out whole and the
/// keys after it rank the ties on the device (none refined on the host, no CPU path); the
/// first run may take either. DataFusion's rows every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_string_ties_rank_on_the_device_once_its_prefixes_are_cached() {
    use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
    if let GpuStatus::Unavailable(why) = gpu_status() {
        eprintln!("SKIP: short string ties on the device: no GPU ({why})");
        return;
    }
    let data = lineitem(200_000, 4, true);
    let dir = test_dir("ties-short");
    let queries = [
        "SELECT okey, line, mode FROM t ORDER BY mode, okey, line LIMIT 10",
        "SELECT okey, line, mode FROM t ORDER BY mode DESC NULLS LAST, okey DESC, line LIMIT 25",
    ];
    for storage in [Storage::Memory, Storage::GpuTable] {
        let (ours, plain) = cuda_and_plain(&data, storage, &dir).await;
        for sql in queries {
            for round in 0..3 {
                let what = format!("{storage:?}, round {round}: {sql}");
                let plan = same_rows(&ours, &plain, sql, &what).await;
                assert!(plan.contains("backend=cuda"), "{what}: {plan}");
                assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{what}: {plan}");
                if round > 0 {
                    assert_eq!(metric(&plan, "tie_fallbacks"), 0, "{what}: {plan}");
                    assert_eq!(metric(&plan, "rows_refined"), 0, "{what}: {plan}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
