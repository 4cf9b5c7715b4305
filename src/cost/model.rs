//! The analytical cost model: the predicted time of each way to run a selection.
//!
//! Every device algorithm is written down as the kernels it launches (from the same plans the
//! engine runs: [`plan_sample_levels`], [`delegate_subrange`], the bitonic chunk, the radix
//! passes) and, per kernel, what bounds it:
//!
//! - the launch gap `L` of a dependent kernel on one stream, and the host round trip `R` of a
//!   read-back, both measured by the calibration;
//! - latency-bound *steps* (a one-block kernel such as the sampled threshold or the rank sort,
//!   a radix pass's fixed cost): `fixed` seconds each, fitted per algorithm;
//! - streamed bytes at the measured read bandwidth `B`, times a fitted `efficiency` (1: the
//!   read floor). A bitonic round is `max(T_global, T_shared)` (SIGMOD'18 §7.2): its shared
//!   memory traffic (compare-exchange steps × pair bytes) counts at the SMs' shared bandwidth
//!   (128 bytes per clock per SM) when that exceeds its global bytes.
//!
//! Per algorithm (n pairs in, k out):
//!
//! - **sample** (SampleSelect): per planned level a one-block threshold (a step, weighted by its
//!   sample size) and a filter that reads the level and writes its expected survivors; then the
//!   rank sort (a step) and one read-back, or for large k a read-back and the radix sort of the
//!   survivors. It cannot plan a level: radix select.
//! - **radix** (RadiK-style select): the masks pass, then per 8-bit digit a histogram and a
//!   filter pass over the candidates left, which shrink 256-fold per digit (uniform keys); rows
//!   tied on the k-th key do not shrink on key digits (the adversarial penalty: `ties`). All
//!   passes launch; one read-back; the radix sort of the k winners.
//! - **bitonic** (SIGMOD'18): rounds that cut each chunk to k; per element
//!   `log k (log k + 1) / 2` compare-exchange steps to sort runs of k, then about
//!   `2 (log k + 1)` for the merges and rebuilds over the halving data.
//! - **delegate** (Dr. Top-k): one read writes the n/S delegates (S by the α rule), a sampled
//!   selection of k of them, a gather of the k·S pairs of the winning subranges, one read-back,
//!   and the sort of the candidates.
//! - **sort** (the sort the others end with): the LSD radix sort, a histogram read, then per
//!   digit that varies a pass that reads and writes every pair (a step each; one launch per
//!   pass with a look-back, three without); or, where the engine takes the merge sort, a tile
//!   sort and one round per doubling of the runs, each a step reading and writing every pair.
//! - **filter** (a `WHERE` pass before the selection): reads the keys, writes the survivors
//!   (each written byte weighted by a fitted factor), reads their count back.
//! - **cpu**: rows / (rows per second per core × cores).
//!
//! The two constants per algorithm (`fixed`, `efficiency`) come from the calibration's two
//! reference runs of it ([`super::calibration`]); everything else is structure.

use crate::device::plan::{
    DIRECT_SORT_FACTOR, DIRECT_SORT_MIN, ONESWEEP_MAX_TILES, RADIX_SORT_MAX, RANK_SORT_MAX, Route,
    bitonic_chunk, merge_sort_tile, merge_sorts, plan_sample_levels, radix_sort_tile, route,
    sample_level_bounds, sample_size, sort_tile,
};
use crate::device::{DeviceAlgorithm, KeyWidth};

/// One selection, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Case {
    /// Pairs the selection reads.
    pub n: usize,
    pub k: usize,
    pub kind: KeyWidth,
    /// Keys only, row ids implied by position (device-resident input); else (key, row id)
    /// pairs, e.g. the candidates a filter left.
    pub positional: bool,
    /// Rows the row ids index (a filter's input): bounds the ids' digits.
    pub rows: usize,
    /// Fraction of the pairs that share the k-th key's bits above its lowest byte (0: spread
    /// keys; 1: all equal), as a sample or histogram would estimate it. Radix select cannot
    /// shrink them on the key's upper digits.
    pub ties: f64,
}

