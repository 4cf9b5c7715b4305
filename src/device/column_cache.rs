//! The device column cache: the columns a generated program reads from in-memory tables (and
//! Parquet files) stay
//! in device memory between queries, so that a repeated query reads them at device bandwidth
//! instead of shipping them over PCIe again.
//!
//! An entry is one column of one in-memory table: its batches' values (and validity) back to
//! back, keyed by the host address and extent of every batch's buffers. The entry holds a
//! reference to each of those buffers, so while it lives their memory cannot be freed and
//! reused for other data; Arrow buffers are immutable while shared, so a hit is always the same
//! bytes. A changed table (an insert adds a batch) has another key and misses. A `GpuTable`'s
//! column is keyed by the table ([`table_key`]); a column of a scan of Parquet files by every
//! file's identity, modification time included ([`files_key`]), so a rewritten file misses.
//! A string column a sort key reads is held as its prefix words (16 bytes a row), under the
//! column's key with a mark of its own ([`prefix_key`]); one a predicate reads, as its row
//! ends and bytes ([`strings_key`]).
//!
//! The cache is a process resource, one per device, shared by every session. Its budget
//! bounds the device bytes of all entries: a quarter of the device's memory unless the
//! application sets it for the process with [`set_column_cache_budget`] (its one owner;
//! the CLI's `--cache-bytes` calls it). A session only decides whether its own queries use
//! the cache (`gpu_topk.column_cache`). A new entry evicts the least recently used entries
//! that no query is reading; when that does not make room, the query streams its input
//! instead. Entries in use are pinned by a [`CacheUse`] guard until the selection that reads
//! them has finished.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::buffer::Buffer;

use super::memory::PooledBuffer;

/// A cache key: two words per batch of the column (its values' host address and extent, its
/// validity's), in the table's order; or, for a [`crate::GpuTable`]'s column,
/// [`table_key`]; or, for a column of Parquet files, [`files_key`].
pub(crate) type CacheKey = Vec<(usize, usize)>;

/// No host address: marks a key made by [`table_key`].
const TABLE: usize = usize::MAX;
/// No host address: marks a key made by [`files_key`].
const FILES: usize = usize::MAX - 1;

/// The key of column `column` of the `GpuTable` with identity `table`.
pub(crate) fn table_key(table: u64, column: usize) -> CacheKey {
    vec![(TABLE, table as usize), (column, 0)]
}

/// The key of column `column` (of a table schema whose hash is `schema`) of a sequence of
/// files, each given by the hash of its path, its size, its modification time (ns) and the
/// byte range read: a rewritten file has another size or time, and misses.
pub(crate) fn files_key(
    schema: u64,
    column: usize,
    files: impl Iterator<Item = (u64, u64, i64, (u64, u64))>,
) -> CacheKey {
    let mut key = vec![(FILES, schema as usize), (column, 0)];
    for (path, size, modified, (start, end)) in files {
        key.push((path as usize, size as usize));
        key.push((modified as usize, 0));
        key.push((start as usize, end as usize));
    }
    key
}

/// No host address: the last word of a key made by [`prefix_key`].
const PREFIX: usize = usize::MAX - 2;

/// The key of the prefix words of the string column whose own key is `key` (the device's
/// image of a string sort key, see `keys::prefix_words`): another entry than the column's.
pub(crate) fn prefix_key(mut key: CacheKey) -> CacheKey {
    key.push((PREFIX, 16));
    key
}

/// The key of the bytes image (row ends and bytes) of the string column whose own key is
/// `key`, which the string predicates read: another entry than the column's or its prefix
/// words'.
pub(crate) fn strings_key(mut key: CacheKey) -> CacheKey {
    key.push((PREFIX, 8));
    key
}

/// The key of the codes image (an order-preserving i64 a row) of the string column whose own
/// key is `key`, which the aggregation groups string keys by.
pub(crate) fn codes_key(mut key: CacheKey) -> CacheKey {
    key.push((PREFIX, 24));
    key
}

