//! SampleSelect: levels of sampled thresholds and filters chained on the device, their
//! survivors sorted on the device's count, and the read-back that completes the chain.

use super::*;

impl TopKEngine {
    /// SampleSelect (sample.cu): levels of a sampled threshold and a filtering pass, each
    /// shrinking the pairs that hold the k smallest, then a sort of the survivors: the rank sort
    /// when they are few, else the chunk rank or merge sort (or, after a read-back, a sort or a
    /// radix select when they are many times k).
    /// The first level's filter reads only the keys when the input is positional. The host
    /// plans the chain from expected sizes and enqueues it without waiting. For k ≤ the rank
    /// sort's capacity, or a last level of at most [`chunk_rank_max`] pairs (the chunk rank
    /// sort) or [`MERGE_SORT_MAX`] (the merge sort, truncated at k), the whole selection is
    /// enqueued and the returned run is pending: its status and counts are read once, by
    /// [`finish`](Self::finish), after the kernels. Otherwise the survivor count plans their
    /// sort, after a read-back (`sample_complete`). `None` when the sample cannot shrink the
    /// input.
    ///
    /// With `input_count` (a device address), the input's size is the u64 there, known only to the
    /// device, and `n` is its bound (the buffer's capacity): the levels are planned for `n`
    /// pairs (their survivors only shrink with fewer) and read the actual count, and a count
    /// above `n` sets the overflow status.
    pub(super) fn sample_enqueue(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
        input_count: Option<u64>,
    ) -> GpuResult<Option<SampleRun>> {
        let s_max = sample_size(self.kind);
        let small = self.small_sort_capacity();
        let plan = plan_sample_levels(n, k, s_max, small);
        if plan.is_empty() {
            return Ok(None);
        }
        // Per level: its survivor count (u64); then the status word (u32).
        let ctl = self.device.pool.alloc(SAMPLE_SCRATCH_BYTES, &self.stream)?;
        let mut run = SampleRun {
            n,
            k,
            id_bound: input.id_bound(n),
            plan,
            ctl,
            levels: Vec::new(),
            sorted_small: None,
            phases: Vec::new(),
            timer: (self.device.options.trace)
                .then(|| GpuTimer::start(&self.stream))
                .transpose()?,
        };
        self.memset_zero(run.ctl.ptr(), SAMPLE_SCRATCH_BYTES)?;
        for level in 0..run.plan.len() {
            self.sample_level(&mut run, input, input_count, level)?;
        }
        self.sample_sort_survivors(&mut run, small)?;
        Ok(Some(run))
    }

    /// Enqueues level `level` of `run`'s plan: its sampled threshold (sample.cu
    /// `sample_threshold`) over the previous level's survivors (the input's, at level 0) and
    /// the filtering pass that appends the pairs below it to the level's new buffer.
    fn sample_level(
        &mut self,
        run: &mut SampleRun,
        input: &DevicePairs,
        input_count: Option<u64>,
        level: usize,
    ) -> GpuResult<()> {
        let (n, k) = (run.n, run.k);
        let status = run.ctl.ptr() + SAMPLE_STATUS_OFFSET;
        let thr = self.scalars.ptr() + THRESHOLD_OFFSET;
        let SampleLevel { cap, s } = run.plan[level];
        let out = self.alloc_pairs(cap)?;
        let count = run.ctl.ptr() + 8 * level as u64;
        let (src_keys, src_ids, src_n, src_count, src_cap) = match run.levels.last() {
            None => (
                input.key_at(0),
                if input.positional { 0 } else { input.id_at(0) },
                if input_count.is_some() { 0 } else { n },
                input_count.unwrap_or(0),
                n,
            ),
            Some(prev) => (prev.key_at(0), prev.id_at(0), 0, count - 8, prev.capacity()),
        };
        self.launch(
            &self.kernel("sample_threshold"),
            1,
            SAMPLE_THREADS,
            0,
            args![
                src_keys,
                src_ids,
                src_n,
                src_count,
                src_cap,
                k,
                s as u32,
                SAMPLE_SEED ^ level as u64,
                thr,
                status
            ],
        )?;
        run.lap(format!("threshold {level} (s={s})"), &self.stream)?;
        if level == 0 && input.positional && input_count.is_none() {
            // Keys only, vector loads: the pass that should run at the read floor.
            self.launch_resident(
                "filter_below",
                args![
                    input.key_at(0),
                    n,
                    thr,
                    out.key_at(0),
                    out.id_at(0),
                    count,
                    out.capacity(),
                ],
            )?;
        } else {
            self.launch(
                &self.kernel("filter_pairs"),
                self.grid_for(src_cap, 4),
                THREADS,
                0,
                args![
                    src_keys,
                    src_ids,
                    src_n,
                    src_count,
                    thr,
                    out.key_at(0),
                    out.id_at(0),
                    count,
                    out.capacity(),
                    status
                ],
            )?;
        }
        run.lap(format!("filter {level}"), &self.stream)?;
        run.levels.push(out);
        Ok(())
    }

