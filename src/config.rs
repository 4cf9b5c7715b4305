//! Settings, as a DataFusion [`ConfigExtension`] under the `gpu_topk` namespace, so that they
//! can be changed from SQL: `SET gpu_topk.enabled = false`, `SET gpu_topk.backend = 'cpu'`.

use std::fmt;
use std::str::FromStr;

use datafusion::common::config::{ConfigEntry, ConfigExtension, ExtensionOptions};
use datafusion::common::{config_field, extensions_options};
use datafusion::error::DataFusionError;

pub use crate::device::watch::DeviceOp;

/// Where the top-k selection runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The GPU when one is usable; otherwise DataFusion's own TopK stays in the plan.
    #[default]
    Auto,
    /// Force the CUDA backend (falls back to the CPU path, visibly, if the GPU fails).
    Cuda,
    /// Force this crate's CPU path (the GPU path's twin; also used without a GPU).
    Cpu,
}

/// Which selection algorithm runs (`auto` lets the cost model choose).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    #[default]
    Auto,
    Bitonic,
    Radix,
    Delegate,
    Sample,
    Cpu,
}

macro_rules! keyword_enum {
    ($ty:ident, $what:literal, $($variant:ident => $name:literal),+ $(,)?) => {
        impl $ty {
            /// Every accepted spelling, for error messages.
            pub const NAMES: &'static [&'static str] = &[$($name),+];
            pub fn as_str(&self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl FromStr for $ty {
            type Err = DataFusionError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($name => Ok($ty::$variant),)+
                    other => Err(DataFusionError::Configuration(format!(
                        "invalid {} '{other}': expected one of {}",
                        $what,
                        Self::NAMES.join(", ")
                    ))),
                }
            }
        }
        config_field!($ty);
    };
}

keyword_enum!(Backend, "gpu_topk.backend", Auto => "auto", Cuda => "cuda", Cpu => "cpu");
keyword_enum!(Algorithm, "gpu_topk.algorithm",
    Auto => "auto", Bitonic => "bitonic", Radix => "radix",
    Delegate => "delegate", Sample => "sample", Cpu => "cpu");

/// A device failure injected on purpose, to test that a failing GPU selection never changes
/// a query's answer (`SET gpu_topk.inject_fault = 'push:3'`). Off by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultPoint {
    #[default]
    None,
    /// Building the selector fails (as a compile or allocation failure does).
    Create,
    /// The n-th push of rows (1-based) fails, and every later call (as a driver error does).
    Push(usize),
    /// The final selection fails.
    Finish,
    /// The n-th device operation of one kind (allocation, compile, kernel launch, upload,
    /// read-back) of the query fails: `alloc:N`, `compile:N`, `launch:N`, `upload:N`,
    /// `download:N`. Only a GPU selection performs them.
    Device(DeviceOp, usize),
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultPoint::None => f.write_str("none"),
            FaultPoint::Create => f.write_str("create"),
            FaultPoint::Push(n) => write!(f, "push:{n}"),
            FaultPoint::Finish => f.write_str("finish"),
            FaultPoint::Device(op, n) => write!(f, "{op}:{n}"),
        }
    }
}

impl FromStr for FaultPoint {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        let counted = s.split_once(':').and_then(|(what, n)| {
            let n = n.trim().parse::<usize>().ok().filter(|&n| n > 0)?;
            match what.trim() {
                "push" => Some(FaultPoint::Push(n)),
                op => op.parse().ok().map(|op| FaultPoint::Device(op, n)),
            }
        });
        match (s.as_str(), counted) {
            ("" | "none", _) => Ok(FaultPoint::None),
            ("create", _) => Ok(FaultPoint::Create),
            ("finish", _) => Ok(FaultPoint::Finish),
            (_, Some(point)) => Ok(point),
            (other, None) => Err(DataFusionError::Configuration(format!(
                "invalid gpu_topk.inject_fault '{other}': expected none, create, finish, or \
                 push, alloc, compile, launch, upload or download followed by :N (N >= 1)"
            ))),
        }
    }
}

config_field!(FaultPoint);

