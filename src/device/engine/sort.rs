//! Sorting device pairs: the one rule for m pairs ([`TopKEngine::sort_pairs`]: a register tile,
//! the chunk rank sort, the LSD radix sort or the merge sort truncated at k) and each sort.

use super::*;

impl TopKEngine {
    /// Pairs `[0, m)` sorted ascending, at the start of a new buffer: one register tile's
    /// bitonic sort when they fit one, the chunk rank sort up to [`chunk_rank_max`] pairs, else
    /// the LSD radix sort (radix_sort.cu). `id_bound` bounds the row ids (every id < it;
    /// `u64::MAX` when unknown): the radix sort skips the row id's bytes above it. A bound of 1
    /// says the ids already ascend in input order: its stable passes then take the key's
    /// digits only.
    pub(crate) fn sort_pairs(
        &self,
        input: &DevicePairs,
        m: usize,
        id_bound: u64,
    ) -> GpuResult<DevicePairs> {
        if m <= sort_tile(self.kind) || m >= RADIX_SORT_MAX {
            return self.sort(input, m);
        }
        if m <= chunk_rank_max(self.kind) {
            let count = self.device.pool.alloc(8, &self.stream)?;
            self.memset_zero(count.ptr(), 8)?;
            self.set_u32(count.ptr(), m as u32)?;
            return self.chunk_rank_sort(input, count.ptr(), m, 0);
        }
        // The radix sort when the key's digits alone sort them (ids ascending in input order:
        // 32-bit keys, and 64-bit keys over wide tiles); else the merge sort, whose rounds grow
        // with neither the key width nor the row ids.
        if merge_sorts(self.kind, m, id_bound) {
            Ok(self.merge_sort(input, m, 0, m, m, 0)?.into_pairs(m))
        } else {
            self.radix_sort(input, m, id_bound)
        }
    }

    /// Pairs `[0, c)`, c the u64 at device address `count` (c ≤ `cap`), sorted ascending at
    /// the start of a new buffer of `cap` pairs, in three launches and without a read-back
    /// (bitonic.cu `chunk_sort`, `chunk_rank`, `chunk_scatter`: tiles sorted in registers,
    /// each pair's count below it in every tile, the pair moved to their sum). `status`: a
    /// sampled selection's status word, or 0; the sort does nothing once it is set, and sets
    /// `SAMPLE_STATUS_FINAL_LARGE` when c > cap. For `cap` ≤ [`chunk_rank_max`].
    pub(super) fn chunk_rank_sort(
        &self,
        input: &DevicePairs,
        count: u64,
        cap: usize,
        status: u64,
    ) -> GpuResult<DevicePairs> {
        let tile = chunk_tile(self.kind);
        let tiles = cap.div_ceil(tile).max(1);
        debug_assert!(tiles <= CHUNK_RANK_TILES);
        let sorted_tiles = self.alloc_pairs(tiles * tile)?;
        let out = self.alloc_pairs(cap.max(1))?;
        // Per column tile, each pair's count of its pairs below it.
        let below = self
            .device
            .pool
            .alloc(4 * tiles * tiles * tile, &self.stream)?;
        let shared = tile * self.kind.pair_bytes();
        self.launch(
            &self.kernel("bitonic_chunk_sort"),
            tiles as u32,
            CHUNK_THREADS,
            shared,
            args![
                input.key_at(0),
                input.id_at(0),
                count,
                cap,
                sorted_tiles.key_at(0),
                sorted_tiles.id_at(0),
                status
            ],
        )?;
        // The rank and scatter passes both take the sorted tiles, the count and the counts below.
        let ranked = args![
            sorted_tiles.key_at(0),
            sorted_tiles.id_at(0),
            count,
            cap,
            below.ptr()
        ];
        self.launch(
            &self.kernel("bitonic_chunk_rank"),
            (tiles * tiles) as u32,
            CHUNK_THREADS,
            shared,
            &[ranked.as_slice(), args![status]].concat(),
        )?;
        self.launch(
            &self.kernel("bitonic_chunk_scatter"),
            self.grid_for(tiles * tile, 1),
            THREADS,
            0,
            &[
                ranked.as_slice(),
                args![out.key_at(0), out.id_at(0), status],
            ]
            .concat(),
        )?;
        Ok(out)
    }

