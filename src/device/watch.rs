//! What one query does on the device: the device and pinned bytes it holds, the most device
//! memory it may hold, and a fault injected into one of its device operations (testing).
//!
//! A selector enters its [`DeviceWatch`] around its device work ([`DeviceWatch::enter`]); the
//! memory pools and the engine's launch and copy calls report to the watch entered on the
//! calling thread ([`check`]). Each buffer keeps the watch it was taken under and gives its
//! bytes back when it is dropped, so a query's count returns to zero once its buffers are
//! released, however the query ended: finished, fell back to the CPU path, or cancelled.

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use datafusion::physical_plan::metrics::Gauge;

use super::{GpuError, GpuResult};

/// A kind of device operation, as counted for fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceOp {
    /// Taking a device buffer or a pinned host buffer.
    Alloc,
    /// Compiling (NVRTC) or loading a generated program.
    Compile,
    /// Launching a kernel.
    Launch,
    /// A host-to-device copy.
    Upload,
    /// A device-to-host copy (read-back).
    Download,
}

impl DeviceOp {
    pub const ALL: [DeviceOp; 5] = [
        DeviceOp::Alloc,
        DeviceOp::Compile,
        DeviceOp::Launch,
        DeviceOp::Upload,
        DeviceOp::Download,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DeviceOp::Alloc => "alloc",
            DeviceOp::Compile => "compile",
            DeviceOp::Launch => "launch",
            DeviceOp::Upload => "upload",
            DeviceOp::Download => "download",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for DeviceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DeviceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DeviceOp::ALL
            .into_iter()
            .find(|op| op.name() == s)
            .ok_or_else(|| format!("unknown device operation '{s}'"))
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct DeviceWatch {
    /// Fail the n-th (1-based) operation of this kind.
    fault: Option<(DeviceOp, usize)>,
    seen: [AtomicUsize; 5],
    /// Most device bytes held at once (0: no limit but the device's).
    limit: usize,
    device_bytes: Gauge,
    device_peak: Gauge,
    pinned_bytes: Gauge,
}

thread_local! {
    static ENTERED: RefCell<Option<Arc<DeviceWatch>>> = const { RefCell::new(None) };
}

/// Restores the previously entered watch when dropped.
#[must_use]
pub(crate) struct Entered(Option<Arc<DeviceWatch>>);

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.0.take();
        ENTERED.with(|e| *e.borrow_mut() = previous);
    }
}

impl DeviceWatch {
    /// A watch reporting held bytes into `device_bytes` (its peak into `device_peak`) and
    /// `pinned_bytes`; `limit`: the most device bytes (0: no limit).
    pub fn new(
        limit: usize,
        fault: Option<(DeviceOp, usize)>,
        device_bytes: Gauge,
        device_peak: Gauge,
        pinned_bytes: Gauge,
    ) -> Self {
        Self {
            fault: fault.filter(|&(_, n)| n > 0),
            limit,
            device_bytes,
            device_peak,
            pinned_bytes,
            ..Self::default()
        }
    }

    /// Makes this the watch of the calling thread until the guard is dropped.
    pub(crate) fn enter(self: &Arc<Self>) -> Entered {
        Entered(ENTERED.with(|e| e.borrow_mut().replace(Arc::clone(self))))
    }

    /// Device bytes held now.
    #[cfg(test)]
    fn device_bytes(&self) -> usize {
        self.device_bytes.value()
    }

    /// Pinned host bytes held now.
    #[cfg(test)]
    fn pinned_bytes(&self) -> usize {
        self.pinned_bytes.value()
    }

    /// How many operations of this kind were attempted.
    #[cfg(test)]
    fn count(&self, op: DeviceOp) -> usize {
        self.seen[op.index()].load(Ordering::Relaxed)
    }

    fn check(&self, op: DeviceOp) -> GpuResult<()> {
        let n = self.seen[op.index()].fetch_add(1, Ordering::Relaxed) + 1;
        match self.fault {
            Some((fault, at)) if fault == op && at == n => Err(GpuError(format!(
                "fault injected at {op} #{n} (gpu_topk.inject_fault)"
            ))),
            _ => Ok(()),
        }
    }

