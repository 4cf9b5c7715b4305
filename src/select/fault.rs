//! Injected device faults ([`FaultPoint`], `SET gpu_topk.inject_fault`): a selector that fails
//! like a device at one chosen step, so tests can check that the operator's fallback gives
//! DataFusion's answer from any point of a query, over any input.
//!
//! The wrapper fails where the selector it wraps would have run; on the GPU machine it wraps the
//! CUDA selector, without a GPU the CPU one, which exercises the same hand-over in the operator.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use datafusion::error::{DataFusionError, Result};

use super::{Admitted, ColumnsInput, DeviceError, FusedAdmitted, SelectInput, TopKSelector};
use crate::config::FaultPoint;

/// The error an injected fault raises: a device error, which the operator falls back from.
pub(crate) fn injected(point: FaultPoint) -> DataFusionError {
    DeviceError(format!("fault injected at {point}")).into_error()
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct FaultInjector {
    inner: Arc<dyn TopKSelector>,
    point: FaultPoint,
    pushes: AtomicUsize,
    /// Set once the fault fired: every later call fails too, as after a driver error.
    failed: AtomicBool,
}

impl FaultInjector {
    pub fn new(inner: Arc<dyn TopKSelector>, point: FaultPoint) -> Self {
        Self {
            inner,
            point,
            pushes: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }

    /// Fails if the fault fires at this step (a push, or the final selection), or fired before.
    fn check(&self, push: bool) -> Result<()> {
        let fires = match self.point {
            FaultPoint::Push(n) if push => self.pushes.fetch_add(1, Ordering::SeqCst) + 1 == n,
            FaultPoint::Finish => !push,
            _ => false,
        };
        if fires {
            self.failed.store(true, Ordering::SeqCst);
        }
        match self.failed.load(Ordering::SeqCst) {
            true => Err(injected(self.point)),
            false => Ok(()),
        }
    }
}

impl TopKSelector for FaultInjector {
    fn describe(&self) -> String {
        format!("{} (fault at {})", self.inner.describe(), self.point)
    }

    fn push(&self, input: SelectInput<'_>) -> Result<Admitted> {
        self.check(true)?;
        self.inner.push(input)
    }

    fn compile_time(&self) -> std::time::Duration {
        self.inner.compile_time()
    }

    fn push_columns(&self, input: ColumnsInput<'_>) -> Result<FusedAdmitted> {
        self.check(true)?;
        self.inner.push_columns(input)
    }

    fn preferred_push_rows(&self) -> usize {
        self.inner.preferred_push_rows()
    }

    fn threshold_row_id(&self) -> Option<u64> {
        self.inner.threshold_row_id()
    }

    fn live_row_ids(&self) -> Result<Option<Vec<u64>>> {
        self.inner.live_row_ids()
    }

    fn finish(&self) -> Result<Vec<u64>> {
        self.check(false)?;
        self.inner.finish()
    }
}
