//! Device and pinned host memory.
//!
//! [`BufferPool`]: device buffers are expensive to allocate (`cuMemAlloc` synchronises), so a
//! released [`PooledBuffer`] goes back to a per-device pool, keyed by size class (powers of two
//! split in eight steps, so at most 1/8 is wasted), and the next request of that class reuses
//! it. Reuse is stream-ordered without blocking the host: releasing records an event on the
//! releasing stream, and the next user's stream waits for that event before touching the
//! buffer. Kernels take raw device pointers ([`PooledBuffer::ptr`]); the code that launches
//! them keeps each buffer alive until its work is ordered before the release.
//!
//! [`PinnedBuffer`]: page-locked host memory, the only kind from which copies are truly
//! asynchronous (and 7× faster than pageable ones). Uploads stage through write-combined
//! buffers (fast for the device to read, slow for the host to read); read-backs use plain
//! pinned buffers. Each buffer carries an event recorded after its last copy, and host access
//! first waits for it, so the host never overwrites data a copy has not read yet.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CU_MEMHOSTALLOC_WRITECOMBINED, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};

use super::watch::{self, DeviceOp, Held};
use super::{GpuError, GpuResult};

/// The size class of a request: the next multiple of 1/8 of the enclosing power of two
/// (at least 4 KiB).
pub(crate) fn size_class(bytes: usize) -> usize {
    const MIN: usize = 4096;
    if bytes <= MIN {
        return MIN;
    }
    let p = bytes.next_power_of_two();
    let step = p / 8;
    bytes.div_ceil(step) * step
}

/// One raw device allocation; freed on drop (the caller guarantees no pending work uses it).
struct DeviceAllocation {
    ptr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceAllocation {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> GpuResult<Self> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation; the memory is uninitialised, and only used through raw
        // pointers by kernels and copies.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| {
            GpuError(format!(
                "cannot allocate {bytes} bytes of device memory: {e}"
            ))
        })?;
        Ok(Self {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by malloc_sync, freed once; no work on it is pending (see users).
        self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// A cached allocation and the event its last user recorded.
struct Cached {
    allocation: DeviceAllocation,
    released: Option<CudaEvent>,
}

impl Cached {
    /// Blocks until the last user's work is done, then frees (drop).
    fn free_now(self) {
        if let Some(event) = &self.released {
            let _ = event.synchronize();
        }
    }
}

/// Device buffers reused by size class (see the module documentation).
pub struct BufferPool {
    ctx: Arc<CudaContext>,
    /// Most bytes kept cached; beyond that, released buffers are freed.
    limit: usize,
    free: Mutex<PoolState>,
    /// Tests: fill every buffer handed out with 0xA5 bytes, so unwritten output shows.
    poison: AtomicBool,
}

#[derive(Default)]
struct PoolState {
    by_class: HashMap<usize, Vec<Cached>>,
    cached_bytes: usize,
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferPool")
            .field("limit", &self.limit)
            .field("cached_bytes", &self.cached_bytes())
            .finish()
    }
}

impl BufferPool {
    pub fn new(ctx: Arc<CudaContext>, limit: usize) -> Self {
        Self {
            ctx,
            limit,
            free: Mutex::new(PoolState::default()),
            poison: AtomicBool::new(false),
        }
    }

    /// Tests: poison (fill with 0xA5) every buffer handed out from now on.
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, Ordering::Relaxed);
    }

    /// Bytes held in released buffers.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.state().cached_bytes
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of at least `bytes` bytes (contents undefined), for use on `stream`.
    pub(crate) fn alloc(
        self: &Arc<Self>,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> GpuResult<PooledBuffer> {
        let class = size_class(bytes);
        let held = Held::device(class)?;
        let reused = {
            let mut state = self.state();
            let hit = state.by_class.get_mut(&class).and_then(Vec::pop);
            if hit.is_some() {
                state.cached_bytes -= class;
            }
            hit
        };
        let allocation = match reused {
            Some(cached) => {
                if let Some(event) = &cached.released {
                    stream.wait(event)?;
                }
                cached.allocation
            }
            None => match DeviceAllocation::new(&self.ctx, class) {
                Ok(a) => a,
                // Out of memory, perhaps because of what we cache: free it all, then retry.
                Err(_) if self.cached_bytes() > 0 => {
                    self.trim();
                    DeviceAllocation::new(&self.ctx, class)?
                }
                Err(e) => return Err(e),
            },
        };
        if self.poison.load(Ordering::Relaxed) {
            self.ctx.bind_to_thread()?;
            // SAFETY: the whole allocation, on the stream that uses it next.
            unsafe { result::memset_d8_async(allocation.ptr, 0xA5, class, stream.cu_stream()) }?;
        }
        Ok(PooledBuffer {
            allocation: Some(allocation),
            bytes,
            pool: Arc::clone(self),
            stream: Arc::clone(stream),
            _held: held,
        })
    }

    /// Frees every cached buffer (waiting for their last users first).
    pub fn trim(&self) {
        let drained: Vec<Cached> = {
            let mut state = self.state();
            state.cached_bytes = 0;
            state.by_class.drain().flat_map(|(_, v)| v).collect()
        };
        drained.into_iter().for_each(Cached::free_now);
    }

    fn release(&self, allocation: DeviceAllocation, released: Option<CudaEvent>) {
        let cached = Cached {
            allocation,
            released,
        };
        let class = cached.allocation.bytes;
        let mut state = self.state();
        if state.cached_bytes + class <= self.limit {
            state.cached_bytes += class;
            state.by_class.entry(class).or_default().push(cached);
        } else {
            drop(state);
            cached.free_now();
        }
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        self.trim();
    }
}