    /// The merge sort (merge_sort.cu): the first min(c, k) of pairs `[0, c)` sorted at the
    /// start of one of two new buffers of `cap` pairs, where c is `m` or, with `count` (a
    /// device address, else 0), the u64 there: [`SortedPairs::into_pairs`] of c says which.
    /// Tiles sorted in shared memory, then ⌈log2(tiles)⌉ merge rounds for `cap` pairs, every
    /// merged run truncated at k; all enqueued before c is known, and the rounds past the one
    /// that leaves a single run do nothing. `status`: a sampled selection's status word (or 0),
    /// which makes the sort a no-op once set and gets `SAMPLE_STATUS_FINAL_LARGE` when
    /// c > cap. Positional inputs' row ids are not read.
    pub fn merge_sort(
        &self,
        input: &DevicePairs,
        m: usize,
        count: u64,
        cap: usize,
        k: usize,
        status: u64,
    ) -> GpuResult<SortedPairs> {
        let tile = merge_sort_tile(self.kind);
        let cap = cap.max(1);
        let rounds = cap.div_ceil(tile).next_power_of_two().trailing_zeros();
        let out = self.alloc_pairs(cap)?;
        let tmp = if rounds > 0 {
            Some(self.alloc_pairs(cap)?)
        } else {
            None
        };
        // Buffers alternate: the tiles in `out`, round r writes bufs[(r + 1) % 2].
        let bufs = [&out, tmp.as_ref().unwrap_or(&out)];
        let ids = if input.positional { 0 } else { input.id_at(0) };
        self.merge_launches(
            MergeRounds::Pairs(self.kind),
            Some((&self.kernel("msort_tiles"), args![input.key_at(0), ids])),
            (m, count, cap, k, status),
            bufs.map(|b| [b.key_at(0), b.id_at(0)]),
        )?;
        Ok(SortedPairs {
            tiles: out,
            other: tmp,
            tile,
        })
    }

    /// The first min(m, k) of pairs `[0, m)` (row ids below `id_bound`) sorted through packed
    /// words, as a fused selection sorts a large k's candidates: their key span
    /// (candidates.cu `key_span`, read back), the field of bits that vary, then
    /// `merge_sort_packed`. `None` when the field and the row ids' bits do not fit one word, or
    /// m is a merge tile or less.
    pub fn sort_pairs_packed(
        &mut self,
        input: &DevicePairs,
        m: usize,
        k: usize,
        id_bound: u64,
    ) -> GpuResult<Option<DevicePairs>> {
        let span_words = 2 * self.kind.key_words();
        // The count (u64), then the span's words.
        let words = self.device.pool.alloc(8 + 8 * span_words, &self.stream)?;
        self.memset_zero(words.ptr(), 8 + 8 * span_words)?;
        self.write_u64(words.ptr(), m as u64)?;
        self.launch(
            &self.kernel("key_span"),
            self.grid_for(m, 8),
            THREADS,
            0,
            args![input.key_at(0), words.ptr(), m, words.ptr() + 8],
        )?;
        let bytes = self.read_bytes(words.ptr() + 8, 8 * span_words)?;
        match fused::packed_sort_field(self.kind, &bytes, id_bound, m) {
            Some(field) => Ok(Some(self.merge_sort_packed(
                input,
                m,
                k,
                field,
                words.ptr() + 8,
            )?)),
            None => Ok(None),
        }
    }