impl Case {
    /// A device-resident column of n distinct keys.
    pub fn positional(n: usize, k: usize, kind: KeyWidth) -> Self {
        Self {
            n,
            k,
            kind,
            positional: true,
            rows: n,
            ties: 0.0,
        }
    }

    /// Candidates: n pairs whose ids index `rows` rows.
    pub fn pairs(n: usize, k: usize, kind: KeyWidth, rows: usize) -> Self {
        Self {
            n,
            k,
            kind,
            positional: false,
            rows: rows.max(n),
            ties: 0.0,
        }
    }

    fn key_bytes(&self) -> f64 {
        self.kind.key_bytes() as f64
    }

    fn pair_bytes(&self) -> f64 {
        (self.kind.key_bytes() + 8) as f64
    }

    /// Bytes per pair of the input as read.
    fn input_bytes(&self) -> f64 {
        if self.positional {
            self.key_bytes()
        } else {
            self.pair_bytes()
        }
    }
}

/// The two fitted constants of one algorithm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// Seconds per latency-bound step.
    pub fixed_s: f64,
    /// Multiple of the streamed bytes' time at the read bandwidth.
    pub efficiency: f64,
}

impl Fit {
    /// Before calibration: steps of 10 µs, streaming at 1.2× the read floor.
    pub const DEFAULT: Fit = Fit {
        fixed_s: 10e-6,
        efficiency: 1.2,
    };
}

/// The fitted constants of every modelled algorithm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fits {
    pub sample: Fit,
    pub radix: Fit,
    pub bitonic: Fit,
    pub delegate: Fit,
    pub sort: Fit,
    pub filter: Fit,
    /// A filter's written bytes cost this many times its read bytes (warp buffers, one atomic
    /// per flush, scattered stores): fitted to a third filter reference.
    pub filter_write: f64,
}

impl Default for Fits {
    fn default() -> Self {
        Self {
            sample: Fit::DEFAULT,
            radix: Fit::DEFAULT,
            bitonic: Fit::DEFAULT,
            delegate: Fit::DEFAULT,
            sort: Fit::DEFAULT,
            filter: Fit::DEFAULT,
            filter_write: 1.0,
        }
    }
}

/// The machine the model predicts for: measured rates and device parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    /// Device read bandwidth, bytes per second (the read floor's).
    pub read_bw: f64,
    /// Seconds between dependent kernels on one stream.
    pub launch_s: f64,
    /// Seconds of a host read-back round trip.
    pub readback_s: f64,
    /// Host-to-device bandwidth from pinned memory, bytes per second.
    pub pcie_bw: f64,
    /// Shared-memory bandwidth of all SMs, bytes per second.
    pub shared_bw: f64,
    /// Shared memory one block may use (bounds the bitonic chunk).
    pub max_shared_per_block: usize,
    /// Streaming multiprocessors: a round of fewer blocks uses that share of the bandwidths.
    pub sm_count: usize,
    /// Rows per second one core of the CPU selector takes.
    pub cpu_rows_per_s: f64,
    /// Cores the CPU path uses.
    pub cpu_cores: usize,
}

/// A predicted time, split into its kind of work for EXPLAIN.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Work {
    launches: f64,
    readbacks: f64,
    steps: f64,
    /// Streamed bytes (for bitonic rounds: global or shared-equivalent, whichever bounds).
    bytes: f64,
    /// Seconds of nested selections or sorts, already predicted with their own fits.
    nested_s: f64,
}

impl Work {
    fn time(&self, m: &Machine, fit: Fit) -> f64 {
        self.launches * m.launch_s
            + self.readbacks * m.readback_s
            + self.steps * fit.fixed_s
            + fit.efficiency * self.bytes / m.read_bw
            + self.nested_s
    }

    /// The parts linear in the fit: (constant, per fixed second, per efficiency unit).
    fn linear(&self, m: &Machine) -> (f64, f64, f64) {
        (
            self.launches * m.launch_s + self.readbacks * m.readback_s + self.nested_s,
            self.steps,
            self.bytes / m.read_bw,
        )
    }
}

