//! Timing device work with CUDA events: the time between two points of a stream, as the GPU
//! saw it (not the host), which is what benchmarks report.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::GpuResult;

/// Started at a point of a stream; [`stop`](Self::stop) records the end and waits for it.
#[derive(Debug)]
pub struct GpuTimer {
    start: CudaEvent,
    stream: Arc<CudaStream>,
}

impl GpuTimer {
    /// Records the start after the work enqueued so far on `stream`.
    pub fn start(stream: &Arc<CudaStream>) -> GpuResult<Self> {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(Self {
            start,
            stream: Arc::clone(stream),
        })
    }

    /// Records the end after the work enqueued since the start, waits for it, and returns the
    /// elapsed device time in milliseconds.
    pub fn stop(self) -> GpuResult<f32> {
        self.elapsed()
    }

    /// [`stop`](Self::stop) that keeps the start, for a later, longer reading.
    pub(crate) fn elapsed(&self) -> GpuResult<f32> {
        let end = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(self.start.elapsed_ms(&end)?)
    }
}
