//! The cost model: chooses where the selection runs and with which algorithm, and predicts
//! how long it takes.
//!
//! [`choose`] (in `choose.rs`) is the one place the choice is made: it returns a
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
//! At run time an `auto` selector re-asks the model for the final selection, with the actual
//! number of candidates, and the operator asks [`policy`] how its run goes on where the plan
//! meets the input (a first run's rows, the cache's room, Parquet pages, a device failure).

pub mod calibration;
mod choose;
pub(crate) mod model;
pub mod policy;
pub mod validation;

pub use crate::select::{InputForm, SelectionChoice, SelectionPlan};
pub use choose::*;
pub use model::{Case, CostModel};
