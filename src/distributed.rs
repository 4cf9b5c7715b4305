//! The operator in a cluster, under [datafusion-distributed]'s planner.
//!
//! The coordinator plans the query as one process would, our rule included, then the engine
//! cuts the plan into stages at merges, coalesces and hash repartitions and sends each stage's
//! tasks to the workers. Under that planner the rule splits a top-k over several partitions in
//! two:
//!
//! ```text
//! GpuTopKExec k+m, skip=m (CPU path)       coordinator: merges the tasks' rows, reading them
//!   CoalescePartitionsExec                   task by task; the offset, the output columns
//!     GpuTopKExec k+m, per_task     ─────▶  each task: the top k+m of its slice of the
//!       input (files sliced per task)          input, planned on the worker's own device
//! ```
//!
//! [`GpuTopKCodec`] carries the operator to the workers: its expressions (as DataFusion's
//! protobuf), k, the offset and the session's `gpu_topk` settings. A worker plans the operator
//! again from them ([`crate::rule::decoded_top_k`]) for its own GPU, column cache and
//! calibration; where it declines (no GPU under `backend = auto`) it runs DataFusion's plan of
//! the same rows.
//!
//! Ties stay those of one process: the files below a per-task operator are split into
//! contiguous runs of the scan's partitions ([`files_in_order`]), and the merge reads the
//! tasks in order, so rows keep their one-process input order (partition, batch, row). An
//! operator that must read all of its input (the merge, a lone sort over one partition) runs
//! as one task ([`one_task`]). Per-group top-k stays with DataFusion's window plan, which the
//! engine distributes by its hash repartition. A per-task top-k's task `i` runs on worker `i`
//! on every query ([`same_workers`]), so each worker's column cache keeps serving its files.
//!
//! [datafusion-distributed]: https://github.com/datafusion-contrib/datafusion-distributed

use std::sync::Arc;

use datafusion::common::config::ExtensionOptions;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{exec_err, internal_datafusion_err};
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SessionState, SessionStateBuilder, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, LexOrdering, PhysicalSortExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_distributed::{
    DesiredTaskCountEvent, DesiredTaskCountEventResponse, DistributedExt, DistributedGetterExt,
    DistributedLeafExec, NetworkBoundaryExt, RouteTasksEvent, RouteTasksEventResponse,
    ScaleUpLeafNodeEvent, ScaleUpLeafNodeEventResponse, Worker, WorkerQueryContext, WorkerResolver,
};
use datafusion_proto::physical_plan::from_proto::parse_physical_sort_exprs;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;
use url::Url;

use crate::config::GpuTopKConfig;
use crate::exec::{GpuGroupTopKExec, GpuTopKExec};
use crate::input::gpu_table::GpuTableExec;
use crate::rule::Shape;

/// Serialises [`GpuTopKExec`] (and [`crate::GpuTable`] scans) for datafusion-distributed's workers (register it on the
/// coordinator and on every worker: [`crate::SessionStateBuilderExt::with_gpu_topk_cluster`]
/// does both).
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuTopKCodec;

/// One node on the wire: the operator, or a [`crate::GpuTable`]'s scan (as the in-memory
/// scan of its batches: workers have no such table).
#[derive(Clone, PartialEq, Message)]
struct GpuNode {
    #[prost(message, optional, tag = "1")]
    top_k: Option<TopKNode>,
    #[prost(message, optional, tag = "2")]
    table_scan: Option<protobuf::PhysicalPlanNode>,
}

/// The operator on the wire: what the rule absorbed, over the input's schema.
#[derive(Clone, PartialEq, Message)]
struct TopKNode {
    #[prost(message, repeated, tag = "1")]
    sort_exprs: Vec<protobuf::PhysicalSortExprNode>,
    #[prost(message, optional, tag = "2")]
    filter: Option<protobuf::PhysicalExprNode>,
    #[prost(message, repeated, tag = "3")]
    output_exprs: Vec<protobuf::PhysicalExprNode>,
    #[prost(uint64, tag = "4")]
    k: u64,
    #[prost(uint64, tag = "5")]
    skip: u64,
    #[prost(bool, tag = "6")]
    per_task: bool,
    /// The output's schema (the replaced nodes').
    #[prost(message, optional, tag = "7")]
    schema: Option<protobuf::Schema>,
    /// The output's ordering, over the output's schema (empty where no sort key is output).
    #[prost(message, repeated, tag = "8")]
    ordering: Vec<protobuf::PhysicalSortExprNode>,
    /// `gpu_topk` settings the coordinator planned with, as `SET` would take them.
    #[prost(message, repeated, tag = "9")]
    settings: Vec<Setting>,
}