    /// Enqueues the sort of the last level's survivors on their device count where one takes
    /// them whole (the rank sort for k up to `small`, the chunk rank sort, or the merge sort),
    /// into `run.sorted_small`; else leaves them for a sort after the read-back.
    fn sample_sort_survivors(&mut self, run: &mut SampleRun, small: usize) -> GpuResult<()> {
        let k = run.k;
        let last = run.levels.last().expect("a planned level");
        let last_count = run.ctl.ptr() + 8 * (run.levels.len() - 1) as u64;
        if k <= small {
            // Small k: the rank sort of the last level, enqueued before looking at the counts;
            // its grid sized to the level's buffer (more survivors overflow the level).
            let cap = small.min(last.capacity().next_multiple_of(RANK_THREADS as usize));
            let out = self.alloc_pairs(cap)?;
            self.launch_rank_sort(last, last_count, cap, &out, run.ctl.ptr())?;
            run.lap("rank sort".into(), &self.stream)?;
            run.sorted_small = Some(SortedPairs::ready(out));
        } else if last.capacity() <= chunk_rank_max(self.kind) {
            // Larger k, survivors few enough for the chunk rank sort: also enqueued whole.
            let out = self.chunk_rank_sort(
                last,
                last_count,
                last.capacity(),
                run.ctl.ptr() + SAMPLE_STATUS_OFFSET,
            )?;
            run.lap("chunk rank sort".into(), &self.stream)?;
            run.sorted_small = Some(SortedPairs::ready(out));
        } else if last.capacity() <= MERGE_SORT_MAX {
            // More survivors: the merge sort, truncated at k, on the device's count (faster
            // here than the radix sort, which needs the row ids' digits too:
            // benches/PERFORMANCE.md).
            let status = run.ctl.ptr() + SAMPLE_STATUS_OFFSET;
            let out = self.merge_sort(last, 0, last_count, last.capacity(), k, status)?;
            run.lap("merge sort".into(), &self.stream)?;
            run.sorted_small = Some(out);
        }
        Ok(())
    }

    /// Pairs `[0, n)` (n ≤ [`RANK_SORT_MAX`]) sorted by the one-launch rank sort (bitonic.cu
    /// `rank_sort`), at the start of a new buffer.
    pub(super) fn rank_sort(&self, input: &DevicePairs, n: usize) -> GpuResult<DevicePairs> {
        debug_assert!(n <= RANK_SORT_MAX);
        let ctl = self.device.pool.alloc(SAMPLE_SCRATCH_BYTES, &self.stream)?;
        self.memset_zero(ctl.ptr(), SAMPLE_SCRATCH_BYTES)?;
        // The kernel reads the count from the device (a level's survivor count, elsewhere): a
        // memset writes it, where a copy from host memory would cost the host tens of µs.
        self.set_u32(ctl.ptr(), n as u32)?;
        // A grid of (n / 256)² blocks, each ranking a 256-pair row against a column chunk it
        // sorts: sized to n rather than to the rank sort's capacity.
        let small = n.max(1).next_multiple_of(RANK_THREADS as usize);
        let out = self.alloc_pairs(small)?;
        self.launch_rank_sort(input, ctl.ptr(), small, &out, ctl.ptr())?;
        Ok(out)
    }

    /// Launches bitonic.cu `rank_sort`: the pairs of `input` (their count, at most `cap`, a
    /// u64 at device address `count`) sorted into `out`, over a grid of (cap / 256)² blocks;
    /// `ctl` is a zeroed sample control block (status, ranks, row counters).
    pub(super) fn launch_rank_sort(
        &self,
        input: &DevicePairs,
        count: u64,
        cap: usize,
        out: &DevicePairs,
        ctl: u64,
    ) -> GpuResult<()> {
        let rows = cap / RANK_THREADS as usize;
        self.launch(
            &self.kernel("bitonic_rank_sort"),
            (rows * rows) as u32,
            RANK_THREADS,
            0,
            args![
                input.key_at(0),
                input.id_at(0),
                count,
                cap,
                out.key_at(0),
                out.id_at(0),
                ctl + SAMPLE_STATUS_OFFSET,
                ctl + SAMPLE_RANKS_OFFSET,
                ctl + SAMPLE_ROW_DONE_OFFSET
            ],
        )
    }

