//! Top-k per group on the device (groups.cu): the generated program's pass appends every
//! passing row's (composite key, row id), the pairs are sorted, and each group's first pair
//! keeps its group's best rows, with their ranks, in the pairs' order.

use super::*;

/// Threads of a block of groups.cu's keyed kernels (`GROUP_THREADS`).
const GROUP_THREADS: usize = 256;
/// Threads of its one-block scan (`GROUP_SCAN_THREADS`).
const GROUP_SCAN_THREADS: u32 = 1024;

/// The ranking function of a per-group selection, numbered as groups.cu takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRanking {
    /// The first k rows of a group.
    RowNumber = 0,
    /// The rows of rank at most k (peers share a rank; ranks skip after peers).
    Rank = 1,
    /// The rows of the k smallest distinct keys.
    DenseRank = 2,
}

/// What a per-group selection kept: row ids in (group, order keys, row id) order, each with
/// its rank in its group.
#[derive(Debug, Default)]
pub struct GroupsKept {
    pub ids: Vec<u64>,
    pub ranks: Vec<u64>,
    pub report: FusedReport,
}

impl TopKEngine {
    /// Top `k` of every group over `rows` device-resident rows of a generated program (row ids
    /// 0..rows; `inputs` as for [`fused_append`](Self::fused_append)) whose composite keys hold
    /// the group keys from bit `lo` up. With the program's error flags set the result is empty
    /// (the caller raises the error).
    pub(crate) fn fused_groups(
        &mut self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
        lo: u32,
        ranking: GroupRanking,
        k: usize,
    ) -> GpuResult<GroupsKept> {
        let mut kept = GroupsKept::default();
        // Rows passed (u64), error flags (u32 at 8), rows appended (u64 at 16).
        let out = self.device.pool.alloc(24, &self.stream)?;
        self.memset_zero(self.scalars.ptr() + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        self.memset_zero(out.ptr(), 24)?;
        let mut candidates = self.alloc_pairs(rows.max(1))?;
        candidates.set_ids_below(rows as u64);
        self.fused_pass(
            kernel,
            inputs,
            rows,
            1,
            0,
            &candidates,
            out.ptr() + 16,
            out.ptr(),
            false,
            0,
        )?;
        let words = self.read_bytes(out.ptr(), 24)?;
        let word = |at: usize| u64::from_le_bytes(words[at..at + 8].try_into().expect("8 bytes"));
        kept.report.passed = word(0);
        kept.report.error = word(8) as u32;
        let m = word(16) as usize;
        kept.report.candidates = m;
        if kept.report.error != 0 || m == 0 || k == 0 {
            return Ok(kept);
        }
        if m > candidates.capacity() {
            return Err(GpuError(format!(
                "the program appended {m} rows of a table of {rows}"
            )));
        }
        let sorted = self.sort_pairs(&candidates, m, rows as u64)?;
        drop(candidates);
        let blocks = m.div_ceil(GROUP_THREADS);
        // The block sums, then the total.
        let sums = self.device.pool.alloc(8 * (blocks + 1), &self.stream)?;
        let total_at = sums.ptr() + 8 * blocks as u64;
        let (keys, ids) = (sorted.key_at(0), sorted.id_at(0));
        let (function, k) = (ranking as u32, k as u64);
        self.launch(
            &self.kernel("group_count"),
            blocks as u32,
            GROUP_THREADS as u32,
            0,
            args![keys, ids, m, lo, function, k, sums.ptr()],
        )?;
        self.launch(
            "group_scan",
            1,
            GROUP_SCAN_THREADS,
            0,
            args![sums.ptr(), blocks, total_at],
        )?;
        let total = self.read_bytes(total_at, 8)?;
        let total = u64::from_le_bytes(total[..8].try_into().expect("8 bytes")) as usize;
        if total == 0 {
            return Ok(kept);
        }
        let out_ids = self.device.pool.alloc(8 * total, &self.stream)?;
        let out_ranks = self.device.pool.alloc(8 * total, &self.stream)?;
        self.launch(
            &self.kernel("group_write"),
            blocks as u32,
            GROUP_THREADS as u32,
            0,
            args![
                keys,
                ids,
                m,
                lo,
                function,
                k,
                sums.ptr(),
                out_ids.ptr(),
                out_ranks.ptr()
            ],
        )?;
        let words = |bytes: Vec<u8>| -> Vec<u64> {
            (bytes.chunks_exact(8))
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        };
        kept.ids = words(self.read_bytes(out_ids.ptr(), 8 * total)?);
        kept.ranks = words(self.read_bytes(out_ranks.ptr(), 8 * total)?);
        Ok(kept)
    }
}
