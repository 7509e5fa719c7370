//! Ageing out: the first-seen floor and the compaction filter that applies it.
//!
//! The store keeps one number, the *floor*: every key whose `first_seen_ms`
//! is at or below it is gone. `age_out` raises it (never lowers it) to the
//! larger of `now - horizon` and the floor the size cap asks for; reads hide
//! keys at or below it at once, and compactions drop them physically through
//! [`FloorFilter`] — no tombstones, no scans. Why this mechanism and not
//! time-bucketed column families is in the module doc of `keystore`.

use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use rocksdb::compaction_filter::{CompactionFilter, Decision};
use rocksdb::compaction_filter_factory::{CompactionFilterContext, CompactionFilterFactory};

use super::codec::value_first_seen_ms;

/// The floor shared by the store (which raises it) and every compaction
/// (which reads it once when it starts).
#[derive(Clone, Debug)]
pub(crate) struct Floor {
    /// Atomics rather than a lock: compactions run on RocksDB's threads and
    /// must never wait on the store's write lock; a compaction that starts
    /// just before a raise simply keeps a few keys for the next compaction.
    pub ms: Arc<AtomicI64>,
    /// Keys dropped by compactions since open (for the benchmark and logs).
    pub reclaimed: Arc<AtomicU64>,
}

impl Floor {
    pub(crate) fn new(ms: i64) -> Floor {
        Floor { ms: Arc::new(AtomicI64::new(ms)), reclaimed: Arc::new(AtomicU64::new(0)) }
    }

    pub(crate) fn get(&self) -> i64 {
        self.ms.load(Ordering::Acquire)
    }

    pub(crate) fn raise_to(&self, ms: i64) {
        self.ms.fetch_max(ms, Ordering::AcqRel);
    }
}

/// Creates one [`FloorFilter`] per compaction, with the floor of that moment.
pub(crate) struct FloorFilterFactory {
    floor: Floor,
    name: CString,
}

impl FloorFilterFactory {
    pub(crate) fn new(floor: Floor) -> FloorFilterFactory {
        FloorFilterFactory { floor, name: c"dedupd.keystore.floor_factory.v1".to_owned() }
    }
}

impl CompactionFilterFactory for FloorFilterFactory {
    type Filter = FloorFilter;

    fn create(&mut self, _context: CompactionFilterContext) -> FloorFilter {
        FloorFilter {
            floor_ms: self.floor.get(),
            removed: 0,
            reclaimed: Arc::clone(&self.floor.reclaimed),
            name: c"dedupd.keystore.floor.v1".to_owned(),
        }
    }

    fn name(&self) -> &CStr {
        self.name.as_c_str()
    }
}

/// Drops keys at or below the floor as a compaction rewrites them. At the
/// bottommost level a dropped key simply vanishes; above it RocksDB turns the
/// drop into a point tombstone, but keys that old are almost all in the
/// bottommost level already, so tombstones stay rare.
pub(crate) struct FloorFilter {
    floor_ms: i64,
    removed: u64,
    reclaimed: Arc<AtomicU64>,
    name: CString,
}

impl CompactionFilter for FloorFilter {
    fn filter(&mut self, _level: u32, _key: &[u8], value: &[u8]) -> Decision {
        match value_first_seen_ms(value) {
            Some(first_seen_ms) if first_seen_ms <= self.floor_ms => {
                self.removed += 1;
                Decision::Remove
            }
            // Unreadable values are kept: reads report them as corrupt, a
            // compaction must never silently destroy evidence.
            _ => Decision::Keep,
        }
    }

    fn name(&self) -> &CStr {
        self.name.as_c_str()
    }
}

impl Drop for FloorFilter {
    fn drop(&mut self) {
        self.reclaimed.fetch_add(self.removed, Ordering::Relaxed);
    }
}
