use std::sync::Arc;

use datafusion::error::Result;

use crate::device::GpuDevice;
use crate::device::column_cache::{CacheKey, ColumnCache, Loading};
use crate::device::error::gpu_error;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;

use super::columns::load_column;
use super::memory::{memory_input, table_inputs};
use super::parquet::{
    ParquetColumnRows, file_column, global_codes, image_type, keep_dictionary, kept_dictionary,
    parquet_input, read_missing,
};
use super::{ColumnImage, TableInput};
use crate::fusion::{self, FusedProgram, KernelInput};

/// Loads a table's columns into the column cache in the background, after a run on the CPU
/// path chose not to ship them (a plan's warm-up): one load at a time, each column unpinned
/// and within the budget.
pub struct CacheLoader {
    device: Arc<GpuDevice>,
    _loading: Loading<'static>,
}

/// Loads being handed to the background whose loader is not yet known ([`CacheLoader::spawn`]).
/// Process-wide: one load at a time per process, whichever session planned it.
static STARTING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CacheLoader {
    /// Runs `load` in the background with the loader, if there is a GPU and no other load
    /// runs. The device is started there where planning left it unstarted (the query ran on
    /// the CPU path before it could have started), so the query does not wait for it.
    pub fn spawn<F, Fut>(slot: crate::device::DeviceSlot, load: F)
    where
        F: FnOnce(CacheLoader) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        use std::sync::atomic::Ordering;
        STARTING.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let loader = tokio::task::spawn_blocking(move || CacheLoader::start(slot)).await;
            // The loader (if any) marks the cache as loading before this count drops.
            STARTING.fetch_sub(1, Ordering::SeqCst);
            if let Ok(Some(loader)) = loader {
                load(loader).await;
            }
        });
    }

    /// Whether a load runs or is being started.
    pub fn busy() -> bool {
        STARTING.load(std::sync::atomic::Ordering::SeqCst) > 0
            || crate::device::started_gpu().is_some_and(|d| d.column_cache.loading())
    }

    /// The loader of the device in `slot`, where it is usable and no other load runs.
    pub fn start(slot: crate::device::DeviceSlot) -> Option<Self> {
        let device = crate::device::static_gpu_on(slot)?;
        let cache: &'static ColumnCache = &device.column_cache;
        let loading = cache.start_loading()?;
        Some(Self {
            device: Arc::clone(device),
            _loading: loading,
        })
    }

    /// Compiles (or loads) the program, so the next run's plan counts no compile.
    pub fn compile(&self, program: &FusedProgram) -> Result<()> {
        self.device
            .generated_kernel(&program.source, fusion::ENTRY)
            .map(drop)
            .map_err(gpu_error)
    }

    /// Whether the cache holds the column known by `key`.
    pub fn is_resident(&self, key: &CacheKey) -> bool {
        self.device.column_cache.contains(key)
    }

    /// Uploads one column unless the cache holds it; `false` where it does not fit the
    /// budget (the load stops there).
    pub fn load(&self, input: &TableInput<'_>) -> Result<bool> {
        Ok(load_column(&self.device, input, false)?.is_some())
    }
}

/// Loads the program's per-row input columns of a whole-table input (in memory or Parquet
/// files) into the column cache, unpinned, within its budget (Parquet columns as pages decoded
/// on the device where `on_device`).
pub(crate) async fn load_inputs(
    input: &Arc<dyn ExecutionPlan>,
    context: &Arc<TaskContext>,
    program: &FusedProgram,
    loader: &CacheLoader,
    on_device: bool,
) -> Result<()> {
    if let Some(memory) = memory_input(input) {
        let schema = input.schema();
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        for column in table_inputs(&memory, program, &names)?.unwrap_or_default() {
            if column.lookup.is_none() && !loader.load(&column)? {
                break;
            }
        }
        return Ok(());
    }
    let Some(files) = parquet_input(input) else {
        return Ok(());
    };
    let store = context.runtime_env().object_store(files.store())?;
    let layout = files.layout(&store).await?;
    let schema = input.schema();
    for program_input in &program.inputs {
        let (c, image, codes) = match program_input {
            KernelInput::DictionaryMatch { .. } => continue,
            KernelInput::DictionaryCodes(c) => (*c, ColumnImage::Values, true),
            input => match ColumnImage::of(input) {
                Some((c, image)) => (c, image, false),
                None => return Ok(()),
            },
        };
        let key = files.key(c);
        if loader.is_resident(&image.key(key.clone()))
            && !(codes && kept_dictionary(&key).is_none())
        {
            continue;
        }
        // The device decodes pages into a values image only, and not into renumbered codes.
        let on_device = [on_device && image == ColumnImage::Values && !codes];
        let (decoded, mut encoded) =
            read_missing(&files, &store, &layout, &[c], &on_device, false).await;
        let mut chunks = decoded?.remove(0);
        if codes {
            let (renumbered, dictionary) = global_codes(&chunks)?;
            keep_dictionary(&key, dictionary);
            chunks = renumbered;
        }
        let read = (chunks, encoded.remove(0));
        let data_type = image_type(files.data_type(c)?, codes)?;
        let rows = ParquetColumnRows::Whole(layout.rows);
        let column = file_column(key, data_type, rows, read, &schema, c, image);
        if !loader.load(&column)? {
            break;
        }
    }
    Ok(())
}
