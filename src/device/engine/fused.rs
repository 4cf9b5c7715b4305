//! The generated program's passes ([`crate::fusion`]): its append pass over host-shipped
//! batches, and over device-resident columns the fused selection, whose strided sample sets
//! the threshold of its full pass (SampleSelect with the predicate and keys inside the pass).

use super::*;
use crate::device::plan;

impl TopKEngine {
    /// Runs a generated kernel ([`crate::fusion`]) over `n` rows whose input buffers are
    /// described by `inputs` (four values per kernel input: values address, value bit offset,
    /// validity address or 0, validity bit offset; see the generated signature), with row ids
    /// `id_start + i`. Rows passing the predicate and beating the threshold are appended to
    /// `candidates` (the count keeps growing past its capacity: the caller checks). `out`
    /// receives the number of rows that passed (u64), an error flag (u32 at byte 8) and, from
    /// byte 16, one bit per row appended; the caller zeroes its first 16 bytes.
    pub(crate) fn fused_append(
        &self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        n: usize,
        id_start: u64,
        candidates: &DevicePairs,
        out: u64,
    ) -> GpuResult<()> {
        let count = self.scalars.ptr() + COUNT_OFFSET;
        self.fused_pass(
            kernel, inputs, n, 1, id_start, candidates, count, out, true, 0,
        )
    }

