//! The cost model: chooses where the selection runs and with which algorithm, and predicts
//! how long it takes.
//!
//! The choice is a pure function of facts. [`before_device`] settles what the settings
//! decide, and, under `auto` with the device not started, a query the CPU path ends before the
//! device could start; otherwise [`DeviceFacts::gather`] (in `facts.rs`), the one place with
//! side effects, starts the device, loads its kernels and reads or runs the calibration, and
//! [`choose`] (in `choose.rs`) decides over those facts: it returns a
//! [`SelectionPlan`] (where, which algorithm, streamed batches or the whole table, warm-up of
//! the column cache after a CPU run), which the operator, the selectors and the device
//! execute. Forced settings are taken as they are
//! (`gpu_topk.backend`, `gpu_topk.algorithm`); with `algorithm = 'auto'` the calibrated
//! analytical model ([`model`], [`calibration`]) predicts the operator's time for every device
//! algorithm and for the CPU path, and the fastest wins (the CPU path only where the backend
//! is `auto`). The prediction covers what the operator does with the rows:
//! compile the generated program when it is not loaded yet, move the touched bytes over PCIe,
//! one device pass that evaluates (filters) and appends them to the candidate buffer, a
//! reduction of that buffer when the input outgrows it, and the final selection over the
//! candidates. EXPLAIN shows the choice and the prediction, EXPLAIN VERBOSE every
//! alternative's, and EXPLAIN ANALYZE the measured `operator_time` beside `predicted_time`.
//! The CPU paths' own rates (the top-k selector's, the per-group heaps', DataFusion's hash
//! aggregation's) come from [`calibration::cpu`], measured without the device once per host
//! and build and kept on disk; the per-group top-k's decision (`choose/groups.rs`) and the top-k
//! over an aggregate's (`choose/aggregate.rs`, priced by the rows and the groups a sample
//! estimates) weigh them against the device's run now and warm.
//! At run time an `auto` selector re-asks the model for the final selection, with the actual
//! number of candidates, and the operator asks [`policy`] how its run goes on where the plan
//! meets the input (a first run's rows, the cache's room, Parquet pages, a device failure).

pub mod calibration;
mod choose;
mod facts;
pub(crate) mod model;
pub mod policy;
pub mod validation;

pub use crate::select::{InputForm, SelectionChoice, SelectionPlan};
pub use choose::*;
pub(crate) use facts::{DeviceFacts, StartFacts};
pub use model::CostModel;