/// Whether `key` names a column by identity (its words are no host addresses).
fn by_identity(key: &CacheKey) -> bool {
    matches!(key.first(), Some(&(TABLE | FILES, _)))
}

fn of_table(key: &CacheKey, table: u64) -> bool {
    key.first() == Some(&(TABLE, table as usize))
}

/// One cached column: its device image and where each part (values, validity) starts in it.
pub(crate) struct CacheEntry {
    buffer: PooledBuffer,
    offsets: Vec<usize>,
    bytes: usize,
    /// The host buffers the key's addresses belong to, kept so the addresses stay theirs.
    _owners: Vec<Buffer>,
    /// The column's name and the table's batches it holds, for the cache listing.
    column: String,
    chunks: usize,
    last_use: AtomicU64,
    users: AtomicUsize,
    /// Loaded ahead by its table ([`crate::GpuTable::load`]): never evicted while set.
    pinned: AtomicBool,
    /// Each chunk's least and greatest value and NULLs, worked out when first asked for
    /// (`None`: not for this column's type).
    zones: OnceLock<Option<Arc<ChunkZones>>>,
    /// Set once their derivation started.
    deriving: AtomicBool,
    /// A string column's prefix image: the bytes of its prefix words that tell its values
    /// apart exactly (`input::strings::exact_prefix_bytes`: the longest value where every value is
    /// its own prefix word, or a whole word where few distinct values differ within it), else
    /// `None`.
    short_bytes: Option<u32>,
}

/// Where the zones of one cache entry go once worked out ([`ColumnCache::zones`]).
pub(crate) struct ZonesSlot(Arc<CacheEntry>);

impl ZonesSlot {
    /// Keeps `zones` with the entry (`None`: the column has none).
    pub(crate) fn fill(self, zones: Option<ChunkZones>) {
        let _ = self.0.zones.set(zones.map(Arc::new));
    }
}

/// What each chunk (batch) of a cached column holds, for skipping those that cannot pass a
/// query's filter: one entry per chunk in each array.
#[derive(Debug)]
pub struct ChunkZones {
    pub mins: ArrayRef,
    pub maxs: ArrayRef,
    /// NULLs per chunk (`UInt64`).
    pub nulls: ArrayRef,
    /// Rows per chunk (`UInt64`).
    pub rows: ArrayRef,
}

impl CacheEntry {
    fn evictable(&self) -> bool {
        self.users.load(Ordering::Acquire) == 0 && !self.pinned.load(Ordering::Relaxed)
    }
}

impl CacheEntry {
    /// Device bytes of the image.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device address of each part.
    pub(crate) fn addresses(&self) -> Vec<u64> {
        let base = self.buffer.ptr();
        self.offsets.iter().map(|&o| base + o as u64).collect()
    }
}

/// What [`ColumnCache::insert`] adds.
pub(crate) struct NewEntry {
    pub buffer: PooledBuffer,
    /// Where each part (values, validity) starts in the buffer.
    pub offsets: Vec<usize>,
    /// The host buffers the key's addresses belong to.
    pub owners: Vec<Buffer>,
    pub column: String,
    pub chunks: usize,
    pub pinned: bool,
    /// [`CacheEntry::short_bytes`] (`None` for other images).
    pub short_bytes: Option<u32>,
}

/// A use of an entry by one selection: the entry cannot be evicted until it is dropped.
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
    pub column: String,
    /// The table's batches the entry holds.
    pub chunks: usize,
    pub bytes: usize,
    /// The cache's clock at the entry's last use (higher: more recent).
    pub last_use: u64,
    pub in_use: bool,
    pub pinned: bool,
}

/// A multiply-rotate hash (FxHash's): a whole table's key has two words per batch, hashed on
/// every query, and host addresses need no defence against collisions chosen by an attacker.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }
}

type KeyHash = std::hash::BuildHasherDefault<KeyHasher>;

