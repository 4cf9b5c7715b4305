//! The device column cache: the columns a generated program reads from in-memory tables stay
//! in device memory between queries, so that a repeated query reads them at device bandwidth
//! instead of shipping them over PCIe again.
//!
//! An entry is one push of one selection: the staged image of its columns' Arrow buffers
//! (values, validity), keyed by the host address and length of every slice. The entry holds a
//! reference to each of those buffers, so while it lives their memory cannot be freed and
//! reused for other data; Arrow buffers are immutable while shared, so a hit is always the same
//! bytes. A changed table (an insert makes new batches) has new buffers and misses.
//!
//! The budget bounds the device bytes of all entries (`gpu_topk.cache_bytes`). A new entry
//! evicts the least recently used entries that no running push is reading; when that does not
//! make room, the push runs without caching (its columns are staged as usual). Entries in use
//! are pinned by a [`CacheUse`] guard until the push that reads them has finished.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::buffer::Buffer;

use super::memory::PooledBuffer;

/// A cache key: (host address, length) of every slice a push stages, in staging order.
pub(crate) type CacheKey = Vec<(usize, usize)>;

/// One cached push: its device image and where each staged group starts in it.
pub(crate) struct CacheEntry {
    buffer: PooledBuffer,
    offsets: Vec<usize>,
    bytes: usize,
    /// The host buffers the key's addresses belong to, kept so the addresses stay theirs.
    _owners: Vec<Buffer>,
    /// The columns it holds, for the cache listing.
    columns: String,
    last_use: AtomicU64,
    users: AtomicUsize,
}

impl CacheEntry {
    /// The device address of each staged group (as `upload_staged` returns them).
    pub(crate) fn addresses(&self) -> Vec<u64> {
        let base = self.buffer.ptr();
        self.offsets.iter().map(|&o| base + o as u64).collect()
    }
}

/// A use of an entry by one push: the entry cannot be evicted until it is dropped.
pub(crate) struct CacheUse(Arc<CacheEntry>);

impl CacheUse {
    pub(crate) fn entry(&self) -> &CacheEntry {
        &self.0
    }
}

impl Drop for CacheUse {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One entry, as the cache listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheListing {
    pub columns: String,
    pub slices: usize,
    pub bytes: usize,
    /// The cache's clock at the entry's last use (higher: more recent).
    pub last_use: u64,
    pub in_use: bool,
}

#[derive(Default)]
struct State {
    entries: HashMap<CacheKey, Arc<CacheEntry>>,
    /// How many entries hold each host slice address, for [`ColumnCache::holds`].
    slices: HashMap<usize, usize>,
    /// Bytes of the entries, and of the room reserved for entries being uploaded.
    bytes: usize,
}

/// See the module documentation. One per device.
#[derive(Default)]
pub struct ColumnCache {
    state: Mutex<State>,
    clock: AtomicU64,
}

impl std::fmt::Debug for ColumnCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("ColumnCache")
            .field("entries", &state.entries.len())
            .field("bytes", &state.bytes)
            .finish()
    }
}

impl ColumnCache {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The entry for `key`, pinned until the returned use is dropped.
    pub(crate) fn acquire(&self, key: &CacheKey) -> Option<CacheUse> {
        let state = self.state();
        let entry = state.entries.get(key)?;
        entry.users.fetch_add(1, Ordering::AcqRel);
        entry.last_use.store(self.tick(), Ordering::Relaxed);
        Some(CacheUse(Arc::clone(entry)))
    }

    /// Reserves `bytes` for a new entry within `budget`, evicting the least recently used
    /// entries no push is reading; `false` when that cannot make room.
    pub(crate) fn reserve(&self, bytes: usize, budget: usize) -> bool {
        if bytes == 0 || bytes > budget {
            return false;
        }
        let mut state = self.state();
        while state.bytes + bytes > budget {
            let victim = state
                .entries
                .iter()
                .filter(|(_, e)| e.users.load(Ordering::Acquire) == 0)
                .min_by_key(|(_, e)| e.last_use.load(Ordering::Relaxed))
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else {
                return false;
            };
            let entry = state.entries.remove(&victim).expect("found above");
            state.bytes -= entry.bytes;
            forget_slices(&mut state.slices, &victim);
        }
        state.bytes += bytes;
        true
    }

    /// Gives back a reservation that did not become an entry.
    pub(crate) fn unreserve(&self, bytes: usize) {
        let mut state = self.state();
        state.bytes = state.bytes.saturating_sub(bytes);
    }

    /// Adds an entry for `key` whose room was reserved, once the push that uploaded it has
    /// finished (so others only ever see complete entries). A concurrent insert of the same
    /// key keeps the first.
    pub(crate) fn insert(
        &self,
        key: CacheKey,
        buffer: PooledBuffer,
        offsets: Vec<usize>,
        owners: Vec<Buffer>,
        columns: String,
    ) {
        let bytes = buffer.bytes();
        let entry = Arc::new(CacheEntry {
            buffer,
            offsets,
            bytes,
            _owners: owners,
            columns,
            last_use: AtomicU64::new(self.tick()),
            users: AtomicUsize::new(0),
        });
        let mut state = self.state();
        match state.entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => {
                state.bytes = state.bytes.saturating_sub(bytes);
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                let addresses: Vec<usize> = slot.key().iter().map(|&(a, _)| a).collect();
                slot.insert(entry);
                for address in addresses {
                    *state_slices(&mut state.slices, address) += 1;
                }
            }
        }
    }

    /// Evicts every entry no push is reading; returns how many.
    pub fn clear(&self) -> usize {
        let mut state = self.state();
        let before = state.entries.len();
        let (mut freed, mut gone) = (0, Vec::new());
        state.entries.retain(|key, e| {
            let keep = e.users.load(Ordering::Acquire) > 0;
            if !keep {
                freed += e.bytes;
                gone.push(key.clone());
            }
            keep
        });
        state.bytes -= freed;
        for key in gone {
            forget_slices(&mut state.slices, &key);
        }
        before - state.entries.len()
    }

    /// Whether an entry holds the host slice starting at `address` (a column buffer's data).
    pub fn holds(&self, address: usize) -> bool {
        self.state().slices.contains_key(&address)
    }

    /// Device bytes of the entries (and of reservations in flight).
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }

    /// Every entry, most recently used first.
    pub fn listing(&self) -> Vec<CacheListing> {
        let state = self.state();
        let mut all: Vec<CacheListing> = state
            .entries
            .iter()
            .map(|(key, e)| CacheListing {
                columns: e.columns.clone(),
                slices: key.len(),
                bytes: e.bytes,
                last_use: e.last_use.load(Ordering::Relaxed),
                in_use: e.users.load(Ordering::Acquire) > 0,
            })
            .collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.last_use));
        all
    }
}

fn state_slices(slices: &mut HashMap<usize, usize>, address: usize) -> &mut usize {
    slices.entry(address).or_insert(0)
}

fn forget_slices(slices: &mut HashMap<usize, usize>, key: &CacheKey) {
    for (address, _) in key {
        if let Some(n) = slices.get_mut(address) {
            *n -= 1;
            if *n == 0 {
                slices.remove(address);
            }
        }
    }
}