/// A device buffer lent by a [`BufferPool`]; goes back to it on drop, ordered after the work
/// enqueued so far on its stream.
pub(crate) struct PooledBuffer {
    allocation: Option<DeviceAllocation>,
    bytes: usize,
    pool: Arc<BufferPool>,
    stream: Arc<CudaStream>,
    /// Its bytes, accounted to the query that took it ([`watch`]).
    _held: Held,
}

impl fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PooledBuffer({:#x}, {} bytes)", self.ptr(), self.bytes)
    }
}

impl PooledBuffer {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.allocation.as_ref().map_or(0, |a| a.ptr)
    }

    /// The requested size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            // Without an event (recording failed: the context is broken), wait for the stream.
            let released = self.stream.record_event(None).ok();
            if released.is_none() {
                let _ = self.stream.synchronize();
            }
            self.pool.release(allocation, released);
        }
    }
}

/// Page-locked host memory with an event recorded after its last asynchronous copy.
pub(crate) struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    write_combined: bool,
    event: CudaEvent,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through &/&mut.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("bytes", &self.bytes)
            .field("write_combined", &self.write_combined)
            .finish()
    }
}

impl PinnedBuffer {
    /// `bytes` of pinned memory: write-combined for uploads (the host must not read it), plain
    /// for read-backs.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, write_combined: bool) -> GpuResult<Self> {
        ctx.bind_to_thread()?;
        let event = ctx.new_event(None)?;
        let flags = if write_combined {
            CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        };
        // SAFETY: a plain pinned allocation, freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes.max(1), flags) }.map_err(|e| {
            GpuError(format!(
                "cannot allocate {bytes} bytes of pinned host memory: {e}"
            ))
        })? as *mut u8;
        Ok(Self {
            ptr,
            bytes,
            write_combined,
            event,
            ctx: Arc::clone(ctx),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes
    }

    /// The host bytes, once the last copy from or into them is done.
    pub(crate) fn as_mut_slice(&mut self) -> GpuResult<&mut [u8]> {
        self.event.synchronize()?;
        // SAFETY: `bytes` bytes allocated at `ptr`, no copy in flight, exclusive borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) })
    }

    /// The host bytes, once the last copy is done (not for write-combined buffers: reading
    /// them is very slow, though correct).
    pub(crate) fn as_slice(&self) -> GpuResult<&[u8]> {
        self.event.synchronize()?;
        // SAFETY: as above, shared borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) })
    }

    /// Enqueues a copy of the first `len` bytes to device address `dst` on `stream`.
    pub fn upload(&mut self, len: usize, dst: u64, stream: &CudaStream) -> GpuResult<()> {
        watch::check(DeviceOp::Upload)?;
        if len > self.bytes {
            return Err(GpuError(format!(
                "upload of {len} bytes from a {}-byte pinned buffer",
                self.bytes
            )));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the source is pinned, stays alive and unmodified until the event recorded
        // next has completed (host access waits for it, Drop too).
        unsafe {
            let src = std::slice::from_raw_parts(self.ptr, len);
            result::memcpy_htod_async(dst, src, stream.cu_stream())?;
        }
        self.event.record(stream)?;
        Ok(())
    }

    /// Enqueues a copy of `len` bytes from device address `src` into the first `len` bytes.
    pub(crate) fn download(&mut self, src: u64, len: usize, stream: &CudaStream) -> GpuResult<()> {
        self.download_at(0, src, len, stream)
    }

    /// Enqueues a copy of `len` bytes from device address `src` into the bytes from `at`.
    pub(crate) fn download_at(
        &mut self,
        at: usize,
        src: u64,
        len: usize,
        stream: &CudaStream,
    ) -> GpuResult<()> {
        watch::check(DeviceOp::Download)?;
        if at.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(GpuError(format!(
                "download of {len} bytes at {at} into a {}-byte pinned buffer",
                self.bytes
            )));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: as for upload; the host reads only after the event.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.ptr.add(at), len);
            result::memcpy_dtoh_async(dst, src, stream.cu_stream())?;
        }
        self.event.record(stream)?;
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.ctx.record_err(self.event.synchronize());
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by malloc_host, freed once, no copy in flight.
        self.ctx
            .record_err(unsafe { result::free_host(self.ptr as *mut _) });
    }
}