    /// [`fused_append`](Self::fused_append) over the rows `i · step` (`i < rows / step`
    /// rounded up; step > 1: a strided sample), counting the appended rows at `count` (u64);
    /// with `span` (not 0) the appended keys' span words are ORed there (candidates.cu
    /// `key_span`'s words, from the pass's own flushes: no second read of the candidates).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_pass(
        &self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
        step: usize,
        id_start: u64,
        candidates: &DevicePairs,
        count: u64,
        out: u64,
        kept_bits: bool,
        span: u64,
    ) -> GpuResult<()> {
        let n = rows.div_ceil(step.max(1));
        if n == 0 {
            return Ok(());
        }
        let base = self.scalars.ptr();
        let mut args: Vec<Arg> = inputs.iter().map(|&v| Arg::U64(v)).collect();
        args.extend_from_slice(args![
            n,
            step.max(1),
            id_start,
            base + THRESHOLD_OFFSET,
            candidates.key_at(0),
            candidates.id_at(0),
            count,
            candidates.capacity(),
            out,
            out + 8,
            if kept_bits { out + 16 } else { 0 },
            span,
        ]);
        // One wave of resident blocks: a second, partial wave leaves SMs short of loads in
        // flight at the pass's end (the generated kernels' registers allow 4–5 blocks a SM).
        let one_wave = (kernel.blocks_per_sm as usize * self.device.sm_count) as u32;
        // A thread takes one row of a strided sample per round, 4 or more of the full pass.
        let grid = self.grid_for(n, if step > 1 { 1 } else { 4 }).min(one_wave);
        self.launch_function(
            &kernel.function,
            crate::device::kernels::GENERATED_ENTRY,
            grid,
            GENERATED_THREADS,
            0,
            &args,
        )
    }

    /// Top-k of a generated program over `rows` device-resident rows (ids 0..rows): the
    /// min(k, rows passing) best (key, row id) pairs, sorted, at the start of the returned
    /// buffer, and how the selection went.
    ///
    /// With `sample_rows` > 0 (the fused selection; [`FUSED_SAMPLE_ROWS`] by default), the
    /// program's own pass is the first pass of a sampled selection (SampleSelect): the program
    /// runs on a strided sample of about that many rows, the sample's r-th best passing pair
    /// becomes the threshold (r chosen so that about k · (1 + 4/√(k/step)) rows of the whole
    /// input beat it; selected on the device by sample.cu's one-block threshold; for k beyond
    /// the rank sort where the candidates it leaves might not fit the packed sort's one wave,
    /// refined by a denser sample of the rows below it, see `FUSED_REFINE`),
    /// and the full pass appends only the rows that beat it, so filtered rows and losing keys
    /// never reach device memory. For k up to the rank sort the final selection of the
    /// candidates is enqueued on their count on the device (a sampled selection), so the whole
    /// chain runs with one read-back at its end; beyond, the read-back brings the count and
    /// the key bits that vary among the candidates (ORed by the pass as it appends them), and
    /// the candidates are sorted whole, packed into 64-bit words where those bits and the row id
    /// fit one (`merge_sort_packed`); the packed tile sort is enqueued before that read-back,
    /// finding the count and the bits on the device, and the read-back goes on the engine's
    /// side stream, so that the host's round trip hides behind the tile sort.
    /// The estimate is checked, not trusted: fewer than k appended rows while more passed, or
    /// more than the buffer holds, reruns the full pass (without the threshold, or with room
    /// for all) — exact either way. With 0 (the unfused baseline), the pass appends every
    /// passing row, and the selection follows. Returns without waiting for the device (the
    /// result's reader waits); [`fused_phases_ms`](Self::fused_phases_ms) times the phases.
    pub(crate) fn fused_select(
        &mut self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
        sample_rows: usize,
    ) -> GpuResult<(DevicePairs, usize, FusedReport)> {
        let call = FusedCall {
            kernel,
            inputs,
            rows,
            k,
            algorithm,
        };
        let mut run = self.fused_start()?;
        let mut capacity = rows.max(1);
        if let Some(sample) = self.fused_sample_plan(&call, sample_rows)? {
            capacity = self.fused_sample_threshold(&call, &sample, &mut run)?;
        }
        let mut candidates = self.alloc_pairs(capacity)?;
        candidates.set_ids_below(rows as u64);
        loop {
            let mut pass = self.fused_full_pass(&call, &candidates, &mut run)?;
            let (passed, error, count, bytes) = self.fused_read_back(&pass, &run)?;
            run.report.passed = passed;
            run.report.error = error;
            run.report.candidates = count;
            if error != 0 {
                return Ok((candidates, 0, run.report));
            }
            if self.fused_rerun(&call, &mut candidates, passed, count, &mut run)? {
                continue;
            }
            let (sorted, m) =
                self.fused_finish(&call, &mut pass, &candidates, count, &bytes, &mut run)?;
            run.marks.push((3, self.fused_mark()?));
            // Not waited for here: the result stays on the device, and its reader waits.
            self.fused_marks = std::mem::take(&mut run.marks);
            return Ok((sorted, m, run.report));
        }
    }

    /// A fused selection's words, allocated and zeroed, with no threshold yet (the passes
    /// count in those words, not in the engine's count), and the mark of its start.
    fn fused_start(&mut self) -> GpuResult<FusedRun> {
        let out = self.device.pool.alloc(FUSED_WORDS, &self.stream)?;
        let marks = vec![(0, self.fused_mark()?)];
        self.memset_zero(self.scalars.ptr() + THRESHOLD_OFFSET, THRESHOLD_BYTES)?;
        self.memset_zero(out.ptr(), FUSED_WORDS)?;
        Ok(FusedRun {
            marks,
            report: FusedReport::default(),
            words: FusedWords::at(out.ptr()),
            out,
        })
    }

    /// Records an event on the engine's stream: the end of a fused selection's phase.
    fn fused_mark(&self) -> Result<cudarc::driver::CudaEvent, DriverError> {
        self.stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
    }

    /// The strided sample that sets a fused selection's threshold, and the denser sample that
    /// refines it: `None` where there is none (no sample rows, k = 0, too few rows, or a
    /// threshold rank that would not shrink the input).
    fn fused_sample_plan(
        &self,
        call: &FusedCall<'_>,
        sample_rows: usize,
    ) -> GpuResult<Option<FusedSample>> {
        let (rows, k) = (call.rows, call.k);
        // At most what sample.cu's one-block threshold holds, so that it is exact.
        let sample_rows = sample_rows.min(sample_size(self.kind));
        let step = if sample_rows > 0 {
            rows.div_ceil(sample_rows)
        } else {
            0
        };
        if !(sample_rows > 0 && k > 0 && step >= 8) {
            return Ok(None);
        }
        let rank_at = |step: usize| threshold_rank(k, step);
        // A large k's candidates are merge-sorted whole, in one wave of the packed sort's
        // tiles where they fit it (its time barely grows with them there, and doubles past
        // it). Where the rows expected to beat the sample's threshold (r · step, 2σ above:
        // σ = √r sample rows) might not fit, a denser sample (FUSED_REFINE times the rows,
        // below the threshold only) puts the threshold 4σ above k's expected rank with σ 4×
        // smaller relative to k. 250M rows: at k = 10^5 the first threshold's rows fit (the
        // denser sample would be wasted); at k = 10^6 (~1.7·k rows) they might not, and the
        // denser sample's threshold expects ~1.2·k.
        let r = rank_at(step);
        let dense_step = step / FUSED_REFINE;
        let expected_rows = r as f64 * step as f64 * (1.0 + 2.0 / (r as f64).sqrt());
        let refine_above = self.refine_above()?;
        let refine =
            plan::fused_refines(call.algorithm, k, dense_step, expected_rows, refine_above);
        // The denser sample's rank: k's expected rank in it plus 4σ.
        let dense_rank = refine.then(|| rank_at(dense_step) - 1);
        // Before a denser sample the first one only bounds it: up to 8× coarser (a cheaper
        // one-block select), as long as the denser sample expects at most a quarter of its
        // buffer below its threshold (k = 10^6 of 250M rows: 1024 rows, rank 14, ~1800 of
        // the denser sample's rows).
        let step = if refine {
            (0..=3)
                .rev()
                .map(|j| step << j)
                .find(|&s| {
                    rank_at(s) * (s / dense_step) <= sample_size(self.kind) / 4
                        && rank_at(s) < rows.div_ceil(s) / 2
                })
                .unwrap_or(step)
        } else {
            step
        };
        let r = rank_at(step);
        let sampled = rows.div_ceil(step);
        Ok((r < sampled / 2).then(|| FusedSample {
            step,
            rank: r,
            sampled,
            dense: dense_rank.map(|rank| (dense_step, rank)),
        }))
    }

    /// Runs the program's pass over the sample and sets the threshold to the sample's r-th
    /// best passing pair (refined by the denser sample where planned), all on the device.
    /// Returns the candidates' capacity: twice the rows expected to beat the threshold.
    fn fused_sample_threshold(
        &mut self,
        call: &FusedCall<'_>,
        sample: &FusedSample,
        run: &mut FusedRun,
    ) -> GpuResult<usize> {
        let FusedSample {
            step,
            rank: r,
            sampled,
            dense,
        } = *sample;
        let words = run.words;
        let sample = self.alloc_pairs(sampled)?;
        self.fused_pass(
            call.kernel,
            call.inputs,
            call.rows,
            step,
            0,
            &sample,
            words.sample_count,
            words.sample_passed,
            false,
            0,
        )?;
        run.report.sampled = sampled;
        run.marks.push((0, self.fused_mark()?));
        // Threshold := the r-th best passing sample pair (rank r - 1), selected on the
        // device from the device's count by sample.cu's one-block threshold (exact: its
        // sample is every pair); no threshold when fewer than r passed. No host round
        // trip.
        self.launch(
            &self.kernel("sample_threshold"),
            1,
            SAMPLE_THREADS,
            0,
            args![
                sample.key_at(0),
                sample.id_at(0),
                0usize,
                words.sample_count,
                sampled,
                r - 1,
                sampled as u32,
                SAMPLE_SEED,
                self.scalars.ptr() + THRESHOLD_OFFSET,
                run.out.ptr() + 48
            ],
        )?;
        if let Some((dense_step, rank)) = dense {
            self.fused_refine_threshold(call, dense_step, rank, run)?;
        }
        run.marks.push((1, self.fused_mark()?));
        // About r · step rows beat it (fewer pass, when fewer than r sample rows
        // did), or rank · dense_step after the denser sample; the buffer holds twice
        // that (a refinement that kept the coarser threshold overflows it: the pass
        // reruns with room for all).
        let expected = dense.map_or(r * step, |(dense_step, rank)| rank * dense_step);
        Ok((2 * expected).max(1 << 16).min(call.rows.max(1)))
    }

    /// Runs the program's pass over the denser sample (`dense_step`) and moves the threshold
    /// to its pair of rank `rank` below it (sample.cu `refine_threshold`).
    fn fused_refine_threshold(
        &mut self,
        call: &FusedCall<'_>,
        dense_step: usize,
        rank: usize,
        run: &mut FusedRun,
    ) -> GpuResult<()> {
        let words = run.words;
        let dense = self.alloc_pairs(sample_size(self.kind))?;
        self.fused_pass(
            call.kernel,
            call.inputs,
            call.rows,
            dense_step,
            0,
            &dense,
            words.dense_count,
            words.dense_passed,
            false,
            0,
        )?;
        // Keeps the threshold when too few, or too many, rows came below it.
        self.launch(
            &self.kernel("refine_threshold"),
            1,
            SAMPLE_THREADS,
            0,
            args![
                dense.key_at(0),
                dense.id_at(0),
                words.dense_count,
                dense.capacity(),
                rank,
                self.scalars.ptr() + THRESHOLD_OFFSET,
                run.out.ptr() + 48
            ],
        )?;
        run.report.refined = call.rows.div_ceil(dense_step);
        Ok(())
    }

    /// Runs the program's full pass into `candidates`, then enqueues what can start before
    /// the host reads its count: a large k's packed tile sort, or a sampled selection of
    /// few enough pairs.
    fn fused_full_pass(
        &mut self,
        call: &FusedCall<'_>,
        candidates: &DevicePairs,
        run: &mut FusedRun,
    ) -> GpuResult<FullPass> {
        let words = run.words;
        // For a large k every candidate is sorted: the pass also ORs the key bits that vary
        // among them (read back with its words), and the candidates are packed into 64-bit
        // words for a keys-only merge sort where those bits and the row id's fit one word
        // (see `merge_sort_packed`), else merge-sorted as pairs.
        let large = plan::fused_sorts_whole(call.algorithm, call.k, candidates.capacity());
        let span_words = 2 * self.kind.key_words();
        // The span words start zeroed with the rest of the fused words; a rerun zeroes them.
        if large && run.report.reruns > 0 {
            self.memset_zero(words.span, 8 * span_words)?;
        }
        self.fused_pass(
            call.kernel,
            call.inputs,
            call.rows,
            1,
            0,
            candidates,
            words.count,
            words.passed,
            false,
            if large { words.span } else { 0 },
        )?;
        run.marks.push((2, self.fused_mark()?));
        // A large k's packed tile sort runs while the host reads the count and the key span
        // back on the side stream (the tile sort finds both on the device); the host then
        // enqueues its rounds behind it.
        let early_tiles = if large {
            Some(self.packed_tiles_on_device(
                candidates,
                (words.count, candidates.capacity()),
                words.span,
                id_bits(call.rows as u64),
            )?)
        } else {
            None
        };
        // A sampled selection of few enough pairs is enqueued on the device's count before
        // the host knows it; its control block then brings the pass's words back with its
        // own, in one read-back.
        let pending = if !large
            && call.algorithm == DeviceAlgorithm::Sample
            && plan::sample_sorts_on_device(self.kind, candidates.capacity(), call.k)
        {
            self.sample_enqueue(candidates, candidates.capacity(), call.k, Some(words.count))?
                .filter(|run| run.sorted_small.is_some())
        } else {
            None
        };
        Ok(FullPass {
            large,
            span_words,
            early_tiles,
            pending,
        })
    }

    /// Reads the full pass's words back: rows passed, error flags and rows appended, with the
    /// whole read-back (the sampled selection's control block, or the key span for a large k).
    fn fused_read_back(
        &mut self,
        pass: &FullPass,
        run: &FusedRun,
    ) -> GpuResult<(u64, u32, usize, Vec<u8>)> {
        let out = &run.out;
        match &pass.pending {
            Some(sample) => {
                self.copy_dtod(sample.ctl.ptr() + SAMPLE_CALLER_OFFSET, out.ptr(), 24)?;
                let b = self.read_bytes(sample.ctl.ptr(), SAMPLE_CTL_BYTES)?;
                let at = SAMPLE_CALLER_OFFSET as usize;
                let (passed, error, count) = parse_fused_words(&b[at..at + 24]);
                Ok((passed, error, count, b))
            }
            None => {
                let len = if pass.large {
                    FUSED_SPAN_OFFSET as usize + 8 * pass.span_words
                } else {
                    24
                };
                let b = if pass.early_tiles.is_some() {
                    let after = &run.marks.last().expect("the pass's mark").1;
                    self.read_bytes_after(after, out.ptr(), len)?
                } else {
                    self.read_bytes(out.ptr(), len)?
                };
                let (passed, error, count) = parse_fused_words(&b);
                Ok((passed, error, count, b))
            }
        }
    }

    /// Whether the full pass must run again because the sampled threshold missed, with the
    /// words zeroed and the candidates' buffer made large enough for it.
    fn fused_rerun(
        &mut self,
        call: &FusedCall<'_>,
        candidates: &mut DevicePairs,
        passed: u64,
        count: usize,
        run: &mut FusedRun,
    ) -> GpuResult<bool> {
        if count < call.k && (count as u64) < passed {
            // The threshold was too tight: every passing row is a candidate.
            run.report.reruns += 1;
            self.reset_candidates()?;
            self.memset_zero(run.out.ptr(), 24)?;
            if candidates.capacity() < passed as usize {
                *candidates = self.alloc_pairs(passed as usize)?;
                candidates.set_ids_below(call.rows as u64);
            }
            return Ok(true);
        }
        if count > candidates.capacity() {
            // The estimate was too loose for the buffer: room for all, same threshold.
            run.report.reruns += 1;
            self.memset_zero(run.out.ptr(), 24)?;
            *candidates = self.alloc_pairs(count)?;
            candidates.set_ids_below(call.rows as u64);
            return Ok(true);
        }
        Ok(false)
    }

    /// The final selection of the `count` candidates: a large k's whole sort, the enqueued
    /// sampled selection completed from its control block (`bytes`), or else a selection
    /// after the read-back.
    fn fused_finish(
        &mut self,
        call: &FusedCall<'_>,
        pass: &mut FullPass,
        candidates: &DevicePairs,
        count: usize,
        bytes: &[u8],
        run: &mut FusedRun,
    ) -> GpuResult<(DevicePairs, usize)> {
        let selected = if pass.large {
            Some(self.fused_sort_whole(call, pass, candidates, count, bytes, run)?)
        } else if let Some(mut sample) = pass.pending.take() {
            // Planned for the buffer's capacity; the count decides what is complete.
            sample.n = count;
            self.sample_complete_read(sample, bytes)?
                .map(|(sorted, _)| (sorted, count.min(call.k)))
        } else {
            None
        };
        match selected {
            Some(done) => Ok(done),
            None => self.select_sorted(candidates, count, call.k, call.algorithm),
        }
    }

    /// A large k's `count` candidates sorted whole: packed into 64-bit words by the key span
    /// read back in `bytes` (rounds behind the early tile sort, where it ran), else
    /// merge-sorted as pairs.
    fn fused_sort_whole(
        &self,
        call: &FusedCall<'_>,
        pass: &FullPass,
        candidates: &DevicePairs,
        count: usize,
        bytes: &[u8],
        run: &mut FusedRun,
    ) -> GpuResult<(DevicePairs, usize)> {
        let (k, span_at) = (call.k, run.words.span);
        let at = FUSED_SPAN_OFFSET as usize;
        let span = &bytes[at..at + 8 * pass.span_words];
        let m = count.min(k);
        match packed_sort_field(self.kind, span, call.rows as u64, count) {
            Some(field @ (_, width, id_bits)) => {
                run.report.packed_bits = width + id_bits;
                let sorted = match &pass.early_tiles {
                    Some(bufs) => self.packed_rounds(bufs, count, k, field, span_at)?,
                    None => self.merge_sort_packed(candidates, count, k, field, span_at)?,
                };
                Ok((sorted, m))
            }
            None => {
                let sorted = self.merge_sort(candidates, count, 0, count, k, 0)?;
                Ok((sorted.into_pairs(count), m))
            }
        }
    }

    /// The rows of a generated program over `rows` device-resident rows (ids 0..rows) whose
    /// keys are at most the key of `sorted`'s pair `at`, those equal to it included whatever
    /// their row ids. After a selection over a prefix layout's composite (monotone, not exact)
    /// that pair is the k-th: the rows it returns hold every winner, and only those tying its
    /// key need more than their composite to be ranked. One more pass of the program, with
    /// that key as its threshold. Returns their row ids (in no order) and how many rows besides
    /// the k-th have its key; `None` where they are more than `limit`: the pass counts them
    /// before any is read back, so a tie too large for the caller to rank costs one pass.
    pub(crate) fn fused_ties(
        &mut self,
        kernel: &GeneratedKernel,
        inputs: &[u64],
        rows: usize,
        sorted: &DevicePairs,
        at: usize,
        limit: usize,
    ) -> GpuResult<Option<(Vec<u64>, usize)>> {
        let key_bytes = self.kind.key_bytes();
        // `Threshold<K>`: the key, the u64 id (8-aligned), the u32 `valid` flag. An id above
        // every row's admits the key's ties.
        let threshold = self.scalars.ptr() + THRESHOLD_OFFSET;
        let id_at = key_bytes.max(8) as u64;
        self.memset_zero(threshold, THRESHOLD_BYTES)?;
        self.copy_dtod(threshold, sorted.key_at(at), key_bytes)?;
        self.write_u64(threshold + id_at, u64::MAX)?;
        self.set_u32(threshold + id_at + 8, 1)?;
        let boundary = self.read_bytes(sorted.key_at(at), key_bytes)?;
        // Rows passed (u64), error flags (u32), rows appended (u64 at 16).
        let out = self.device.pool.alloc(24, &self.stream)?;
        let mut capacity = (2 * (at + 1)).max(1 << 12).min(rows.max(1));
        loop {
            self.memset_zero(out.ptr(), 24)?;
            let candidates = self.alloc_pairs(capacity)?;
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
            let count = u64::from_le_bytes(words[16..24].try_into().expect("8 bytes")) as usize;
            if count > limit {
                return Ok(None);
            }
            if count > capacity {
                // More ties than room: again, with room for all.
                capacity = count;
                continue;
            }
            let ids = self.download_ids(&candidates, count)?;
            let keys = self.download_keys(&candidates, count)?;
            let tied = (keys.chunks_exact(key_bytes))
                .filter(|key| *key == boundary.as_slice())
                .count();
            return Ok(Some((ids, tied.saturating_sub(1))));
        }
    }

    /// Sets the expected candidate count above which a fused selection at large k refines
    /// its sampled threshold by the denser sample (`None`: the default, the packed sort's one
    /// wave of tiles; `Some(0)`: wherever k is beyond the rank sort and the rows allow it, as
    /// tests of the refinement want at sizes where it would not pay).
    pub fn set_refine_above(&mut self, candidates: Option<usize>) {
        self.refine_above = candidates;
    }

    fn refine_above(&self) -> GpuResult<usize> {
        match self.refine_above {
            Some(candidates) => Ok(candidates),
            None => self.packed_sort_wave(),
        }
    }

    /// Device time (ms, CUDA events; host waits in between included) of each phase of the last
    /// [`fused_select`](Self::fused_select): the sample pass, the sample's threshold, the full
    /// pass(es), the final selection (with the read-back, and a rerun's). Waits for its end.
    pub fn fused_phases_ms(&self) -> GpuResult<[f64; 4]> {
        let mut phases = [0.0; 4];
        if let Some((_, last)) = self.fused_marks.last() {
            last.synchronize()?;
        }
        for pair in self.fused_marks.windows(2) {
            phases[pair[1].0] += f64::from(pair[0].1.elapsed_ms(&pair[1].1)?);
        }
        Ok(phases)
    }
}