#[derive(Clone, PartialEq, Message)]
struct Setting {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// Settings that describe the coordinator's machine rather than the query: a worker keeps
/// its own.
const MACHINE_SETTINGS: [&str; 1] = ["kernel_cache_dir"];

impl PhysicalExtensionCodec for GpuTopKCodec {
    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(table) = node.downcast_ref::<GpuTableExec>() {
            let scan = converter.execution_plan_to_proto(&table.as_memory_scan()?, self)?;
            let message = GpuNode {
                top_k: None,
                table_scan: Some(scan),
            };
            return (message.encode(buf))
                .map_err(|e| internal_datafusion_err!("encoding GpuTableExec: {e}"));
        }
        let Some(exec) = node.downcast_ref::<GpuTopKExec>() else {
            if node.downcast_ref::<GpuGroupTopKExec>().is_some() {
                return exec_err!(
                    "GpuGroupTopKExec runs in one process only: the rule leaves per-group \
                     top-k to DataFusion under a distributed planner"
                );
            }
            return exec_err!("GpuTopKCodec cannot encode {}", node.name());
        };
        let spec = exec.spec();
        let expr = |e: &Arc<dyn datafusion::physical_expr::PhysicalExpr>| {
            converter.physical_expr_to_proto(e, self)
        };
        let sort = |s: &PhysicalSortExpr| -> Result<protobuf::PhysicalSortExprNode> {
            Ok(protobuf::PhysicalSortExprNode {
                expr: Some(Box::new(expr(&s.expr)?)),
                asc: !s.options.descending,
                nulls_first: s.options.nulls_first,
            })
        };
        let ordering = match exec.properties().output_ordering() {
            Some(ordering) => ordering.iter().map(sort).collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let settings = (spec.settings.entries().into_iter())
            .filter(|e| !MACHINE_SETTINGS.contains(&e.key.as_str()))
            .filter_map(|e| Some((e.key, e.value?)))
            .map(|(key, value)| Setting { key, value })
            .collect();
        let message = TopKNode {
            sort_exprs: spec.sort_exprs.iter().map(sort).collect::<Result<_>>()?,
            filter: spec.filter.as_ref().map(expr).transpose()?,
            output_exprs: spec.output_exprs.iter().map(expr).collect::<Result<_>>()?,
            k: spec.k as u64,
            skip: spec.skip as u64,
            per_task: spec.per_task,
            schema: Some(exec.schema().as_ref().try_into()?),
            ordering,
            settings,
        };
        let message = GpuNode {
            top_k: Some(message),
            table_scan: None,
        };
        (message.encode(buf)).map_err(|e| internal_datafusion_err!("encoding GpuTopKExec: {e}"))
    }

    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = GpuNode::decode(buf)
            .map_err(|e| internal_datafusion_err!("decoding a gpu-topk node: {e}"))?;
        let decode = PhysicalPlanDecodeContext::new(ctx, self);
        let node = match node {
            GpuNode {
                table_scan: Some(scan),
                ..
            } => return converter.proto_to_execution_plan(&scan, &decode),
            GpuNode {
                top_k: Some(node), ..
            } => node,
            _ => return exec_err!("an empty gpu-topk node"),
        };
        let [input] = inputs else {
            return exec_err!("GpuTopKExec takes one input, got {}", inputs.len());
        };
        let input_schema = input.schema();
        let ordering = |exprs: &[protobuf::PhysicalSortExprNode], schema| {
            parse_physical_sort_exprs(exprs, &decode, schema, converter)
        };
        let sort_exprs = LexOrdering::new(ordering(&node.sort_exprs, &input_schema)?)
            .ok_or_else(|| internal_datafusion_err!("GpuTopKExec without sort keys"))?;
        let expr = |e| converter.proto_to_physical_expr(e, &input_schema, &decode);
        let filter = node.filter.as_ref().map(expr).transpose()?;
        let output_exprs = node.output_exprs.iter().map(expr).collect::<Result<_>>()?;
        let schema = node
            .schema
            .as_ref()
            .ok_or_else(|| internal_datafusion_err!("GpuTopKExec without its schema"))?;
        let schema = Arc::new(datafusion::arrow::datatypes::Schema::try_from(schema)?);
        let mut equivalences = EquivalenceProperties::new(Arc::clone(&schema));
        if !node.ordering.is_empty() {
            equivalences.add_ordering(ordering(&node.ordering, &schema)?);
        }
        let mut config = GpuTopKConfig::default();
        if let Some(own) = ctx
            .session_config()
            .options()
            .extensions
            .get::<GpuTopKConfig>()
        {
            config.kernel_cache_dir = own.kernel_cache_dir.clone();
        }
        for Setting { key, value } in &node.settings {
            config.set(key, value)?;
        }
        let shape = Shape {
            k: usize::try_from(node.k).map_err(|e| DataFusionError::External(Box::new(e)))?,
            skip: usize::try_from(node.skip).map_err(|e| DataFusionError::External(Box::new(e)))?,
            per_task: node.per_task,
            device: None,
        };
        crate::rule::decoded_top_k(
            Arc::clone(input),
            (sort_exprs, filter, output_exprs),
            shape,
            &config,
            schema,
            equivalences,
        )
    }
}

