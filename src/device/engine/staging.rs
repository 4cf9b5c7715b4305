//! Host data to the device: pinned staging filled without the engine (so partitions fill
//! theirs in parallel), and the engine's uploads through its two pinned buffers in turn.

use super::*;

/// Host byte slices copied into one pinned (write-combined) buffer at aligned offsets, ready for
/// [`TopKEngine::upload_staged`]. Filling needs no engine, so callers fill theirs in parallel
/// and hold the engine only for the copy and the kernels.
#[derive(Debug)]
pub(crate) struct StagedHost {
    lease: PinnedLease,
    offsets: Vec<usize>,
    total: usize,
}

/// Copies `groups` into a pinned buffer from the device's pool: each group at an aligned
/// offset, its slices back to back (one device array from several host chunks).
pub(crate) fn fill_staging(
    device: &Arc<GpuDevice>,
    groups: &[Vec<&[u8]>],
) -> GpuResult<StagedHost> {
    let mut offsets = Vec::with_capacity(groups.len());
    let mut total = 0usize;
    for group in groups {
        offsets.push(total);
        let bytes: usize = group.iter().map(|p| p.len()).sum();
        total += bytes.div_ceil(STAGE_ALIGN) * STAGE_ALIGN;
    }
    let total = total.max(STAGE_ALIGN);
    let mut lease = device.pinned.take(total, true)?;
    let host = lease.as_mut_slice()?;
    for (&offset, group) in offsets.iter().zip(groups) {
        let mut at = offset;
        for part in group {
            host[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }
    Ok(StagedHost {
        lease,
        offsets,
        total,
    })
}

/// Copies the bytes of `parts` (image offset, bytes; in offset order) that fall in the image's window
/// `[start, start + window.len())` into `window`; large windows on several threads, since one
/// thread's copy into write-combined memory is slower than PCIe.
fn fill_window(window: &mut [u8], start: usize, parts: &[(usize, &[u8])]) {
    let copy = |window: &mut [u8], start: usize| {
        let end = start + window.len();
        let first = parts.partition_point(|(offset, data)| offset + data.len() <= start);
        for &(offset, data) in &parts[first..] {
            if offset >= end {
                break;
            }
            let a = start.max(offset);
            let b = end.min(offset + data.len());
            if a < b {
                window[a - start..b - start].copy_from_slice(&data[a - offset..b - offset]);
            }
        }
    };
    let threads = fill_threads().min(window.len() / PARALLEL_FILL_BYTES);
    if threads <= 1 {
        return copy(window, start);
    }
    let piece = window.len().div_ceil(threads);
    let pieces: Vec<(usize, &mut [u8])> = window.chunks_mut(piece).enumerate().collect();
    on_fill_threads(pieces, |(i, part)| copy(part, start + i * piece));
}

/// Threads the staging fills run on: the machine's cores.
fn fill_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A piece of fill work handed to a fill thread, with its lifetime erased (see
/// [`on_fill_threads`]).
type FillJob = Box<dyn FnOnce() + Send + 'static>;

/// The fill threads, started on first use and kept: spawning threads for every chunk costs a
/// good part of the chunk's copy at PCIe rates. Process-wide: every device's uploads share
/// the host's cores.
static FILL_THREADS: std::sync::LazyLock<Vec<std::sync::Mutex<std::sync::mpsc::Sender<FillJob>>>> =
    std::sync::LazyLock::new(|| {
        (0..fill_threads())
            .filter_map(|i| {
                let (send, receive) = std::sync::mpsc::channel::<FillJob>();
                std::thread::Builder::new()
                    .name(format!("gpu-topk-fill-{i}"))
                    .spawn(move || {
                        while let Ok(job) = receive.recv() {
                            job();
                        }
                    })
                    .ok()
                    .map(|_| std::sync::Mutex::new(send))
            })
            .collect()
    });

/// Runs `work` on each of `items`, the first on the calling thread and the others on the fill
/// threads, and returns when all are done (a panic in one is raised here).
fn on_fill_threads<T: Send>(items: Vec<T>, work: impl Fn(T) + Sync) {
    use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Condvar, Mutex};
    /// Jobs not finished, and whether one panicked (shared, so that a job's last touch of it
    /// never outlives it).
    struct Done {
        left: Mutex<usize>,
        all: Condvar,
        panicked: AtomicBool,
    }
    let done = Arc::new(Done {
        left: Mutex::new(0),
        all: Condvar::new(),
        panicked: AtomicBool::new(false),
    });
    let mut items = items.into_iter();
    let first = items.next();
    let threads = &*FILL_THREADS;
    for (i, item) in items.enumerate() {
        *done.left.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let (work, done) = (&work, Arc::clone(&done));
        let job = move || {
            if catch_unwind(AssertUnwindSafe(|| work(item))).is_err() {
                done.panicked.store(true, Ordering::Relaxed);
            }
            let mut left = done.left.lock().unwrap_or_else(|e| e.into_inner());
            *left -= 1;
            if *left == 0 {
                done.all.notify_all();
            }
        };
        let job: Box<dyn FnOnce() + Send + '_> = Box::new(job);
        // SAFETY: the job borrows `work` and the item's data, which outlive this function, and
        // this function returns (or unwinds) only once every job sent has finished with them
        // (`left` back to 0); a job that cannot be sent runs here instead.
        let job: FillJob = unsafe { std::mem::transmute(job) };
        let sent = match threads.get(i % threads.len().max(1)) {
            Some(thread) => match thread.lock() {
                Ok(sender) => sender.send(job).map_err(|e| e.0),
                Err(_) => Err(job),
            },
            None => Err(job),
        };
        if let Err(job) = sent {
            job();
        }
    }
    let here = first.map(|item| catch_unwind(AssertUnwindSafe(|| work(item))));
    let mut left = done.left.lock().unwrap_or_else(|e| e.into_inner());
    while *left > 0 {
        left = done.all.wait(left).unwrap_or_else(|e| e.into_inner());
    }
    drop(left);
    if let Some(Err(panic)) = here {
        resume_unwind(panic);
    }
    if done.panicked.load(Ordering::Relaxed) {
        panic!("a staging fill thread panicked");
    }
}

/// Bytes per thread below which a staging copy is not split.
const PARALLEL_FILL_BYTES: usize = 4 << 20;

impl TopKEngine {
    /// Uploads an image of `total` bytes, made of `parts` (offset, bytes; in offset order, not
    /// overlapping) with undefined gaps, to device address `dst`, in chunks through the two
    /// pinned buffers in turn.
    pub(crate) fn upload_image(
        &mut self,
        parts: &[(usize, &[u8])],
        total: usize,
        dst: u64,
    ) -> GpuResult<()> {
        let mut start = 0;
        while start < total {
            let end = (start + UPLOAD_CHUNK).min(total);
            let slot = self.next_upload;
            self.next_upload ^= 1;
            let need = end - start;
            if self.upload[slot].as_ref().is_none_or(|l| l.len() < need) {
                // Dropping the old lease returns it; its event guards any copy in flight.
                self.upload[slot] = Some(self.device.pinned.take(need.max(1 << 20), true)?);
            }
            let lease = self.upload[slot].as_mut().expect("set above");
            let host = lease.as_mut_slice()?; // waits for this buffer's previous copy
            fill_window(&mut host[..need], start, parts);
            lease.upload(need, dst + start as u64, &self.stream)?;
            start = end;
        }
        Ok(())
    }

    /// Uploads host bytes to device address `dst` (asynchronously; the host data is copied
    /// into pinned memory before this returns).
    pub fn upload_bytes(&mut self, src: &[u8], dst: u64) -> GpuResult<()> {
        self.upload_image(&[(0, src)], src.len(), dst)
    }

    /// Stages host byte slices on the device, each at an aligned offset of one staging
    /// buffer, with as few copies as possible; returns their device addresses, valid until the
    /// next `stage` (stream order makes reuse safe: the next upload runs after the kernels
    /// that read this one).
    pub(crate) fn stage(&mut self, parts: &[&[u8]]) -> GpuResult<Vec<u64>> {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for part in parts {
            offsets.push(total);
            total += part.len().div_ceil(STAGE_ALIGN) * STAGE_ALIGN;
        }
        if self.staging.as_ref().is_none_or(|s| s.bytes() < total) {
            self.staging = Some(self.device.pool.alloc(total.max(1 << 20), &self.stream)?);
        }
        let base = self.staging.as_ref().expect("set above").ptr();
        let image: Vec<(usize, &[u8])> =
            offsets.iter().copied().zip(parts.iter().copied()).collect();
        self.upload_image(&image, total, base)?;
        Ok(offsets.iter().map(|&o| base + o as u64).collect())
    }

    /// Copies a staging image filled by [`fill_staging`] to the engine's staging buffer (its
    /// addresses valid until the next stage, asynchronously). The image's pinned buffer must
    /// outlive the copy: keep it until the stream is synchronised (its event also makes host
    /// writes wait).
    pub(crate) fn upload_staged(&mut self, staged: &mut StagedHost) -> GpuResult<Vec<u64>> {
        if self
            .staging
            .as_ref()
            .is_none_or(|s| s.bytes() < staged.total)
        {
            self.staging = Some(
                self.device
                    .pool
                    .alloc(staged.total.max(1 << 20), &self.stream)?,
            );
        }
        let base = self.staging.as_ref().expect("set above").ptr();
        staged.lease.upload(staged.total, base, &self.stream)?;
        Ok(staged.offsets.iter().map(|&o| base + o as u64).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows large enough to be split between the fill threads, and small ones, at offsets
    /// that cut parts in two: every byte of every part lands where the image has it.
    #[test]
    fn fill_windows_copy_every_part_in_place() {
        let total = 3 * PARALLEL_FILL_BYTES * fill_threads().max(2) + 12_345;
        let mut parts_data = Vec::new();
        let mut at = 0usize;
        let mut seed = 7u64;
        while at < total {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = ((seed >> 33) as usize % (3 << 20)).min(total - at);
            let gap = (seed >> 20) as usize % 4096;
            let bytes: Vec<u8> = (0..len).map(|i| (i as u64 ^ seed) as u8).collect();
            parts_data.push((at, bytes));
            at += len + gap;
        }
        let parts: Vec<(usize, &[u8])> = parts_data.iter().map(|(a, b)| (*a, &b[..])).collect();
        let mut image = vec![0u8; total];
        for &(at, bytes) in &parts {
            let end = (at + bytes.len()).min(total);
            image[at..end].copy_from_slice(&bytes[..end - at]);
        }
        for window in [total, 2 * PARALLEL_FILL_BYTES + 1, 1000] {
            let mut start = 0;
            while start < total {
                let end = (start + window).min(total);
                let mut got = vec![0u8; end - start];
                fill_window(&mut got, start, &parts);
                assert!(got == image[start..end], "window {window} at {start}");
                start = end;
            }
        }
    }

    /// A panic in a piece of fill work is raised to the caller once every piece is done.
    #[test]
    fn a_panicking_fill_is_raised_after_all_pieces() {
        let done = std::sync::atomic::AtomicUsize::new(0);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            on_fill_threads((0..8).collect(), |i: usize| {
                std::thread::sleep(std::time::Duration::from_millis(5));
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert!(i != 5, "piece 5");
            })
        }));
        assert!(caught.is_err());
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 8);
    }
}