#[derive(Default)]
struct State {
    entries: HashMap<CacheKey, Arc<CacheEntry>, KeyHash>,
    /// How many entries hold each host slice address, for [`ColumnCache::holds`].
    slices: HashMap<usize, usize>,
    /// Bytes of the entries, and of the room reserved for entries being uploaded.
    bytes: usize,
}

/// The budget [`set_column_cache_budget`] asked for, for a device opened later too
/// (`usize::MAX`: none asked, the default). Process-wide: the caches it bounds are.
static REQUESTED_BUDGET: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Sets the device column cache's budget for the process: the device bytes every cached
/// column together may hold on each device (`None`: a quarter of the device's memory, the
/// default; `Some(0)`: nothing is cached). It applies to every session and every device at
/// once, now and to a device opened later; entries beyond a smaller budget that no query is
/// reading are evicted, least recently used first. A session turns the cache off for its own
/// queries with `gpu_topk.column_cache`.
pub fn set_column_cache_budget(bytes: Option<usize>) {
    REQUESTED_BUDGET.store(bytes.unwrap_or(usize::MAX), Ordering::Release);
    super::gpu(); // started, so that it too gets the budget now
    for device in super::opened_devices() {
        device
            .column_cache
            .set_budget(process_budget(device.total_memory));
    }
}

/// The budget of a cache on a device of `device_memory` bytes: the process's
/// ([`set_column_cache_budget`]), else a quarter of that memory.
fn process_budget(device_memory: usize) -> usize {
    match REQUESTED_BUDGET.load(Ordering::Acquire) {
        usize::MAX => device_memory / 4,
        requested => requested,
    }
}

/// The device column cache's budget now (`None`: no GPU).
pub fn column_cache_budget() -> Option<usize> {
    super::gpu().map(|device| device.column_cache.budget())
}

/// See the module documentation. One per device.
pub struct ColumnCache {
    state: Mutex<State>,
    clock: AtomicU64,
    /// Device bytes all entries together may hold.
    budget: AtomicUsize,
    /// Set while a background load fills the cache ([`ColumnCache::start_loading`]).
    loading: AtomicBool,
    /// The device whose cache this is (planning's observations name it).
    slot: super::DeviceSlot,
}