/// The packed merge sort's field for m pairs with row ids below `id_bound`, `(lo, width,
/// id_bits)`, from candidates.cu `key_span`'s words as read back (little-endian bytes): `None`
/// where [`packed_field`] has none, or m is a merge tile or less (no round would unpack them).
pub(super) fn packed_sort_field(
    kind: KeyWidth,
    span_bytes: &[u8],
    id_bound: u64,
    m: usize,
) -> Option<(u32, u32, u32)> {
    let span: Vec<u64> = span_bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    let id_bits = id_bits(id_bound);
    let (lo, width) = packed_field(kind, &span, id_bits)?;
    (m > merge_sort_tile(KeyWidth::W64)).then_some((lo, width, id_bits))
}

/// A fused selection's call: the generated program, its inputs and rows, and what it selects.
#[derive(Clone, Copy)]
struct FusedCall<'a> {
    kernel: &'a GeneratedKernel,
    inputs: &'a [u64],
    rows: usize,
    k: usize,
    algorithm: DeviceAlgorithm,
}

/// A fused selection under way: the events marking its phases' ends (phase, event), how it
/// is going, and its words on the device (`FUSED_WORDS` bytes, see [`FusedWords`]).
struct FusedRun {
    marks: Vec<(usize, cudarc::driver::CudaEvent)>,
    report: FusedReport,
    words: FusedWords,
    out: PooledBuffer,
}