extensions_options! {
    /// The settings' values; [`GpuTopKConfig`] dereferences to them.
    pub struct GpuTopKSettings {
        /// Replace DataFusion's TopK with the GPU top-k operator where the query's shape allows.
        pub enabled: bool, default = true
        /// `auto` (GPU when present, else DataFusion's TopK), `cuda` or `cpu`.
        pub backend: Backend, default = Backend::Auto
        /// `auto` (cost model) or one of bitonic, radix, delegate, sample, cpu.
        pub algorithm: Algorithm, default = Algorithm::Auto
        /// Largest k (fetch + offset) the operator takes; larger ones stay with DataFusion.
        pub max_k: usize, default = 1 << 24
        /// Directory of the compiled-kernel cache (empty: the platform cache directory).
        pub kernel_cache_dir: String, default = String::new()
        /// Evaluate the predicate and ranking expressions on the GPU, in generated code, where
        /// they translate; `false` evaluates them on the host (DataFusion) and ships columns.
        pub fuse_expressions: bool, default = true
        /// Measure the device for the cost model again (once per process while set), instead
        /// of reading the cached calibration.
        pub recalibrate: bool, default = false
        /// Testing: make the GPU selection fail at one step (`create`, `push:N`, `finish`), or
        /// one device operation fail (`alloc:N`, `compile:N`, `launch:N`, `upload:N`,
        /// `download:N`); the operator must still give DataFusion's answer.
        pub inject_fault: FaultPoint, default = FaultPoint::None
        /// Most device memory, in bytes, one query's selection may hold (0: no limit but the
        /// device's). A query that needs more falls back to the CPU path.
        pub device_memory_limit: usize, default = 0
        /// Most pinned host memory, in bytes, that a per-group top-k's output batches may
        /// hold: up to it, the rows the device reads back stay in the buffers they arrived
        /// in (no copy), which return to the process's pinned pool (1 GiB) when the batches
        /// are dropped; past it, and at 0, each piece is copied out. Above half the pool, a
        /// repeated query no longer finds its buffers there and pins new ones.
        pub pinned_output_bytes: usize, default = 1 << 29
        /// Whether this session's queries use the device column cache, which keeps in-memory
        /// tables' and Parquet files' columns on the GPU between queries so that a repeated
        /// query does not ship them over PCIe again. The cache is the process's, shared by
        /// every session; its budget is set for the process (`set_column_cache_budget`).
        pub column_cache: bool, default = true
        /// Load Parquet columns into the column cache as their pages, decoded on the device
        /// (PLAIN and dictionary-encoded fixed-width values of a flat schema; the host reads
        /// and decompresses the pages), instead of decoding them on the host. Columns the
        /// device does not decode are decoded on the host either way.
        pub decode_parquet_on_device: bool, default = true
        /// After a run on the CPU path over a table the column cache can hold, load the
        /// columns it read into the cache in the background (starting the device if it is
        /// not), so that the next query runs warm. The CLI turns it off for a lone `-c`
        /// statement, which has no next query to wait for it.
        pub load_after_cpu: bool, default = true
        /// Rewrite an in-memory table's (`MemTable`'s: `CREATE TABLE … AS`, `INSERT INTO`,
        /// registered batches) runs of small batches into large ones when a query first
        /// reads them, in place and once: its rows, partitions and order stay as they are,
        /// and every later query plans, keys its columns in the column cache and locates its
        /// winners over a few batches instead of thousands. Rows appended since are merged by
        /// the next query. Only while the operator is enabled.
        pub compact_tables: bool, default = true
        /// The GPUs a top-k over several partitions is split between: `all` (every GPU the
        /// driver reports) or their ordinals, e.g. `0,1`. Each takes a contiguous run of a
        /// file or in-memory scan's partitions, selects its top k with its own column cache,
        /// and the rows are merged on the host; the best k-th key of any device prunes every
        /// device's scans. A GPU named twice is two logical devices.
        pub devices: String, default = "all".to_string()
        /// Replace a top-k over an aggregation (`GROUP BY … ORDER BY … LIMIT k`) with one
        /// operator, `GpuAggregateTopKExec`, where every key, aggregate and expression of the
        /// query translates; it runs DataFusion's plan of the query where the device does not.
        /// A query that does not translate keeps DataFusion's plan, and EXPLAIN says why.
        pub aggregate_topk: bool, default = true
    }
}

