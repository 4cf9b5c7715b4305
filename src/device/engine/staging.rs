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
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(window.len() / PARALLEL_FILL_BYTES);
    if threads <= 1 {
        return copy(window, start);
    }
    let piece = window.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (i, part) in window.chunks_mut(piece).enumerate() {
            scope.spawn(move || copy(part, start + i * piece));
        }
    });
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