    /// The first min(m, k) of pairs `[0, m)` sorted, through packed 64-bit words (common.cuh
    /// `packed_word` with `field` = (lo, width, id_bits), which must hold every pair's
    /// varying key bits and row id; `span`: candidates.cu `key_span`'s words, the bits every
    /// key shares): the merge sort's tiles pack the pairs as they load them (merge_sort.cu
    /// `msort_tiles_packed`), its rounds merge the words keys only (`msort_merge_words`: half
    /// the bytes of 64-bit keys' pairs), and the last round stores them unpacked
    /// (`msort_merge_unpack`). Takes more than a tile's pairs (m > [`merge_sort_tile`]): fewer
    /// leave no round to unpack.
    pub(super) fn merge_sort_packed(
        &self,
        input: &DevicePairs,
        m: usize,
        k: usize,
        (lo, width, id_bits): (u32, u32, u32),
        span: u64,
    ) -> GpuResult<DevicePairs> {
        let tile = merge_sort_tile(KeyWidth::W64);
        if m <= tile {
            return Err(GpuError(format!(
                "the packed merge sort takes more than a tile ({tile} pairs), not {m}"
            )));
        }
        let bufs = self.packed_buffers(m)?;
        let tiles = self.kernel("msort_tiles_packed");
        let input = args![input.key_at(0), input.id_at(0), span, lo, width, id_bits];
        self.packed_launches(
            &bufs,
            Some((&tiles, input)),
            m,
            k,
            (lo, width, id_bits),
            span,
        )
    }

    /// [`merge_sort_packed`](Self::merge_sort_packed)'s tile sort enqueued before the host knows
    /// the pair count or the field, so that it runs while the host reads them back: m from `count`
    /// on the device (nothing when above `cap`), the field from the `span` words (merge_sort.cu
    /// `device_packed_field`, the host's [`packed_field`]; nothing where it does not fit a word
    /// beside `id_bits` bits of row id), its grid of one wave at most (m ≤ `cap`; each block sorts
    /// every grid-th tile). Returns the two word buffers, the tiles sorted into the first, for
    /// [`packed_rounds`](Self::packed_rounds) once the host has m and the field.
    pub(super) fn packed_tiles_on_device(
        &self,
        input: &DevicePairs,
        (count, cap): (u64, usize),
        span: u64,
        id_bits: u32,
    ) -> GpuResult<[PooledBuffer; 2]> {
        let bufs = self.packed_buffers(cap)?;
        let field_from_span = u32::MAX; // merge_sort.cu FIELD_FROM_SPAN
        let mut args = args![
            input.key_at(0),
            input.id_at(0),
            span,
            0u32,
            field_from_span,
            id_bits
        ]
        .to_vec();
        args.extend_from_slice(args![0usize, count, cap, bufs[0].ptr(), 0u64]);
        // At most one wave of blocks, each sorting every grid-th tile below m.
        let tile = merge_sort_tile(KeyWidth::W64);
        let blocks = cap
            .div_ceil(tile)
            .min(self.packed_sort_wave()? / tile)
            .max(1);
        let shared = merge_tile_shared(None);
        self.launch(
            &self.kernel("msort_tiles_packed"),
            blocks as u32,
            MSORT_THREADS,
            shared,
            &args,
        )?;
        Ok(bufs)
    }

    /// The rounds of a packed merge sort whose tiles [`packed_tiles_on_device`]
    /// (Self::packed_tiles_on_device) sorted: m pairs (> a tile), the field as the host read it
    /// from the same span words (the device found the same).
    pub(super) fn packed_rounds(
        &self,
        bufs: &[PooledBuffer; 2],
        m: usize,
        k: usize,
        field: (u32, u32, u32),
        span: u64,
    ) -> GpuResult<DevicePairs> {
        let tile = merge_sort_tile(KeyWidth::W64);
        if m <= tile {
            return Err(GpuError(format!(
                "the packed merge sort's rounds take more than a tile ({tile} pairs), not {m}"
            )));
        }
        self.packed_launches(bufs, None, m, k, field, span)
    }

    /// Two word buffers of the packed merge sort for m pairs.
    fn packed_buffers(&self, m: usize) -> GpuResult<[PooledBuffer; 2]> {
        Ok([
            self.device.pool.alloc(8 * m, &self.stream)?,
            self.device.pool.alloc(8 * m, &self.stream)?,
        ])
    }