/// Pinned buffers reused across selections (pinning is slow: it maps pages for the device).
pub struct PinnedPool {
    ctx: Arc<CudaContext>,
    limit: usize,
    free: Mutex<Vec<PinnedBuffer>>,
}

impl fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedPool")
            .field("limit", &self.limit)
            .finish()
    }
}

impl PinnedPool {
    pub fn new(ctx: Arc<CudaContext>, limit: usize) -> Self {
        Self {
            ctx,
            limit,
            free: Mutex::new(Vec::new()),
        }
    }

    /// A pinned buffer of at least `bytes` bytes of the requested kind.
    pub(crate) fn take(
        self: &Arc<Self>,
        bytes: usize,
        write_combined: bool,
    ) -> GpuResult<PinnedLease> {
        let hit = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.write_combined == write_combined && b.bytes >= bytes)
                .min_by_key(|(_, b)| b.bytes)
                .map(|(i, _)| i);
            best.map(|i| free.remove(i))
        };
        let held = match Held::pinned(hit.as_ref().map_or(size_class(bytes), |b| b.bytes)) {
            Ok(held) => held,
            Err(e) => {
                if let Some(b) = hit {
                    self.release(b);
                }
                return Err(e);
            }
        };
        let buffer = match hit {
            Some(b) => b,
            None => PinnedBuffer::new(&self.ctx, size_class(bytes), write_combined)?,
        };
        Ok(PinnedLease {
            buffer: Some(buffer),
            pool: Arc::clone(self),
            _held: held,
        })
    }

    /// Keeps `buffer` for reuse, freeing the longest-kept buffers past the limit (a repeated
    /// query then finds the buffers its last run returned).
    fn release(&self, buffer: PinnedBuffer) {
        if buffer.bytes > self.limit {
            return;
        }
        let evicted = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push(buffer);
            let mut cached: usize = free.iter().map(|b| b.bytes).sum();
            let mut oldest = 0;
            while cached > self.limit {
                cached -= free[oldest].bytes;
                oldest += 1;
            }
            free.drain(..oldest).collect::<Vec<_>>()
        };
        // Freed outside the lock: unpinning is slow.
        drop(evicted);
    }
}

/// A [`PinnedBuffer`] lent by a [`PinnedPool`], returned on drop.
#[derive(Debug)]
pub(crate) struct PinnedLease {
    buffer: Option<PinnedBuffer>,
    pool: Arc<PinnedPool>,
    /// Its bytes, accounted to the query that took it ([`watch`]).
    _held: Held,
}

impl std::ops::Deref for PinnedLease {
    type Target = PinnedBuffer;
    fn deref(&self) -> &PinnedBuffer {
        self.buffer
            .as_ref()
            .expect("lease holds a buffer until dropped")
    }
}

impl std::ops::DerefMut for PinnedLease {
    fn deref_mut(&mut self) -> &mut PinnedBuffer {
        self.buffer
            .as_mut()
            .expect("lease holds a buffer until dropped")
    }
}

impl Drop for PinnedLease {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.release(buffer);
        }
    }
}