/// The addresses of a fused selection's words. The full pass's: rows passed (u64), error
/// flags (u32), rows appended (u64 at 16); then the sample pass's, the sample threshold's
/// status (u32 at 48), the denser sample pass's (at 56), and the key span's words.
#[derive(Clone, Copy)]
struct FusedWords {
    passed: u64,
    count: u64,
    sample_passed: u64,
    sample_count: u64,
    dense_passed: u64,
    dense_count: u64,
    span: u64,
}

impl FusedWords {
    /// The words of a buffer at device address `base`.
    fn at(base: u64) -> Self {
        Self {
            passed: base,
            count: base + 16,
            sample_passed: base + 24,
            sample_count: base + 40,
            dense_passed: base + 56,
            dense_count: base + 72,
            span: base + FUSED_SPAN_OFFSET,
        }
    }
}

/// Where a fused selection's sample puts the threshold: the sample's step, the threshold's
/// rank in it and its rows, and the denser sample's step and rank where it refines it.
#[derive(Clone, Copy)]
struct FusedSample {
    step: usize,
    rank: usize,
    sampled: usize,
    dense: Option<(usize, usize)>,
}

/// A full pass as enqueued: whether its candidates are sorted whole (a large k), the key
/// span's words, and what was enqueued behind it before the read-back.
struct FullPass {
    large: bool,
    span_words: usize,
    /// A large k's packed tile sort: its two word buffers.
    early_tiles: Option<[PooledBuffer; 2]>,
    /// A sampled selection enqueued on the pass's count.
    pending: Option<SampleRun>,
}