    /// The packed merge sort's launches into `bufs`: its tile sort (unless already enqueued)
    /// and its rounds, the last one unpacking into the returned pairs.
    fn packed_launches(
        &self,
        bufs: &[PooledBuffer; 2],
        tiles: Option<(&str, &[Arg])>,
        m: usize,
        k: usize,
        (lo, width, id_bits): (u32, u32, u32),
        span: u64,
    ) -> GpuResult<DevicePairs> {
        let out = self.alloc_pairs(m.min(k))?;
        let [a, b] = [bufs[0].ptr(), bufs[1].ptr()];
        let unpack = self.kernel("msort_merge_unpack");
        let last = args![span, lo, width, id_bits, out.key_at(0), out.id_at(0)];
        self.merge_launches(
            MergeRounds::Words(&unpack, last),
            tiles,
            (m, 0, m, k, 0),
            [[a, 0], [b, 0]],
        )?;
        Ok(out)
    }

    /// The merge sort's launches: the tile sort `tiles` (its kernel and its input's
    /// arguments; `None`: already enqueued) into `bufs[0]`, then the rounds alternating
    /// between the two buffers (keys, row ids): [`MergeRounds`]. `counts`: (m, device count or
    /// 0, cap, k, status), as [`merge_sort`](Self::merge_sort) takes them.
    fn merge_launches(
        &self,
        rounds_kernel: MergeRounds,
        tiles_launch: Option<(&str, &[Arg])>,
        (m, count, cap, k, status): (usize, u64, usize, usize, u64),
        bufs: [[u64; 2]; 2],
    ) -> GpuResult<()> {
        let kind = match rounds_kernel {
            MergeRounds::Pairs(kind) => Some(kind),
            MergeRounds::Words(..) => None,
        };
        let tile = merge_sort_tile(kind.unwrap_or(KeyWidth::W64));
        let tiles = cap.div_ceil(tile);
        let rounds = tiles.next_power_of_two().trailing_zeros();
        let shared = merge_tile_shared(kind);
        // A buffer as kernel arguments: keys, then row ids unless keys only.
        let buffer = |b: [u64; 2]| -> Vec<Arg> {
            match kind {
                Some(_) => vec![Arg::from(b[0]), Arg::from(b[1])],
                None => vec![Arg::from(b[0])],
            }
        };
        let merge = match kind {
            Some(kind) => format!("msort_merge_{}", kind.suffix()),
            None => "msort_merge_words".to_string(),
        };
        if let Some((tiles_kernel, input)) = tiles_launch {
            let mut args = input.to_vec();
            args.extend_from_slice(args![m, count, cap]);
            args.extend(buffer(bufs[0]));
            args.push(Arg::from(status));
            self.launch(tiles_kernel, tiles as u32, MSORT_THREADS, shared, &args)?;
        }
        let keep = k.max(tile);
        for r in 0..rounds {
            let span = tile << r;
            let (src, dst) = (bufs[r as usize % 2], bufs[(r as usize + 1) % 2]);
            let tiles_per_run = (2 * span).min(keep).div_ceil(tile);
            let grid = cap.div_ceil(2 * span) * tiles_per_run;
            let mut args = buffer(src);
            args.extend_from_slice(args![m, count, cap, k, span]);
            args.extend(buffer(dst));
            args.push(Arg::from(status));
            let name = match rounds_kernel {
                MergeRounds::Words(last, extra) if r + 1 == rounds => {
                    args.extend_from_slice(extra);
                    last
                }
                _ => &merge,
            };
            self.launch(name, grid as u32, MSORT_THREADS, shared, &args)?;
        }
        Ok(())
    }

    /// The most pairs the packed merge sort takes in one wave: the tiles whose blocks are
    /// resident on the device at once in its tile sort and its rounds (the fewer of the two).
    /// Past it both take a second wave, and the sort takes nearly twice as long (a tile of 2048
    /// words; the tile sort's registers leave 6 blocks a SM; "No denser sample" in
    /// benches/PERFORMANCE.md).
    pub(super) fn packed_sort_wave(&self) -> GpuResult<usize> {
        if let Some(&wave) = self.packed_sort_wave.get() {
            return Ok(wave);
        }
        let shared = merge_tile_shared(None);
        let mut per_sm = u32::MAX;
        for name in [
            self.kernel("msort_tiles_packed"),
            "msort_merge_words".to_string(),
        ] {
            let blocks = self
                .kernels
                .get(&name)?
                .occupancy_max_active_blocks_per_multiprocessor(MSORT_THREADS, shared, None)
                .map_err(|e| GpuError(format!("occupancy of {name}: {e}")))?;
            per_sm = per_sm.min(blocks.max(1));
        }
        let wave = per_sm as usize * self.device.sm_count * merge_sort_tile(KeyWidth::W64);
        Ok(*self.packed_sort_wave.get_or_init(|| wave))
    }