/// A background load of columns into the cache; the next may start once it is dropped.
pub(crate) struct Loading<'a>(&'a AtomicBool);

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
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
    /// An empty cache on a device of `device_memory` bytes: its budget is the process's
    /// ([`set_column_cache_budget`]), else a quarter of that memory.
    pub(crate) fn new(device_memory: usize, slot: super::DeviceSlot) -> Self {
        Self {
            state: Mutex::default(),
            clock: AtomicU64::new(0),
            budget: AtomicUsize::new(process_budget(device_memory)),
            loading: AtomicBool::new(false),
            slot,
        }
    }

    /// Device bytes all entries together may hold.
    pub fn budget(&self) -> usize {
        self.budget.load(Ordering::Acquire)
    }

    /// Sets the budget, evicting the least recently used entries no query is reading (and no
    /// table pinned) until the entries fit it.
    fn set_budget(&self, bytes: usize) {
        self.budget.store(bytes, Ordering::Release);
        super::planning_changed();
        let mut state = self.state();
        while state.bytes > bytes && evict_oldest(&mut state) {}
    }

    /// Starts the one background load of columns ([`Loading`]); `None` while another runs.
    pub(crate) fn start_loading(&self) -> Option<Loading<'_>> {
        let busy = self.loading.swap(true, Ordering::AcqRel);
        (!busy).then_some(Loading(&self.loading))
    }

    /// Whether a background load is filling the cache.
    pub fn loading(&self) -> bool {
        self.loading.load(Ordering::Acquire)
    }

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

    /// Reserves `bytes` for a new entry within the budget, evicting the least recently used
    /// entries no query is reading; `false` when that cannot make room.
    pub(crate) fn reserve(&self, bytes: usize) -> bool {
        self.reserve_within(bytes, self.budget())
    }

    /// As [`reserve`](Self::reserve) for an entry a table pins: the application chose to
    /// keep it, so no budget bounds it (device memory still does).
    pub(crate) fn reserve_pinned(&self, bytes: usize) -> bool {
        self.reserve_within(bytes, usize::MAX)
    }

    fn reserve_within(&self, bytes: usize, budget: usize) -> bool {
        if bytes == 0 || bytes > budget {
            return false;
        }
        let mut state = self.state();
        while state.bytes + bytes > budget {
            if !evict_oldest(&mut state) {
                return false;
            }
        }
        state.bytes += bytes;
        true
    }

    /// Gives back a reservation that did not become an entry.
    pub(crate) fn unreserve(&self, bytes: usize) {
        let mut state = self.state();
        state.bytes = state.bytes.saturating_sub(bytes);
    }

    /// Adds an entry for `key` whose room was reserved, once the selection that uploaded it
    /// has finished (so others only ever see complete entries). A concurrent insert of the same
    /// key keeps the first.
    pub(crate) fn insert(&self, key: CacheKey, new: NewEntry) {
        let bytes = new.buffer.bytes();
        let pinned = new.pinned;
        let entry = Arc::new(CacheEntry {
            buffer: new.buffer,
            offsets: new.offsets,
            bytes,
            _owners: new.owners,
            column: new.column,
            chunks: new.chunks,
            last_use: AtomicU64::new(self.tick()),
            users: AtomicUsize::new(0),
            pinned: AtomicBool::new(pinned),
            zones: OnceLock::new(),
            deriving: AtomicBool::new(false),
            short_bytes: new.short_bytes,
        });
        let mut state = self.state();
        match state.entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(slot) => {
                if pinned {
                    slot.get().pinned.store(true, Ordering::Relaxed);
                }
                state.bytes = state.bytes.saturating_sub(bytes);
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                let addresses: Vec<usize> = match by_identity(slot.key()) {
                    true => Vec::new(),
                    false => slot.key().iter().map(|&(a, _)| a).collect(),
                };
                slot.insert(entry);
                for address in addresses.into_iter().filter(|&a| a != 0) {
                    *state_slices(&mut state.slices, address) += 1;
                }
            }
        }
    }

    /// Evicts every entry no query is reading and no table pinned; returns how many.
    pub fn clear(&self) -> usize {
        self.evict_where(|_, e| e.evictable())
    }

    /// Evicts the entries of a `GpuTable` that is gone (none is in use: a query using them
    /// holds the table).
    pub(crate) fn forget_table(&self, table: u64) {
        self.evict_where(|key, e| of_table(key, table) && e.users.load(Ordering::Acquire) == 0);
    }

    /// Pins the entry for `key`, if there is one; returns its bytes.
    pub(crate) fn pin(&self, key: &CacheKey) -> Option<usize> {
        let state = self.state();
        let entry = state.entries.get(key)?;
        entry.pinned.store(true, Ordering::Relaxed);
        Some(entry.bytes)
    }

    /// Marks a `GpuTable`'s entries `pinned` or not.
    pub(crate) fn pin_table(&self, table: u64, pinned: bool) {
        for (key, e) in self.state().entries.iter() {
            if of_table(key, table) {
                e.pinned.store(pinned, Ordering::Relaxed);
            }
        }
    }

    fn evict_where(&self, evict: impl Fn(&CacheKey, &CacheEntry) -> bool) -> usize {
        let mut state = self.state();
        let before = state.entries.len();
        let (mut freed, mut gone) = (0, Vec::new());
        state.entries.retain(|key, e| {
            let keep = !evict(key, e);
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

    /// The chunk zones of the entry for `key` where they are worked out; `None` without an
    /// entry, or until then. The first ask calls `derive` with the slot to fill (the caller
    /// works them out off the query's path).
    pub(crate) fn zones(
        &self,
        key: &CacheKey,
        derive: impl FnOnce(ZonesSlot),
    ) -> Option<Arc<ChunkZones>> {
        let entry = Arc::clone(self.state().entries.get(key)?);
        if let Some(zones) = entry.zones.get() {
            return zones.clone();
        }
        if !entry.deriving.swap(true, Ordering::AcqRel) {
            derive(ZonesSlot(entry));
        }
        None
    }

    /// Whether the cache has an entry for `key` (without using it); planning's answers are
    /// observed (`observe_planning`).
    pub(crate) fn contains(&self, key: &CacheKey) -> bool {
        let held = self.holds_key(key);
        super::observed(|o| o.resident.push((self.slot, key.clone(), held)));
        held
    }

    /// Where the cache holds `key` (a string column's prefix image): the longest value of the
    /// column if every value is short enough to be its own prefix word, else `Some(None)`.
    /// `None` where the cache does not hold it; observed as [`contains`](Self::contains) is.
    pub(crate) fn short_bytes(&self, key: &CacheKey) -> Option<Option<u32>> {
        let short = self.state().entries.get(key).map(|e| e.short_bytes);
        super::observed(|o| o.resident.push((self.slot, key.clone(), short.is_some())));
        short
    }

    /// [`contains`](Self::contains), unobserved.
    pub(crate) fn holds_key(&self, key: &CacheKey) -> bool {
        self.state().entries.contains_key(key)
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
            .values()
            .map(|e| CacheListing {
                column: e.column.clone(),
                chunks: e.chunks,
                bytes: e.bytes,
                last_use: e.last_use.load(Ordering::Relaxed),
                in_use: e.users.load(Ordering::Acquire) > 0,
                pinned: e.pinned.load(Ordering::Relaxed),
            })
            .collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.last_use));
        all
    }
}

