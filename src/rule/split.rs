//! A top-k split into parts, per device or per task of a distributed engine, and their merge.

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::config::{Backend, GpuTopKConfig};
use crate::device::DeviceSlot;
use crate::exec::GpuTopKExec;

use super::absorb::{Absorbed, absorb_below, in_input_order, output_columns};
use super::build::build_top_k;
use super::top_k::Shape;
use super::{Declined, because};

/// A top-k over several partitions (a merge over per-partition sorts) run as parts, each over
/// a contiguous run of the input's partitions, and one operator that merges their rows on
/// the CPU path, reading the parts in order: ties go to the first part, whose rows come first
/// in input order, as in one operator.
pub(super) struct Split<'a> {
    /// The per-partition sort, whose output each part yields (and `order` is over).
    pub(super) sort_node: &'a Arc<dyn ExecutionPlan>,
    pub(super) order: &'a LexOrdering,
    /// A column projection between the merge and the sort, which the merge applies.
    pub(super) above_sort: Option<&'a ProjectionExec>,
    pub(super) k: usize,
    pub(super) skip: usize,
}

impl Split<'_> {
    /// What is below the sort, absorbed, read in input order.
    fn absorbed(&self) -> std::result::Result<Absorbed, Declined> {
        let sort = self.sort_node.downcast_ref::<SortExec>().expect("a sort");
        in_input_order(absorb_below(sort.input(), self.order, None)?)
    }

    /// A part: the operator over `absorbed` (or a share of its input).
    fn part(
        &self,
        absorbed: Absorbed,
        (per_task, device): (bool, Option<DeviceSlot>),
        config: &GpuTopKConfig,
    ) -> std::result::Result<GpuTopKExec, Declined> {
        let shape = Shape {
            k: self.k,
            skip: 0,
            per_task,
            device,
        };
        let schema = self.sort_node.schema();
        let equivalences = self.sort_node.equivalence_properties().clone();
        build_top_k(absorbed, shape, config, schema, equivalences)
    }

    /// The merge of the parts' rows (`parts`: their output partitions, in order), with the
    /// replaced `node`'s offset, columns and schema.
    fn merge(
        &self,
        parts: Arc<dyn ExecutionPlan>,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
    ) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
        let schema = parts.schema();
        let output_exprs = output_columns(self.above_sort, &schema);
        let merge = Absorbed {
            input: parts,
            sort_exprs: self.order.clone(),
            filter: None,
            output_exprs,
        };
        // The merge never runs on a device: no device fault is injected into it.
        let mut merge_config = config.clone();
        merge_config.backend = Backend::Cpu;
        merge_config.inject_fault = crate::config::FaultPoint::None;
        let shape = Shape {
            k: self.k,
            skip: self.skip,
            per_task: false,
            device: None,
        };
        let equivalences = node.equivalence_properties().clone();
        let exec = build_top_k(merge, shape, &merge_config, node.schema(), equivalences)?;
        Ok(Arc::new(exec))
    }

    /// Under a distributed engine: one part per task (marked per-task), which the engine
    /// cuts from the merge at the coalesce between them (the merge reads through it).
    pub(super) fn between_tasks(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
    ) -> std::result::Result<Arc<dyn ExecutionPlan>, Declined> {
        let tasks = self.part(self.absorbed()?, (true, None), config)?;
        let tasks = Arc::new(CoalescePartitionsExec::new(Arc::new(tasks)));
        self.merge(tasks, node, config)
    }

    /// With several devices: a part per device over its share of a file or in-memory scan's
    /// partitions, each with its own device's column cache. `None` (one operator) where the
    /// input is not such a scan, has fewer partitions than two, or a part is declined.
    pub(super) fn between_devices(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        config: &GpuTopKConfig,
        devices: &[DeviceSlot],
    ) -> std::result::Result<Option<Arc<dyn ExecutionPlan>>, Declined> {
        let absorbed = self.absorbed()?;
        let Some(slices) = scan_slices(&absorbed.input, devices.len()) else {
            return Ok(None);
        };
        let parts = (slices.into_iter().zip(devices))
            .map(|(slice, &device)| {
                let share = Absorbed {
                    input: slice,
                    ..absorbed.clone()
                };
                self.part(share, (false, Some(device)), config).ok()
            })
            .collect::<Option<Vec<_>>>();
        let Some(parts) = parts else {
            return Ok(None);
        };
        // The best k-th key of any device prunes every device's scans.
        let parts = (GpuTopKExec::share_threshold(parts).into_iter())
            .map(|part| Arc::new(part) as Arc<dyn ExecutionPlan>)
            .collect();
        let parts = UnionExec::try_new(parts)
            .or_else(|e| because(format!("cannot join the devices' parts: {e}")))?;
        self.merge(parts, node, config).map(Some)
    }
}