/// The task count of a stage holding an operator that must read all of its input: one.
/// A per-task top-k leaves the count to its input.
fn one_task(event: DesiredTaskCountEvent<'_>) -> Option<Result<DesiredTaskCountEventResponse>> {
    let plan = event.plan;
    let whole = plan
        .downcast_ref::<GpuTopKExec>()
        .is_some_and(|exec| !exec.spec().per_task)
        || plan.downcast_ref::<GpuGroupTopKExec>().is_some();
    whole.then(|| Ok(DesiredTaskCountEventResponse::maximum(1)))
}

/// Splits a file scan whose partitions must keep their order (a top-k's input breaks ties by
/// it) into contiguous runs of its partitions, task `i` the `i`-th run: the tasks' order is
/// then the one-process order. Other scans are left to the engine (which deals partitions out
/// round-robin).
fn files_in_order(event: ScaleUpLeafNodeEvent<'_>) -> Option<Result<ScaleUpLeafNodeEventResponse>> {
    let scan = event.plan.downcast_ref::<DataSourceExec>()?;
    let files = scan.data_source().downcast_ref::<FileScanConfig>()?;
    if !files.preserve_order || event.task_count <= 1 {
        return None;
    }
    // Every task gets as many partitions (the engine requires it): the last ones may be empty.
    let groups = &files.file_groups;
    let per_task = groups.len().div_ceil(event.task_count).max(1);
    let variants = (0..event.task_count).map(|task| {
        let mut slice = files.clone();
        slice.file_groups = (task * per_task..(task + 1) * per_task)
            .map(|g| {
                groups
                    .get(g)
                    .cloned()
                    .unwrap_or_else(|| FileGroup::new(Vec::new()))
            })
            .collect();
        DataSourceExec::from_data_source(slice) as Arc<dyn ExecutionPlan>
    });
    Some(
        DistributedLeafExec::try_new(Arc::clone(event.plan), variants)
            .map(|leaf| ScaleUpLeafNodeEventResponse::new(Arc::new(leaf))),
    )
}