/// Evicts the least recently used entry no query is reading and no table pinned; `false`
/// where there is none.
fn evict_oldest(state: &mut State) -> bool {
    let victim = state
        .entries
        .iter()
        .filter(|(_, e)| e.evictable())
        .min_by_key(|(_, e)| e.last_use.load(Ordering::Relaxed))
        .map(|(k, _)| k.clone());
    let Some(victim) = victim else {
        return false;
    };
    let entry = state.entries.remove(&victim).expect("found above");
    state.bytes -= entry.bytes;
    forget_slices(&mut state.slices, &victim);
    true
}

fn state_slices(slices: &mut HashMap<usize, usize>, address: usize) -> &mut usize {
    slices.entry(address).or_insert(0)
}

fn forget_slices(slices: &mut HashMap<usize, usize>, key: &CacheKey) {
    if by_identity(key) {
        return;
    }
    for (address, _) in key {
        if let Some(n) = slices.get_mut(address) {
            *n -= 1;
            if *n == 0 {
                slices.remove(address);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget is the cache's own: reservations are bounded by it, and a smaller budget
    /// takes effect at once; an entry a table pins is bounded by no budget.
    #[test]
    fn reservations_are_bounded_by_the_caches_own_budget() {
        let cache = ColumnCache::new(4 << 20, Default::default()); // a quarter: 1 MiB
        assert_eq!(cache.budget(), 1 << 20);
        assert!(cache.reserve(600 << 10));
        assert!(
            !cache.reserve(600 << 10),
            "over the budget, nothing to evict"
        );
        cache.unreserve(600 << 10);
        cache.set_budget(512 << 10);
        assert_eq!(cache.budget(), 512 << 10);
        assert!(!cache.reserve(600 << 10));
        assert!(cache.reserve(500 << 10));
        assert!(cache.reserve_pinned(8 << 20));
        assert_eq!(cache.bytes(), (500 << 10) + (8 << 20));
        cache.set_budget(0);
        assert!(!cache.reserve(1));
    }

    /// One background load at a time; the next may start once it is done.
    #[test]
    fn one_background_load_at_a_time() {
        let cache = ColumnCache::new(1 << 20, Default::default());
        let first = cache.start_loading().expect("idle");
        assert!(cache.loading());
        assert!(cache.start_loading().is_none());
        drop(first);
        assert!(!cache.loading());
        assert!(cache.start_loading().is_some());
    }
}