    /// LSD radix sort of pairs `[0, m)` (radix_sort.cu): one histogram kernel, then per digit
    /// position of the (key, row id) integer one Onesweep pass kernel (up to
    /// `ONESWEEP_MAX_TILES` tiles, or `ONESWEEP_WIDE_MAX_TILES` wide ones) or a count, scan
    /// and scatter kernel (more); the device skips the positions in which every pair has the
    /// same digit. The input is left as it was.
    pub fn radix_sort(
        &self,
        input: &DevicePairs,
        m: usize,
        id_bound: u64,
    ) -> GpuResult<DevicePairs> {
        let id_bits = id_bits(id_bound);
        let id_digits = id_bits.div_ceil(8) as usize;
        let positions = id_digits + self.kind.bits() as usize / 8;
        let tile = radix_sort_tile(self.kind);
        let wide_tile = radix_sort_wide_tile(self.kind);
        let wide = radix_sort_is_wide(self.kind, m);
        let tiles = m.div_ceil(if wide { wide_tile } else { tile });
        // Control block: per position 256 bucket offsets, a plan word and a tile ticket; the
        // histogram kernel's block counter.
        let hist_bytes = positions * 256 * 4;
        let plan_off = hist_bytes as u64;
        let tickets_off = plan_off + 4 * positions as u64;
        let done_off = tickets_off + 4 * positions as u64;
        let ctl_bytes = done_off as usize + 4;
        let ctl = self.device.pool.alloc(ctl_bytes, &self.stream)?;
        self.memset_zero(ctl.ptr(), ctl_bytes)?;
        // Few tiles: one Onesweep kernel per pass (look-back); many: reduce-then-scan, three.
        let onesweep = wide || tiles <= ONESWEEP_MAX_TILES;
        // Per pass: a word per tile and digit; the wide pass's grouped look-back adds its
        // groups' sums and a row of their done counters (radix_sort.cu `group_lookback_words`).
        let pass_words = if wide {
            (tiles + tiles.div_ceil(LOOKBACK_GROUP) + 1) * 256
        } else {
            tiles * 256
        };
        let lookback_words = if onesweep { positions * pass_words } else { 0 };
        let lookback = self
            .device
            .pool
            .alloc(4 * lookback_words.max(1), &self.stream)?;
        let counts = if onesweep {
            None
        } else {
            Some(self.device.pool.alloc(4 * 256 * tiles, &self.stream)?)
        };
        let tmp = self.alloc_pairs(m)?;
        let out = self.alloc_pairs(m)?;
        let hist = self.kernel("rsort_hist");
        // Two blocks per SM: each block flushes up to 256 counters per digit position with
        // global atomics, which serialise per counter across blocks.
        let grid = (2 * self.device.sm_count).min(m.div_ceil(tile)) as u32;
        self.launch(
            &hist,
            grid,
            RSORT_THREADS,
            0,
            args![
                input.key_at(0),
                input.id_at(0),
                m,
                id_digits as u32,
                ctl.ptr(),
                ctl.ptr() + plan_off,
                lookback.ptr(),
                lookback_words,
                ctl.ptr() + done_off
            ],
        )?;
        let pass = self.kernel("rsort_pass");
        let pass_wide = self.kernel("rsort_pass_wide");
        let wide_shared = wide_tile * self.kind.pair_bytes();
        let count = self.kernel("rsort_count");
        let tile_offsets = counts.as_ref().map_or(0, |c| c.ptr());
        for p in 0..positions {
            // The pass's digit position and the three buffers, which every pass kernel takes first.
            let mut buffers = args![p as u32, id_digits as u32].to_vec();
            buffers.extend_from_slice(&sort_buffers(input, &tmp, &out));
            if input.positional && id_digits == 0 {
                // Key digits only: the passes write positions as the input's row ids.
                buffers[3] = Arg::from(0u64);
            }
            buffers.push(Arg::from(m));
            if let Some(counts) = &counts {
                let mut args = buffers.clone();
                args.extend_from_slice(args![ctl.ptr() + plan_off, counts.ptr()]);
                self.launch(&count, tiles as u32, RSORT_THREADS, 0, &args)?;
                self.launch(
                    "rsort_scan",
                    256,
                    RSORT_THREADS,
                    0,
                    args![
                        p as u32,
                        ctl.ptr() + plan_off,
                        counts.ptr(),
                        tiles as u32,
                        ctl.ptr()
                    ],
                )?;
            }
            let mut args = buffers.clone();
            args.extend_from_slice(args![
                ctl.ptr(),
                ctl.ptr() + plan_off,
                lookback.ptr(),
                ctl.ptr() + tickets_off
            ]);
            if wide {
                self.launch(&pass_wide, tiles as u32, RSORT_THREADS, wide_shared, &args)?;
            } else {
                args.push(Arg::from(tile_offsets));
                self.launch(&pass, tiles as u32, RSORT_THREADS, 0, &args)?;
            }
        }
        Ok(out)
    }