/// The calibrated model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub machine: Machine,
    pub fits: Fits,
}

/// Which fitted part of the model a reference run calibrates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Algorithm(DeviceAlgorithm),
    Sort,
    Filter,
}

impl CostModel {
    /// The predicted device time of `algorithm` selecting and sorting the case's k, in seconds;
    /// `None` where the algorithm does not take this k (bitonic beyond its k limit).
    pub fn predict(&self, algorithm: DeviceAlgorithm, case: &Case) -> Option<f64> {
        let (work, fit) = self.work(algorithm, case)?;
        Some(work.time(&self.machine, fit))
    }

    /// The fastest device algorithm for the case and its predicted time.
    pub fn best_device(&self, case: &Case) -> (DeviceAlgorithm, f64) {
        DeviceAlgorithm::ALL
            .iter()
            .filter_map(|&a| self.predict(a, case).map(|t| (a, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("radix takes every case")
    }

    /// A pass over n rows that keeps `kept` of them as candidates (a `WHERE` filter on the
    /// device): reads the keys, writes the survivors' pairs.
    pub fn filter_time(&self, n: usize, kept: usize, kind: KeyWidth) -> f64 {
        self.filter_work(n, kept, kind)
            .time(&self.machine, self.fits.filter)
    }

    /// A hash aggregation on the device, in seconds: the reset of a table of `slots` slots of
    /// `slot_bytes` each (a group's key words, its state and its accumulators), one pass that
    /// reads every one of `rows` rows of `row_bytes` and updates its group's slot, and the
    /// compaction of the `groups` groups into ranking pairs of `kind` (the selection among them
    /// is [`predict`](Self::predict)'s). Its passes stream at the calibrated filter pass's rate,
    /// each row's update counted as a read of its slot.
    pub fn aggregate_time(
        &self,
        (rows, row_bytes): (usize, usize),
        (slots, slot_bytes): (usize, usize),
        groups: usize,
        kind: KeyWidth,
    ) -> f64 {
        let pair = (kind.key_bytes() + 8) as f64;
        let table = slots as f64 * slot_bytes as f64;
        let work = Work {
            // The resets, the pass, the compaction's count reset, the compaction, the ranking.
            launches: 6.0,
            // The pass's count and status, before the table is read.
            readbacks: 1.0,
            steps: 3.0,
            bytes: 2.0 * table
                + rows as f64 * (row_bytes + slot_bytes) as f64
                + groups as f64 * (slot_bytes as f64 + pair),
            ..Work::default()
        };
        work.time(&self.machine, self.fits.filter)
    }

    /// The sort of m pairs (ids below `rows`), in seconds.
    pub fn sort_time(&self, m: usize, kind: KeyWidth, rows: usize, source: usize) -> f64 {
        self.sort_work(m, kind, rows, source)
            .time(&self.machine, self.fits.sort)
    }

    /// The CPU selector over n rows, in seconds.
    pub fn cpu_time(&self, n: usize) -> f64 {
        n as f64 / (self.machine.cpu_rows_per_s * self.machine.cpu_cores.max(1) as f64)
    }

    /// Moving `bytes` from pinned host memory to the device, in seconds.
    pub fn transfer_time(&self, bytes: usize) -> f64 {
        bytes as f64 / self.machine.pcie_bw
    }

    /// The largest k bitonic top-k takes for these keys.
    pub fn bitonic_max_k(&self, kind: KeyWidth) -> usize {
        crate::device::plan::bitonic_max_k(self.machine.max_shared_per_block, kind)
    }

    /// The terms of a reference run that are linear in `part`'s fit: (constant seconds,
    /// seconds per `fixed_s`, seconds per efficiency unit). The calibration solves two of these
    /// for the fit.
    pub fn linear_terms(&self, part: Part, case: &Case) -> Option<(f64, f64, f64)> {
        let work = match part {
            Part::Algorithm(a) => self.work(a, case)?.0,
            Part::Sort => self.sort_work(case.n, case.kind, case.rows, case.rows),
            Part::Filter => self.filter_work(case.rows, case.n, case.kind),
        };
        Some(work.linear(&self.machine))
    }

    fn work(&self, algorithm: DeviceAlgorithm, case: &Case) -> Option<(Work, Fit)> {
        let (n, k) = (case.n, case.k);
        if algorithm == DeviceAlgorithm::Bitonic && k > self.bitonic_max_k(case.kind) {
            return None; // whatever n is: an empty input must not pick what cannot run
        }
        // The route the engine takes (A/B switches aside: the model predicts the default),
        // with the fit of the algorithm whose route it is.
        let sorted_rows = if case.positional { 1 } else { case.rows };
        let rows = if case.positional { n } else { case.rows };
        Some(
            match route(algorithm, case.kind, n, k, case.positional, None) {
                Route::Empty => (Work::default(), self.fits.sample),
                // One launch after the control block's memset and count.
                Route::RankSort => {
                    let work = Work {
                        launches: 3.0,
                        steps: 1.0,
                        bytes: n as f64 * case.pair_bytes(),
                        ..Work::default()
                    };
                    (work, self.fits.sample)
                }
                // A memset, two reads of the keys (the sampled bins and their histogram, the
                // scatter of the pairs at or below the k-th smallest's bin), the segment sort of
                // those (about k), and the read-back of its status.
                Route::TopBits => {
                    let work = Work {
                        launches: 4.0,
                        readbacks: 1.0,
                        steps: 3.0,
                        bytes: 2.0 * n as f64 * case.kind.key_bytes() as f64
                            + 2.0 * k as f64 * case.pair_bytes(),
                        ..Work::default()
                    };
                    (work, self.fits.sort)
                }
                Route::SortAll | Route::WholeSort => {
                    let work = Work {
                        nested_s: self.sort_time(n, case.kind, sorted_rows, n),
                        ..Work::default()
                    };
                    (work, self.fits.sort)
                }
                Route::SampleLevels => (self.sample_levels_work(case), self.fits.sample),
                Route::RadixSelect => {
                    let mut w = self.radix_select_work(case);
                    w.nested_s += self.sort_time(k, case.kind, rows, n);
                    (w, self.fits.radix)
                }
                Route::Bitonic => (self.bitonic_work(case), self.fits.bitonic),
                Route::Delegate(s) => (self.delegate_work(case, s)?, self.fits.delegate),
            },
        )
    }

    /// The sampled selection's levels (its [`Route::SampleLevels`]).
    fn sample_levels_work(&self, case: &Case) -> Work {
        let (n, k) = (case.n, case.k);
        let plan = plan_sample_levels(n, k, sample_size(case.kind), RANK_SORT_MAX);
        let s_max = sample_size(case.kind) as f64;
        let mut w = Work {
            launches: 1.0, // the control block's memset
            ..Work::default()
        };
        let mut level_n = n;
        for (i, level) in plan.iter().enumerate() {
            let expected =
                sample_level_bounds(level_n, k, level.s.min(level_n)).map_or(k, |(e, _)| e.max(k));
            w.launches += 2.0;
            // The one-block threshold costs in proportion to its sample, on top of a
            // fixed part.
            w.steps += 0.6 + 0.4 * (level.s as f64 / s_max).min(1.0);
            let read = if i == 0 {
                case.input_bytes()
            } else {
                case.pair_bytes()
            };
            w.bytes += level_n as f64 * read + expected as f64 * case.pair_bytes();
            level_n = expected;
        }
        w.readbacks += 1.0;
        if k <= RANK_SORT_MAX {
            w.launches += 1.0;
            w.steps += 1.0;
        } else {
            w.nested_s += self.finish_survivors(level_n, case);
        }
        w
    }

    /// The bitonic top-k's rounds (its [`Route::Bitonic`]).
    fn bitonic_work(&self, case: &Case) -> Work {
        let m = &self.machine;
        let (n, k) = (case.n, case.k);
        let k2 = k.next_power_of_two();
        let chunk = bitonic_chunk(m.max_shared_per_block, case.kind);
        let lk = (k2 as f64).log2();
        // Plus a fixed part per pair (loading the chunk, the runs' first steps, the
        // write-out): about 9 exchanges' worth.
        let exchanges = lk * (lk + 1.0) / 2.0 + 2.0 * (lk + 1.0) + 9.0;
        let mut w = Work::default();
        let mut len = n;
        loop {
            let blocks = len.div_ceil(chunk).max(1);
            // The rounds read (key, row id) pairs, positional input too.
            let global = len as f64 * case.pair_bytes() + (blocks * k2) as f64 * case.pair_bytes();
            // Each compare-exchange step reads and writes every pair in shared memory.
            let shared = len as f64 * exchanges * 2.0 * case.pair_bytes();
            // One block per chunk: fewer blocks than SMs leave the rest idle.
            let occupancy = (blocks as f64 / m.sm_count.max(1) as f64).min(1.0);
            w.bytes += global.max(shared * m.read_bw / m.shared_bw) / occupancy;
            w.launches += 1.0;
            w.steps += 1.0;
            len = blocks * k2;
            if blocks == 1 {
                break;
            }
        }
        w
    }

    /// Dr. Top-k's delegates over subranges of `s` pairs (its [`Route::Delegate`]).
    fn delegate_work(&self, case: &Case, s: usize) -> Option<Work> {
        let (n, k) = (case.n, case.k);
        let rows = if case.positional { n } else { case.rows };
        let delegates = n.div_ceil(s);
        let mut w = Work {
            launches: 4.0, // delegates, threshold, count reset, gather
            steps: 2.0,
            readbacks: 1.0,
            ..Work::default()
        };
        w.bytes += n as f64 * case.input_bytes() + delegates as f64 * case.pair_bytes();
        let best = Case::pairs(delegates, k, case.kind, rows);
        w.nested_s += self.predict(DeviceAlgorithm::Sample, &best)?;
        // The winning subranges hold the k best delegates; about 2k of their pairs
        // fall at or below the k-th delegate (more when keys tie).
        let gathered = (k * s).min(n);
        let count = ((2 * k) as f64)
            .max(case.ties * n as f64)
            .min(gathered as f64);
        w.bytes += gathered as f64 * case.input_bytes() + count * case.pair_bytes();
        let count = count as usize;
        let candidates = Case {
            ties: 0.0,
            ..Case::pairs(count, k, case.kind, rows)
        };
        w.nested_s += if count <= DIRECT_SORT_FACTOR * k.max(DIRECT_SORT_MIN) {
            self.sort_time(count, case.kind, rows, n)
        } else {
            self.predict(DeviceAlgorithm::Sample, &candidates)?
        };
        Some(w)
    }

    /// A sampled selection's end for large k: sort the survivors, or radix-select k of them
    /// and sort those (the engine's `sample_complete`).
    fn finish_survivors(&self, survivors: usize, case: &Case) -> f64 {
        let k = case.k;
        let rows = if case.positional { case.n } else { case.rows };
        if survivors <= DIRECT_SORT_FACTOR * k.max(DIRECT_SORT_MIN) {
            self.sort_time(survivors, case.kind, rows, case.n)
        } else {
            let inner = Case::pairs(survivors, k, case.kind, rows);
            self.radix_select_work(&inner)
                .time(&self.machine, self.fits.radix)
                + self.sort_time(k, case.kind, rows, case.n)
        }
    }

    fn radix_select_work(&self, case: &Case) -> Work {
        let (n, k) = (case.n as f64, case.k as f64);
        let key_digits = case.kind.key_bytes();
        let passes = (64 + case.kind.bits() as usize).div_ceil(8);
        let mut w = Work {
            // init, masks, then a histogram and a filter per digit (passes after the last
            // one that moves data return at once, but still launch).
            launches: 2.0 + 2.0 * passes as f64,
            steps: 1.0,
            readbacks: 1.0,
            ..Work::default()
        };
        // Every radix pass reads (key, row id) pairs, positional input too.
        let read = case.pair_bytes();
        w.bytes += n * read;
        let tied = case.ties * n;
        let mut m = n;
        for digit in 0..passes {
            if m <= 1.0 {
                break;
            }
            // Candidates sharing the k-th pair's digits so far: 256-fold fewer per digit, but
            // ties on the key only shrink once the row id's digits start. Digits every key
            // shares are skipped (the masks pass finds them).
            if digit < key_digits && case.ties >= 0.999 {
                continue;
            }
            let next = if digit < key_digits {
                (m / 256.0).max(tied)
            } else {
                m / 256.0
            };
            w.bytes += 2.0 * m * read + next * case.pair_bytes();
            w.steps += 1.0;
            m = next;
        }
        w.bytes += k * case.pair_bytes();
        w
    }

    /// The sort of m pairs whose ids are below `rows` (1: ids ascend in input order,
    /// no id digit), taken from a selection over `source` pairs (their keys then share the
    /// high bits that the top m of `source` uniform keys share).
    fn sort_work(&self, m: usize, kind: KeyWidth, rows: usize, source: usize) -> Work {
        if m <= 1 {
            return Work::default();
        }
        let pair = (kind.key_bytes() + 8) as f64;
        if m <= sort_tile(kind) || m >= RADIX_SORT_MAX {
            // One register tile's bitonic sort (or, past the radix sort's limit, the global
            // bitonic sort, which the model does not cover beyond its first tile).
            return Work {
                launches: 1.0,
                steps: 1.0,
                bytes: 2.0 * m as f64 * pair,
                ..Work::default()
            };
        }
        if merge_sorts(kind, m, rows as u64) {
            // The merge sort (`sort_pairs` picks it here): the tile sort, then a round per
            // doubling of the runs, each a step that reads and writes every pair.
            let rounds = m
                .div_ceil(merge_sort_tile(kind))
                .next_power_of_two()
                .trailing_zeros();
            let launches = 1.0 + f64::from(rounds);
            return Work {
                launches,
                steps: launches,
                bytes: 2.0 * launches * m as f64 * pair,
                ..Work::default()
            };
        }
        let tiles = m.div_ceil(radix_sort_tile(kind));
        let launches_per_pass = if tiles <= ONESWEEP_MAX_TILES {
            1.0
        } else {
            3.0
        };
        let key_bits = kind.bits() as f64;
        let shared_high = (source.max(m) as f64 / m as f64).log2().floor().max(0.0);
        let key_passes = ((key_bits - shared_high).max(8.0) / 8.0).ceil();
        let id_bits = if rows <= 1 {
            0.0
        } else {
            (rows as f64).log2().ceil()
        };
        let id_passes = (id_bits / 8.0).ceil();
        // Positions launched: the id's bytes below the bound (8 when unknown) and the key's.
        let id_positions = if rows <= 1 { 0.0 } else { 8.0 };
        let positions = id_positions + kind.key_bytes() as f64;
        let run = key_passes + id_passes;
        Work {
            launches: 2.0 + positions * launches_per_pass,
            steps: run,
            // The histogram reads every pair; each run pass reads and writes them.
            bytes: m as f64 * pair * (1.0 + 2.0 * run),
            ..Work::default()
        }
    }

    fn filter_work(&self, n: usize, kept: usize, kind: KeyWidth) -> Work {
        Work {
            launches: 2.0, // the count reset and the filter
            steps: 1.0,
            readbacks: 1.0, // the count, before the selection sizes its work
            bytes: n as f64 * kind.key_bytes() as f64
                + self.fits.filter_write * kept as f64 * (kind.key_bytes() + 8) as f64,
            ..Work::default()
        }
    }
}

/// Solves `t = c + fixed · a + efficiency · b` at two reference runs for (fixed, efficiency),
/// kept within physical bounds (no negative fixed time; efficiency between 0.25 and 50). A
/// singular system keeps `fallback`.
pub(crate) fn solve_fit(
    small: (f64, f64, f64, f64),
    large: (f64, f64, f64, f64),
    fallback: Fit,
) -> Fit {
    let (c1, a1, b1, t1) = small;
    let (c2, a2, b2, t2) = large;
    let (r1, r2) = (t1 - c1, t2 - c2);
    let det = a1 * b2 - a2 * b1;
    let (mut fixed, mut eff) = if det.abs() > 1e-18 {
        ((r1 * b2 - r2 * b1) / det, (a1 * r2 - a2 * r1) / det)
    } else {
        (fallback.fixed_s, fallback.efficiency)
    };
    if !fixed.is_finite() || !eff.is_finite() {
        return fallback;
    }
    // Clamp one, then refit the other on the run that depends on it most.
    if fixed < 0.0 {
        fixed = 0.0;
        eff = if b2 > 0.0 {
            r2 / b2
        } else {
            fallback.efficiency
        };
    }
    eff = eff.clamp(0.25, 50.0);
    if fixed == 0.0 && a1 > 0.0 {
        fixed = ((r1 - eff * b1) / a1).max(0.0);
    }
    Fit {
        fixed_s: fixed,
        efficiency: eff,
    }
}

/// An H100-like model with the default fits, for tests.
#[cfg(test)]
pub(crate) fn h100_like() -> CostModel {
    CostModel {
        machine: Machine {
            read_bw: 3.0e12,
            launch_s: 2.5e-6,
            readback_s: 10e-6,
            pcie_bw: 25e9,
            shared_bw: 132.0 * 128.0 * 1.75e9,
            max_shared_per_block: 227 * 1024,
            sm_count: 132,
            cpu_rows_per_s: 200e6,
            cpu_cores: 16,
        },
        fits: Fits::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_inputs_are_bandwidth_bound_and_small_ones_latency_bound() {
        let m = h100_like();
        let big = Case::positional(1 << 29, 32, KeyWidth::W32);
        let floor = (4usize << 29) as f64 / m.machine.read_bw;
        let t = m.predict(DeviceAlgorithm::Sample, &big).unwrap();
        assert!(t > floor && t < 1.6 * floor, "{t} vs floor {floor}");
        let small = Case::positional(1 << 16, 32, KeyWidth::W32);
        let t = m.predict(DeviceAlgorithm::Sample, &small).unwrap();
        assert!(t > 10.0 * (4 << 16) as f64 / m.machine.read_bw);
    }

    #[test]
    fn bitonic_has_a_k_limit_and_radix_takes_everything() {
        let m = h100_like();
        let limit = m.bitonic_max_k(KeyWidth::W32);
        let case = |k| Case::positional(1 << 24, k, KeyWidth::W32);
        assert!(m.predict(DeviceAlgorithm::Bitonic, &case(limit)).is_some());
        assert!(
            m.predict(DeviceAlgorithm::Bitonic, &case(limit + 1))
                .is_none()
        );
        for k in [1, 1000, 1 << 16, 1 << 20, 1 << 24, 1 << 25] {
            assert!(m.predict(DeviceAlgorithm::Radix, &case(k)).is_some(), "{k}");
        }
        // Nor on an empty input, where every algorithm costs nothing.
        let empty = Case::positional(0, limit + 1, KeyWidth::W32);
        assert!(m.predict(DeviceAlgorithm::Bitonic, &empty).is_none());
        assert_ne!(m.best_device(&empty).0, DeviceAlgorithm::Bitonic);
    }

    #[test]
    fn ties_penalise_radix_only() {
        let m = h100_like();
        let plain = Case::positional(1 << 26, 1024, KeyWidth::W32);
        let tied = Case { ties: 0.5, ..plain };
        let radix = |c| m.predict(DeviceAlgorithm::Radix, c).unwrap();
        let sample = |c| m.predict(DeviceAlgorithm::Sample, c).unwrap();
        assert!(radix(&tied) > 1.5 * radix(&plain));
        assert_eq!(sample(&tied), sample(&plain));
    }

    #[test]
    fn time_grows_with_n_and_with_key_width() {
        let m = h100_like();
        // Not delegates: their nested selection of the delegates is a radix select below the
        // sample's smallest plan (2^20 rows, k = 32: 8192 delegates) and a sampled one above.
        let algorithms = [
            DeviceAlgorithm::Bitonic,
            DeviceAlgorithm::Radix,
            DeviceAlgorithm::Sample,
        ];
        for algorithm in algorithms {
            let mut last = 0.0;
            for log_n in [16, 20, 24, 27, 29] {
                let t = m
                    .predict(algorithm, &Case::positional(1 << log_n, 32, KeyWidth::W32))
                    .unwrap();
                assert!(t > last, "{algorithm:?} at 2^{log_n}: {t} after {last}");
                last = t;
            }
            let narrow = m
                .predict(algorithm, &Case::positional(1 << 27, 32, KeyWidth::W32))
                .unwrap();
            let wide = m
                .predict(algorithm, &Case::positional(1 << 27, 32, KeyWidth::W64))
                .unwrap();
            assert!(wide > narrow, "{algorithm:?}");
        }
    }

    #[test]
    fn the_fit_reproduces_its_two_references() {
        let m = h100_like();
        let small = Case::positional(1 << 16, 32, KeyWidth::W32);
        let large = Case::positional(1 << 24, 32, KeyWidth::W32);
        let truth = Fit {
            fixed_s: 7e-6,
            efficiency: 1.4,
        };
        let part = Part::Algorithm(DeviceAlgorithm::Radix);
        let terms = |c| m.linear_terms(part, c).unwrap();
        let (c1, a1, b1) = terms(&small);
        let (c2, a2, b2) = terms(&large);
        let t1 = c1 + truth.fixed_s * a1 + truth.efficiency * b1;
        let t2 = c2 + truth.fixed_s * a2 + truth.efficiency * b2;
        let fit = solve_fit((c1, a1, b1, t1), (c2, a2, b2, t2), Fit::DEFAULT);
        assert!((fit.fixed_s - truth.fixed_s).abs() < 1e-9, "{fit:?}");
        assert!((fit.efficiency - truth.efficiency).abs() < 1e-6, "{fit:?}");
        // Impossible references are clamped, not taken.
        let fit = solve_fit((c1, a1, b1, c1 / 2.0), (c2, a2, b2, t2), Fit::DEFAULT);
        assert!(fit.fixed_s >= 0.0 && fit.efficiency >= 0.25, "{fit:?}");
    }

    #[test]
    fn the_cpu_wins_tiny_inputs_from_the_host() {
        let m = h100_like();
        let n = 1000;
        let gpu = m.transfer_time(4 * n)
            + m.predict(
                DeviceAlgorithm::Sample,
                &Case::positional(n, 10, KeyWidth::W32),
            )
            .unwrap();
        assert!(m.cpu_time(n) < gpu);
        let n = 1 << 28;
        let gpu = m.transfer_time(4 * n)
            + m.predict(
                DeviceAlgorithm::Sample,
                &Case::positional(n, 10, KeyWidth::W32),
            )
            .unwrap();
        assert!(m.cpu_time(n) > gpu);
    }

    /// A hash aggregation costs its launches on few rows, and grows with the rows and with
    /// the table (more groups, or more accumulators a slot).
    #[test]
    fn the_aggregation_grows_with_rows_and_table() {
        let m = h100_like();
        let time = |rows, slots, slot_bytes, groups| {
            m.aggregate_time((rows, 24), (slots, slot_bytes), groups, KeyWidth::W128)
        };
        let tiny = time(1000, 1024, 32, 10);
        assert!(tiny < 1e-4 && tiny > 6.0 * m.machine.launch_s, "{tiny}");
        let rows = 100_000_000;
        let few = time(rows, 1024, 32, 300);
        assert!(few > 10.0 * tiny, "{few}");
        assert!(time(rows, 1 << 25, 32, 1 << 24) > few);
        assert!(time(rows, 1024, 64, 300) > few);
        assert!(time(2 * rows, 1024, 32, 300) > few);
    }
}