/// Sample rank of the threshold at a step: k's expected rank in the sample plus 4σ.
fn threshold_rank(k: usize, step: usize) -> usize {
    let expected = k as f64 / step as f64;
    (expected + 4.0 * expected.sqrt()).ceil() as usize + 1
}

/// A pass's words as read back: rows passed (u64), error flags (u32 at 8) and rows appended
/// (u64 at 16).
fn parse_fused_words(b: &[u8]) -> (u64, u32, usize) {
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    (word(0), word(8) as u32, word(16) as usize)
}

/// How a [`TopKEngine::fused_select`] went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FusedReport {
    /// Rows that passed the predicate.
    pub passed: u64,
    /// The program's error flags ([`crate::fusion::ERROR_NULL_KEY`] and co.); when not 0 the
    /// selection stopped and its result is empty.
    pub error: u32,
    /// Rows of the sample pass (0: no sample).
    pub sampled: usize,
    /// Rows of the denser sample that refined its threshold (0: none).
    pub refined: usize,
    /// Rows the (last) full pass appended.
    pub candidates: usize,
    /// Full passes repeated because the sampled threshold missed.
    pub reruns: usize,
    /// Bits of the 64-bit words a large k's candidates were packed into for their keys-only
    /// merge sort (the key bits that vary, then the row id's); 0 when they were not packed.
    pub packed_bits: u32,
    /// A per-group selection's device time in ms (CUDA events): the pass, the sort with the
    /// groups' limits, and the walk with the read-back of what it kept.
    pub group_phases_ms: [f32; 3],
    /// A per-group selection's rows kept.
    pub kept: usize,
}