/// `input`, a file or in-memory scan of at least two partitions, as at most `parts` scans of
/// contiguous runs of its partitions, in order.
fn scan_slices(
    input: &Arc<dyn ExecutionPlan>,
    parts: usize,
) -> Option<Vec<Arc<dyn ExecutionPlan>>> {
    let scan = input.downcast_ref::<DataSourceExec>()?;
    let partitions = input.output_partitioning().partition_count();
    if partitions < 2 {
        return None;
    }
    let parts = parts.min(partitions);
    let range = |part: usize| part * partitions / parts..(part + 1) * partitions / parts;
    let source = scan.data_source();
    if let Some(files) =
        source.downcast_ref::<datafusion::datasource::physical_plan::FileScanConfig>()
    {
        return Some(
            (0..parts)
                .map(|part| {
                    let mut slice = files.clone();
                    slice.file_groups = files.file_groups[range(part)].to_vec();
                    DataSourceExec::from_data_source(slice) as Arc<dyn ExecutionPlan>
                })
                .collect(),
        );
    }
    let memory = source.downcast_ref::<datafusion::datasource::memory::MemorySourceConfig>()?;
    if datafusion::datasource::source::DataSource::fetch(memory).is_some()
        || !memory.sort_information().is_empty()
    {
        return None;
    }
    (0..parts)
        .map(|part| {
            let slice = datafusion::datasource::memory::MemorySourceConfig::try_new_exec(
                &memory.partitions()[range(part)],
                memory.original_schema(),
                memory.projection().clone(),
            )
            .ok()?;
            Some(slice as Arc<dyn ExecutionPlan>)
        })
        .collect()
}

/// The devices `gpu_topk.devices` names: `all` is every GPU the driver reports once the
/// process's device is started (before, the one device planning may assume), a list their
/// ordinals (one named twice is two logical devices, each with its own cache).
pub(super) fn resolve_devices(
    config: &GpuTopKConfig,
) -> std::result::Result<Vec<DeviceSlot>, String> {
    match crate::config::device_ordinals(&config.devices)? {
        Some(ordinals) => Ok(crate::device::slots(&ordinals)),
        None => {
            let count = crate::device::started_device_count().unwrap_or(1);
            Ok(crate::device::slots(&(0..count).collect::<Vec<_>>()))
        }
    }
}

/// Whether the session plans for a distributed engine (datafusion-distributed's planner is
/// installed), whose stages are cut at coalesces: a top-k is then split into per-task parts
/// and their merge ([`Split::between_tasks`]).
#[cfg(feature = "cluster")]
pub(super) fn distributed_planning(options: &ConfigOptions) -> bool {
    (options.extensions)
        .get::<datafusion_distributed::DistributedConfig>()
        .is_some()
}

/// Without the `cluster` feature the operator has no codec for a distributed engine's workers:
/// every session plans for one process.
#[cfg(not(feature = "cluster"))]
pub(super) fn distributed_planning(_: &ConfigOptions) -> bool {
    false
}