    /// Pairs `[0, m)` sorted ascending, at the start of a new buffer (bitonic sort, padded to
    /// a power of two with the largest pair): tiles of [`sort_tile`] pairs sorted in registers,
    /// then per larger size its global steps and one tile kernel for the strides below a tile.
    pub(crate) fn sort(&self, input: &DevicePairs, m: usize) -> GpuResult<DevicePairs> {
        let m2 = m.max(1).next_power_of_two();
        let buf = self.alloc_pairs(m2)?;
        let tile = sort_tile(self.kind);
        let tiles = m2.div_ceil(tile) as u32;
        let shared = tile * self.kind.pair_bytes();
        let (keys, ids) = (buf.key_at(0), buf.id_at(0));
        self.launch(
            &self.kernel("bitonic_sort_local"),
            tiles,
            SORT_THREADS,
            shared,
            args![input.key_at(0), input.id_at(0), m, keys, ids, m2],
        )?;
        let step = self.kernel("bitonic_sort_step");
        let merge = self.kernel("bitonic_merge_local");
        let mut size = 2 * tile;
        while size <= m2 {
            let mut stride = size / 2;
            while stride >= tile {
                self.launch(
                    &step,
                    self.grid_for(m2 / 2, 4),
                    THREADS,
                    0,
                    args![keys, ids, m2, size, stride],
                )?;
                stride /= 2;
            }
            self.launch(
                &merge,
                tiles,
                SORT_THREADS,
                shared,
                args![keys, ids, m2, size],
            )?;
            size *= 2;
        }
        Ok(buf)
    }
}

/// The merge sort's dynamic shared memory a block (its tile): keys then row ids, each with a
/// spare slot per 128 bytes; `None`: packed words, keys only.
fn merge_tile_shared(kind: Option<KeyWidth>) -> usize {
    let tile = merge_sort_tile(kind.unwrap_or(KeyWidth::W64));
    let key_bytes = kind.map_or(8, KeyWidth::key_bytes);
    let padded = |n: usize, size: usize| n + n / (128 / size);
    let keys_shared = (padded(tile, key_bytes) * key_bytes).next_multiple_of(16);
    keys_shared
        + if kind.is_some() {
            padded(tile, 8) * 8
        } else {
            0
        }
}

/// What the merge sort's rounds merge: (key, row id) pairs of a key type, or 64-bit words keys
/// only (`msort_merge_words`), the last round by the named kernel with these arguments after
/// the rounds' own.
enum MergeRounds<'a> {
    Pairs(KeyWidth),
    Words(&'a str, &'a [Arg]),
}