    fn take_device(&self, bytes: usize) -> GpuResult<()> {
        let held = self.device_bytes.value();
        if self.limit > 0 && held + bytes > self.limit {
            return Err(GpuError(format!(
                "the query's device memory limit (gpu_topk.device_memory_limit = {} bytes) \
                 does not fit {bytes} more bytes ({held} held)",
                self.limit
            )));
        }
        self.device_bytes.add(bytes);
        self.device_peak.set_max(self.device_bytes.value());
        Ok(())
    }
}

fn entered() -> Option<Arc<DeviceWatch>> {
    ENTERED.with(|e| e.borrow().clone())
}

/// Runs `work` outside the calling thread's query: what it allocates is not the query's (the
/// column cache's entries outlive it).
pub(crate) fn outside<T>(work: impl FnOnce() -> T) -> T {
    let previous = ENTERED.with(|e| e.borrow_mut().take());
    let result = work();
    ENTERED.with(|e| *e.borrow_mut() = previous);
    result
}

/// Counts an operation of the calling thread's query; fails where a fault is injected.
pub(crate) fn check(op: DeviceOp) -> GpuResult<()> {
    ENTERED.with(|e| match &*e.borrow() {
        Some(watch) => watch.check(op),
        None => Ok(()),
    })
}

/// Bytes one buffer holds for the query it was taken under; given back on drop.
#[derive(Debug, Default)]
pub(crate) struct Held {
    watch: Option<Arc<DeviceWatch>>,
    bytes: usize,
    pinned: bool,
}

impl Held {
    /// Accounts `bytes` of device memory to the calling thread's query (an allocation: counts
    /// as one, may fail by injection or by the query's limit).
    pub(crate) fn device(bytes: usize) -> GpuResult<Held> {
        let Some(watch) = entered() else {
            return Ok(Held::default());
        };
        watch.check(DeviceOp::Alloc)?;
        watch.take_device(bytes)?;
        Ok(Held {
            watch: Some(watch),
            bytes,
            pinned: false,
        })
    }

    /// Accounts `bytes` of pinned host memory to the calling thread's query.
    pub(crate) fn pinned(bytes: usize) -> GpuResult<Held> {
        let Some(watch) = entered() else {
            return Ok(Held::default());
        };
        watch.check(DeviceOp::Alloc)?;
        watch.pinned_bytes.add(bytes);
        Ok(Held {
            watch: Some(watch),
            bytes,
            pinned: true,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(watch) = &self.watch {
            match self.pinned {
                true => watch.pinned_bytes.sub(self.bytes),
                false => watch.device_bytes.sub(self.bytes),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_fire_once_at_the_nth_operation_of_their_kind() {
        let watch = Arc::new(DeviceWatch::new(
            0,
            Some((DeviceOp::Launch, 2)),
            Gauge::new(),
            Gauge::new(),
            Gauge::new(),
        ));
        assert!(check(DeviceOp::Launch).is_ok(), "no watch entered");
        let _entered = watch.enter();
        assert!(check(DeviceOp::Upload).is_ok());
        assert!(check(DeviceOp::Launch).is_ok());
        let err = check(DeviceOp::Launch).unwrap_err();
        assert!(err.0.contains("launch #2"), "{err}");
        assert!(check(DeviceOp::Launch).is_ok());
        assert_eq!(watch.count(DeviceOp::Launch), 3);
    }

    #[test]
    fn held_bytes_return_on_drop_and_respect_the_limit() {
        let watch = Arc::new(DeviceWatch::new(
            1000,
            None,
            Gauge::new(),
            Gauge::new(),
            Gauge::new(),
        ));
        {
            let _entered = watch.enter();
            let a = Held::device(600).unwrap();
            let err = Held::device(600).unwrap_err();
            assert!(err.0.contains("device_memory_limit"), "{err}");
            let _p = Held::pinned(4096).unwrap();
            assert_eq!((watch.device_bytes(), watch.pinned_bytes()), (600, 4096));
            drop(a);
            let _b = Held::device(1000).unwrap();
        }
        assert_eq!((watch.device_bytes(), watch.pinned_bytes()), (0, 0));
        assert_eq!(watch.device_peak.value(), 1000);
        assert_eq!(watch.count(DeviceOp::Alloc), 4);
    }
}