    /// Reads an enqueued sampled selection's counts and status back (one round trip) and
    /// completes it: the rank-sorted pairs, or the sort of the survivors when the rank sort did
    /// not take them (large k, or more survivors than it holds), with whether that sort ran
    /// after the read-back. `None` when the estimate missed (a buffer overflowed, or fewer than
    /// k pairs survived): the caller then runs radix select.
    pub(super) fn sample_complete(
        &mut self,
        mut run: SampleRun,
    ) -> GpuResult<Option<(DevicePairs, bool)>> {
        let bytes = self.read_bytes(run.ctl.ptr(), SAMPLE_CTL_BYTES)?;
        run.lap("read back".into(), &self.stream)?;
        self.sample_complete_read(run, &bytes)
    }

    /// [`sample_complete`](Self::sample_complete) with the control block already read back
    /// (`bytes`, its first `SAMPLE_CTL_BYTES`).
    pub(super) fn sample_complete_read(
        &mut self,
        mut run: SampleRun,
        bytes: &[u8],
    ) -> GpuResult<Option<(DevicePairs, bool)>> {
        let (n, k) = (run.n, run.k);
        let word = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let counts: Vec<u64> = (0..run.levels.len()).map(|l| word(8 * l)).collect();
        let status = u32::from_le_bytes(
            bytes[SAMPLE_STATUS_OFFSET as usize..SAMPLE_STATUS_OFFSET as usize + 4]
                .try_into()
                .expect("4 bytes"),
        );
        let survivors = *counts.last().expect("a level") as usize;
        let trace = |what: &str, run: &SampleRun| {
            if !run.phases.is_empty() {
                eprintln!(
                    "sample_select n={n} k={k} plan={:?} counts={counts:?} status={status} \
                     {what}: {:?} ms",
                    run.plan, run.phases
                );
            }
        };
        if status & !SAMPLE_STATUS_FINAL_LARGE != 0 || survivors < k.min(n) {
            trace("missed", &run);
            return Ok(None);
        }
        if let Some(out) = run
            .sorted_small
            .take()
            .filter(|_| status & SAMPLE_STATUS_FINAL_LARGE == 0)
        {
            trace("done", &run);
            return Ok(Some((out.into_pairs(survivors), false)));
        }
        // Larger k (or more survivors than the rank sort takes): sort the survivors when that
        // sorts no more (padded) pairs than sorting k would, or when they are few enough that
        // the ~26 launches of a radix select cost more than a larger sort; else radix-select k
        // of them first.
        let last = run.levels.last().expect("a planned level");
        let id_bound = run.id_bound;
        let sorted = if survivors <= DIRECT_SORT_FACTOR * k.max(DIRECT_SORT_MIN) {
            self.sort_pairs(last, survivors, id_bound)?
        } else {
            self.select_sorted(last, survivors, k, DeviceAlgorithm::Radix)?
                .0
        };
        run.lap("select survivors".into(), &self.stream)?;
        trace("done", &run);
        Ok(Some((sorted, true)))
    }

    /// The most pairs [`sample_select`](Self::sample_select) rank-sorts at the end.
    pub(super) fn small_sort_capacity(&self) -> usize {
        RANK_SORT_MAX
    }
}

/// A sampled selection enqueued on the device (`sample_enqueue`): its plan, its control block
/// (counts, status, rank-sort scratch) and its buffers, kept until it is read back.
#[derive(Debug)]
pub(super) struct SampleRun {
    pub(super) n: usize,
    pub(super) k: usize,
    /// The input's bound on its row ids ([`DevicePairs::id_bound`]).
    pub(super) id_bound: u64,
    pub(super) plan: Vec<SampleLevel>,
    pub(super) ctl: PooledBuffer,
    pub(super) levels: Vec<DevicePairs>,
    /// The sorted survivors, when a sort that reads their count on the device took them (the
    /// rank sort for small k, the chunk rank sort for few survivors, else the merge sort).
    pub(super) sorted_small: Option<SortedPairs>,
    /// `GPU_TOPK_TRACE`: each phase's device time (synchronising after each).
    pub(super) phases: Vec<(String, f32)>,
    pub(super) timer: Option<GpuTimer>,
}

impl SampleRun {
    fn lap(&mut self, name: String, stream: &Arc<CudaStream>) -> GpuResult<()> {
        if let Some(t) = self.timer.take() {
            self.phases.push((name, t.stop()?));
            self.timer = Some(GpuTimer::start(stream)?);
        }
        Ok(())
    }
}