/// Sends task `i` of a stage that runs a per-task top-k to worker `i` (modulo the workers) on
/// every query: the task reads the same run of the files each time ([`files_in_order`]), so
/// that worker's column cache keeps serving it. The engine's own routing starts at a random
/// worker, and under a cache budget each worker's cache would take turns with the others'
/// files.
fn same_workers(event: RouteTasksEvent<'_>) -> Option<Result<RouteTasksEventResponse>> {
    let mut per_task = false;
    let walked = event.plan.apply(|plan| {
        if plan.as_network_boundary().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        per_task |= (plan.downcast_ref::<GpuTopKExec>()).is_some_and(|e| e.spec().per_task);
        Ok(TreeNodeRecursion::Continue)
    });
    if let Err(e) = walked {
        return Some(Err(e));
    }
    if !per_task {
        return None;
    }
    let urls = (event.task_ctx.session_config())
        .get_distributed_worker_resolver()
        .and_then(|resolver| resolver.get_urls());
    Some(urls.and_then(|urls| in_order(&urls, event.task_count).map(RouteTasksEventResponse::new)))
}

/// Task `i` on worker `i` modulo the workers.
fn in_order(workers: &[Url], tasks: usize) -> Result<Vec<Url>> {
    if workers.is_empty() {
        return exec_err!("no worker to run a top-k's tasks on");
    }
    Ok((0..tasks)
        .map(|i| workers[i % workers.len()].clone())
        .collect())
}

/// Registers [`GpuTopKCodec`] and the operator's stage rules on a session builder, coordinator
/// or worker ([`crate::SessionStateBuilderExt::with_gpu_topk_cluster`]).
pub(crate) fn with_gpu_topk_cluster(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder
        .with_distributed_user_codec(GpuTopKCodec)
        .with_distributed_desired_task_count_handler(one_task)
        .with_distributed_scale_up_leaf_node_handler(files_in_order)
        .with_distributed_route_tasks_handler(same_workers)
}

/// A datafusion-distributed worker whose sessions run the operator with `config` (each
/// query's own `gpu_topk` settings come with its plan). Serve it with
/// `tonic::transport::Server::builder().add_service(worker.into_worker_server())`.
pub fn gpu_worker(config: GpuTopKConfig) -> Worker {
    Worker::from_session_builder(move |context: WorkerQueryContext| {
        let config = config.clone();
        async move { Ok::<SessionState, DataFusionError>(worker_state(context.builder, config)) }
    })
}

fn worker_state(builder: SessionStateBuilder, config: GpuTopKConfig) -> SessionState {
    with_gpu_topk_cluster(crate::session::with_gpu_topk(builder, config)).build()
}

/// A fixed list of worker addresses, for a coordinator's
/// `with_distributed_worker_resolver`.
#[derive(Debug, Clone)]
pub struct StaticWorkers(Vec<Url>);

impl StaticWorkers {
    /// Parses each of `urls` (`http://host:port`), naming the one that is not a URL.
    pub fn parse<S: AsRef<str>>(urls: impl IntoIterator<Item = S>) -> Result<Self> {
        let urls = (urls.into_iter())
            .map(|url| {
                let url = url.as_ref().trim();
                Url::parse(url).map_err(|e| {
                    DataFusionError::Configuration(format!("invalid worker URL '{url}': {e}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if urls.is_empty() {
            return Err(DataFusionError::Configuration("no worker URL given".into()));
        }
        Ok(Self(urls))
    }

    pub fn urls(&self) -> &[Url] {
        &self.0
    }
}

impl WorkerResolver for StaticWorkers {
    fn get_urls(&self) -> Result<Vec<Url>> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_are_checked() {
        let workers = StaticWorkers::parse(["http://localhost:50051", " http://h:1 "]).unwrap();
        assert_eq!(workers.urls().len(), 2);
        let err = StaticWorkers::parse(["localhost 50051"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("invalid worker URL 'localhost 50051'"),
            "{err}"
        );
        let none: [&str; 0] = [];
        assert!(StaticWorkers::parse(none).is_err());
    }

    #[test]
    fn a_task_goes_to_the_same_worker_on_every_query() {
        let workers = StaticWorkers::parse(["http://a:1", "http://b:1", "http://c:1"]).unwrap();
        let hosts = |tasks| -> Vec<String> {
            let urls = in_order(workers.urls(), tasks).unwrap();
            urls.iter()
                .map(|u| u.host_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(hosts(2), ["a", "b"]);
        assert_eq!(hosts(2), hosts(2));
        assert_eq!(hosts(5), ["a", "b", "c", "a", "b"]);
        assert!(in_order(&[], 2).is_err());
    }
}
