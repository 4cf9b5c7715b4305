//! What the generators share: the splitmix64 draws, generation in parallel over contiguous
//! row ranges, and writing a table as Parquet files.

use std::fs::{self, File};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;

/// Rows written per generated batch when writing Parquet.
const WRITE_BATCH_ROWS: usize = 64 * 1024;
/// Parquet row group size (~1M rows).
const ROW_GROUP_ROWS: usize = 1 << 20;

/// Summary of a generator's `write_parquet`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSummary {
    /// Number of `NAME-NNNNN.parquet` files written.
    pub files: usize,
    pub rows: u64,
    /// Total size of the files on disk.
    pub bytes: u64,
}

/// splitmix64 increment (golden ratio).
pub(super) const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64 output function.
#[inline]
pub(super) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from the top 53 bits.
#[inline]
pub(super) fn unit(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Threshold for a 32-bit draw to be below probability `p`.
pub(super) fn threshold32(p: f64) -> u32 {
    (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// Rows of partition `p` out of `parts`: the p-th of `parts` contiguous, near-equal ranges.
fn partition_range(rows: u64, parts: usize, p: usize) -> (u64, u64) {
    let bound = |q: usize| (rows as u128 * q as u128 / parts as u128) as u64;
    (bound(p), bound(p + 1))
}

fn threads_for(items: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items)
        .max(1)
}

/// Applies `f` to every item on a scoped thread pool, keeping the items' order. Stops early
/// and returns the first error (in item order) if any call fails.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let per_thread: Vec<Vec<(usize, Result<R>)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads_for(items.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        let r = f(item);
                        if r.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        done.push((i, r));
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut slots: Vec<Option<Result<R>>> = items.iter().map(|_| None).collect();
    for (i, r) in per_thread.into_iter().flatten() {
        slots[i] = Some(r);
    }
    let mut out = Vec::with_capacity(items.len());
    // Items are only skipped after a failure, which some slot reports.
    for r in slots.into_iter().flatten() {
        out.push(r?);
    }
    if out.len() != items.len() {
        return Err(DataFusionError::Internal(
            "datasets: parallel generation stopped without an error".into(),
        ));
    }
    Ok(out)
}

/// A table of `rows` rows split into `partitions` contiguous row ranges (partition `p` holds
/// the p-th range, so concatenating partitions in order gives rows `0..rows`), each as batches
/// of at most `batch_size` rows, `generate(start, len)` called in parallel.
pub(super) fn partitions(
    name: &str,
    rows: u64,
    partitions: usize,
    batch_size: usize,
    generate: impl Fn(u64, usize) -> Result<RecordBatch> + Sync,
) -> Result<Vec<Vec<RecordBatch>>> {
    if partitions == 0 || batch_size == 0 {
        return Err(DataFusionError::Plan(format!(
            "{name}: partitions ({partitions}) and batch size ({batch_size}) must be positive"
        )));
    }
    let mut items = Vec::new();
    for p in 0..partitions {
        let (mut lo, hi) = partition_range(rows, partitions, p);
        while lo < hi {
            let len = (hi - lo).min(batch_size as u64);
            items.push((p, lo, len as usize));
            lo += len;
        }
    }
    let batches = parallel_map(&items, |&(_, start, len)| generate(start, len))?;
    let mut out = vec![Vec::new(); partitions];
    for (&(p, _, _), batch) in items.iter().zip(batches) {
        out[p].push(batch);
    }
    Ok(out)
}

fn io_error(name: &str, what: &str, path: &Path, e: std::io::Error) -> DataFusionError {
    DataFusionError::Execution(format!("{name}: cannot {what} {}: {e}", path.display()))
}

/// What [`write_parquet`] writes: the table's name (the files' prefix), its schema and rows,
/// and its generator, `generate(start, len)` giving rows `start..start + len`.
pub(super) struct Table<'a, G> {
    pub name: &'a str,
    pub schema: SchemaRef,
    pub rows: u64,
    pub generate: G,
}

