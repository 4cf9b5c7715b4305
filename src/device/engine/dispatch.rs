//! The one dispatch over the routes: a selection of k among n pairs by the route
//! [`route`] plans, enqueued where it can run without a host round trip, and completed by
//! [`TopKEngine::finish`].

use super::*;

impl TopKEngine {
    /// The min(n, k) smallest of pairs `[0, n)`, sorted, at the start of the returned buffer.
    pub fn select_sorted(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
    ) -> GpuResult<(DevicePairs, usize)> {
        let selection = self.enqueue_select(input, n, k, algorithm)?;
        self.finish(selection)
    }

    /// [`select_sorted`](Self::select_sorted) without waiting where the route allows: a
    /// sampled selection whose survivors the device sorts on its own count, and the top-bits
    /// selection, are enqueued whole (no host round trip inside) and checked by
    /// [`finish`](Self::finish); every other route is complete when this returns.
    pub fn enqueue_select<'a>(
        &mut self,
        input: &'a DevicePairs,
        n: usize,
        k: usize,
        algorithm: DeviceAlgorithm,
    ) -> GpuResult<Selection<'a>> {
        let (m, id_bound) = (n.min(k), input.id_bound(n));
        let route = route(
            algorithm,
            self.kind,
            n,
            k,
            input.positional,
            self.device.options.top_bits,
        );
        let pending = |state| Selection { input, n, k, state };
        let sorted = match route {
            Route::Empty => self.alloc_pairs(1)?,
            Route::Bitonic => self.bitonic_select(input, n, k)?,
            Route::RadixSelect => {
                let winners = self.radix_select(input, n, k, k)?;
                self.sort_pairs(&winners, k, id_bound)?
            }
            // Positional ids ascend in input order and each LSD pass is stable, so the key's
            // digits alone leave ties in row id order (bound 1: no row id digit).
            Route::SortAll => {
                self.sort_pairs(input, n, if input.positional { 1 } else { id_bound })?
            }
            Route::RankSort => self.rank_sort(input, n)?,
            Route::TopBits => {
                let run = self.top_bits_enqueue(input, n, k)?;
                return Ok(pending(SelectionState::TopBits(Box::new(run))));
            }
            Route::WholeSort => self.sort_pairs(input, n, 1)?,
            Route::SampleLevels => match self.sample_enqueue(input, n, k, None)? {
                Some(run) if run.sorted_small.is_some() => {
                    return Ok(pending(SelectionState::Pending(Box::new(run))));
                }
                Some(run) => match self.sample_complete(run)? {
                    Some((sorted, _)) => sorted,
                    // The sample's estimate missed: radix select, which always holds.
                    None => return self.enqueue_select(input, n, k, DeviceAlgorithm::Radix),
                },
                None => return self.enqueue_select(input, n, k, DeviceAlgorithm::Radix),
            },
            Route::Delegate(s) => self.delegate_select(input, n, k, s)?,
        };
        Ok(pending(SelectionState::Ready(sorted, m)))
    }

    /// Completes an [`enqueue_select`](Self::enqueue_select): a pending sampled selection reads
    /// its status back (one round trip) and, in the rare case where its estimate missed, the
    /// selection runs again by radix select.
    pub fn finish(&mut self, selection: Selection<'_>) -> GpuResult<(DevicePairs, usize)> {
        self.finish_reporting(selection)
            .map(|(sorted, m, _)| (sorted, m))
    }

    /// [`finish`](Self::finish), also saying whether device work ran after the read-back (a
    /// missed estimate, or survivors the rank sort did not take): benchmarks then count the
    /// round trip and that work in the selection's time.
    pub fn finish_reporting(
        &mut self,
        selection: Selection<'_>,
    ) -> GpuResult<(DevicePairs, usize, bool)> {
        let Selection { input, n, k, state } = selection;
        match state {
            SelectionState::Ready(pairs, m) => Ok((pairs, m, false)),
            SelectionState::Pending(run) => match self.sample_complete(*run)? {
                Some((sorted, more)) => Ok((sorted, n.min(k), more)),
                None => {
                    let (sorted, m) = self.select_sorted(input, n, k, DeviceAlgorithm::Radix)?;
                    Ok((sorted, m, true))
                }
            },
            SelectionState::TopBits(run) => match self.top_bits_complete(*run)? {
                Some((sorted, more)) => Ok((sorted, n.min(k), more)),
                // A cluster the sample foresaw crowding a bin, or more kept pairs than the
                // buffers: all pairs by the key's radix passes where those take one kernel a
                // pass (on crowded ties that beats the sampled levels), else radix select.
                None if radix_sort_is_wide(self.kind, n) => {
                    Ok((self.sort_pairs(input, n, 1)?, n.min(k), true))
                }
                None => {
                    let (sorted, m) = self.select_sorted(input, n, k, DeviceAlgorithm::Radix)?;
                    Ok((sorted, m, true))
                }
            },
        }
    }
}

/// A selection enqueued by [`TopKEngine::enqueue_select`]; [`TopKEngine::finish`] completes
/// it.
#[derive(Debug)]
pub struct Selection<'a> {
    input: &'a DevicePairs,
    n: usize,
    k: usize,
    state: SelectionState,
}

impl Selection<'_> {
    /// Whether [`TopKEngine::finish`] still has to read a status back (and may run more work).
    pub fn is_pending(&self) -> bool {
        matches!(
            self.state,
            SelectionState::Pending(_) | SelectionState::TopBits(_)
        )
    }
}

#[derive(Debug)]
pub(super) enum SelectionState {
    Ready(DevicePairs, usize),
    Pending(Box<SampleRun>),
    TopBits(Box<TopBitsRun>),
}