/// The ordinals `gpu_topk.devices` lists (`None`: `all`), or why the value is not a list.
pub(crate) fn device_ordinals(value: &str) -> Result<Option<Vec<usize>>, String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    let ordinals = (value.split(','))
        .map(|o| o.trim().parse::<usize>().ok().filter(|&o| o < 1024))
        .collect::<Option<Vec<_>>>()
        .filter(|o| !o.is_empty());
    match ordinals {
        Some(ordinals) => Ok(Some(ordinals)),
        None => Err(format!(
            "invalid gpu_topk.devices '{value}': expected all or GPU ordinals such as 0,1"
        )),
    }
}

/// Settings of the GPU top-k operator (`SET gpu_topk.<name> = <value>`): the fields of
/// [`GpuTopKSettings`], registered under the `gpu_topk` namespace. A rejected `SET` names the
/// setting and the value.
#[derive(Debug, Clone, Default)]
pub struct GpuTopKConfig(GpuTopKSettings);

impl std::ops::Deref for GpuTopKConfig {
    type Target = GpuTopKSettings;
    fn deref(&self) -> &GpuTopKSettings {
        &self.0
    }
}

impl std::ops::DerefMut for GpuTopKConfig {
    fn deref_mut(&mut self) -> &mut GpuTopKSettings {
        &mut self.0
    }
}

impl ExtensionOptions for GpuTopKConfig {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }
    fn set(&mut self, key: &str, value: &str) -> datafusion::error::Result<()> {
        let entries = self.0.entries();
        if !entries.iter().any(|e| e.key == key) {
            let names: Vec<_> = entries.iter().map(|e| e.key.as_str()).collect();
            return Err(DataFusionError::Configuration(format!(
                "unknown setting gpu_topk.{key}: expected one of {}",
                names.join(", ")
            )));
        }
        if key == "devices" {
            device_ordinals(value).map_err(DataFusionError::Configuration)?;
        }
        self.0.set(key, value).map_err(|e| match e {
            // The keyword settings' own messages name the setting already.
            DataFusionError::Configuration(m) if m.contains("gpu_topk.") => {
                DataFusionError::Configuration(m)
            }
            e => DataFusionError::Configuration(format!(
                "invalid gpu_topk.{key} '{value}': {}",
                e.strip_backtrace()
            )),
        })
    }
    fn entries(&self) -> Vec<ConfigEntry> {
        self.0.entries()
    }
}

impl ConfigExtension for GpuTopKConfig {
    const PREFIX: &'static str = "gpu_topk";
}

impl GpuTopKConfig {
    pub fn with_enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }
    pub fn with_max_k(mut self, max_k: usize) -> Self {
        self.max_k = max_k;
        self
    }
    pub fn with_fuse_expressions(mut self, fuse: bool) -> Self {
        self.fuse_expressions = fuse;
        self
    }
    pub fn with_recalibrate(mut self, recalibrate: bool) -> Self {
        self.recalibrate = recalibrate;
        self
    }
    pub fn with_device_memory_limit(mut self, bytes: usize) -> Self {
        self.device_memory_limit = bytes;
        self
    }
    pub fn with_pinned_output_bytes(mut self, bytes: usize) -> Self {
        self.pinned_output_bytes = bytes;
        self
    }
    pub fn with_decode_parquet_on_device(mut self, on_device: bool) -> Self {
        self.decode_parquet_on_device = on_device;
        self
    }
    pub fn with_column_cache(mut self, use_cache: bool) -> Self {
        self.column_cache = use_cache;
        self
    }
    pub fn with_load_after_cpu(mut self, load: bool) -> Self {
        self.load_after_cpu = load;
        self
    }
    /// The GPUs to split top-k queries between (`gpu_topk.devices`): ordinals, or `None`
    /// for all.
    pub fn with_devices(mut self, ordinals: Option<&[usize]>) -> Self {
        self.devices = match ordinals {
            None => "all".to_string(),
            Some(o) => (o.iter().map(|o| o.to_string()))
                .collect::<Vec<_>>()
                .join(","),
        };
        self
    }
    pub fn with_compact_tables(mut self, compact: bool) -> Self {
        self.compact_tables = compact;
        self
    }
    pub fn with_inject_fault(mut self, fault: FaultPoint) -> Self {
        self.inject_fault = fault;
        self
    }
}