/// Writes the table as `NAME-00000.parquet`, `NAME-00001.parquet`, … of `rows_per_file`
/// rows each (zstd, ~1M-row row groups) into `out_dir`, one file per thread at a time. Creates
/// `out_dir`, and refuses to run if it already holds `NAME-*.parquet` files. A table of 0
/// rows is written as one empty file so that readers still see the schema. `show_progress`:
/// a progress bar with the `cli` feature, else a log line per file; the files are the same.
pub(super) fn write_parquet<G>(
    table: &Table<'_, G>,
    out_dir: &Path,
    rows_per_file: u64,
    show_progress: bool,
) -> Result<WriteSummary>
where
    G: Fn(u64, usize) -> Result<RecordBatch> + Sync,
{
    let name = table.name;
    let io_error = |what: &str, path: &Path, e| io_error(name, what, path, e);
    if rows_per_file == 0 {
        return Err(DataFusionError::Plan(format!(
            "{name}: rows per file must be positive"
        )));
    }
    fs::create_dir_all(out_dir).map_err(|e| io_error("create directory", out_dir, e))?;
    let prefix = format!("{name}-");
    let existing = fs::read_dir(out_dir)
        .map_err(|e| io_error("list directory", out_dir, e))?
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            let file = entry.file_name();
            let file = file.to_string_lossy();
            file.starts_with(&prefix) && file.ends_with(".parquet")
        })
        .count();
    if existing > 0 {
        return Err(DataFusionError::Execution(format!(
            "{name}: {} already holds {existing} {name}-*.parquet file(s); \
             remove them or choose another directory",
            out_dir.display()
        )));
    }

    let files = table.rows.div_ceil(rows_per_file).max(1);
    let file_ids: Vec<u64> = (0..files).collect();
    let progress = Progress::new(name, table.rows, show_progress);
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();

    let bytes = parallel_map(&file_ids, |&f| {
        let start = f * rows_per_file;
        let end = (start + rows_per_file).min(table.rows);
        let path = out_dir.join(format!("{name}-{f:05}.parquet"));
        // Written under a temporary name so that an interrupted run leaves no valid-looking file.
        let tmp = out_dir.join(format!(".{name}-{f:05}.parquet.partial"));
        let result = write_file(table, &tmp, start..end, props.clone(), &progress)
            .and_then(|()| fs::rename(&tmp, &path).map_err(|e| io_error("rename", &tmp, e)))
            .and_then(|()| {
                fs::metadata(&path)
                    .map(|m| m.len())
                    .map_err(|e| io_error("stat", &path, e))
            });
        match &result {
            Ok(_) => progress.file_written(&path, end - start),
            Err(_) => {
                let _ = fs::remove_file(&tmp);
            }
        }
        result
    });
    progress.finish(bytes.is_ok());
    Ok(WriteSummary {
        files: files as usize,
        rows: table.rows,
        bytes: bytes?.iter().sum(),
    })
}

fn write_file<G>(
    table: &Table<'_, G>,
    path: &Path,
    range: std::ops::Range<u64>,
    props: WriterProperties,
    progress: &Progress,
) -> Result<()>
where
    G: Fn(u64, usize) -> Result<RecordBatch> + Sync,
{
    let file = File::create(path).map_err(|e| io_error(table.name, "create", path, e))?;
    let mut writer = ArrowWriter::try_new(file, table.schema.clone(), Some(props))?;
    let mut lo = range.start;
    while lo < range.end {
        let len = (range.end - lo).min(WRITE_BATCH_ROWS as u64);
        writer.write(&(table.generate)(lo, len as usize)?)?;
        progress.rows_written(len);
        lo += len;
    }
    writer.close()?;
    Ok(())
}

/// How [`write_parquet`] reports its progress where asked to: a progress bar on the terminal
/// in the CLI's build (feature `cli`), else a log line (`log::info!`) per file written.
struct Progress {
    #[cfg(feature = "cli")]
    bar: indicatif::ProgressBar,
    #[cfg(not(feature = "cli"))]
    shown: bool,
    #[cfg(not(feature = "cli"))]
    name: String,
}

#[cfg(feature = "cli")]
impl Progress {
    fn new(_name: &str, rows: u64, shown: bool) -> Self {
        use indicatif::{ProgressBar, ProgressStyle};
        if !shown {
            return Self {
                bar: ProgressBar::hidden(),
            };
        }
        let bar = ProgressBar::new(rows);
        let style = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{wide_bar}] {human_pos}/{human_len} rows \
             ({per_sec}, ETA {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Self { bar }
    }

    fn rows_written(&self, rows: u64) {
        self.bar.inc(rows);
    }

    fn file_written(&self, _path: &Path, _rows: u64) {}

    fn finish(&self, ok: bool) {
        match ok {
            true => self.bar.finish(),
            false => self.bar.abandon(),
        }
    }
}

#[cfg(not(feature = "cli"))]
impl Progress {
    fn new(name: &str, _rows: u64, shown: bool) -> Self {
        Self {
            shown,
            name: name.to_string(),
        }
    }

    fn rows_written(&self, _rows: u64) {}

    fn file_written(&self, path: &Path, rows: u64) {
        if self.shown {
            log::info!("{}: wrote {rows} rows to {}", self.name, path.display());
        }
    }

    fn finish(&self, _ok: bool) {}
}
