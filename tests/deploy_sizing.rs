//! The memory figure deploy/k8s is sized from (docs/runbook.md#resource-sizing):
//! a hot-cache entry costs at most 96 bytes of heap. The pod's memory request
//! is `hot_capacity x 96 B x partitions per pod` plus fixed budgets, so a cache
//! that outgrew 96 B per entry would get pods OOM-killed at full capacity.
//!
//! Measured with a counting global allocator (every byte the process asks the
//! allocator for), not with the cache's own `heap_bytes()` estimate. This file
//! holds a single test so no other test's allocations run concurrently and
//! blur the count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dedupd::classify::{HotCache, SeenKey};
use dedupd::event::{IdHash, PayloadHash, Position};

/// The per-entry budget the runbook's sizing table and deploy/k8s use.
const BUDGET_BYTES_PER_ENTRY: usize = 96;

/// Counts the bytes currently allocated through the global allocator.
struct CountingAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counter only observes sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// A key whose id looks like blake3 output (the cache uses the id's low 64
/// bits as its hash directly, so ids must be well mixed, as real ones are).
fn key(n: u64, first_seen_ms: i64) -> SeenKey {
    let mixed = (n ^ 0x5851_F42D_4C95_7F2D).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&mixed.to_le_bytes());
    id[8..].copy_from_slice(&n.to_le_bytes());
    SeenKey {
        id_hash: IdHash(id),
        payload_hash: PayloadHash([7; 16]),
        first_seen_ms,
        source: Position::new(0, n as i64),
        output: Position::new(0, n as i64),
    }
}

/// Fills a cache of `capacity` keys `rounds` times over (evicting the oldest
/// at capacity, as a busy partition does) and returns the heap bytes per
/// remembered key at the end.
fn bytes_per_entry(capacity: usize, rounds: u64) -> (f64, usize) {
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let mut cache = HotCache::new(0, 7 * 86_400_000, capacity);
    let now_ms = 1_800_000_000_000;
    for n in 0..capacity as u64 * rounds {
        cache.insert(&key(n, now_ms), now_ms);
    }
    let used = LIVE_BYTES.load(Ordering::Relaxed).saturating_sub(before);
    assert_eq!(cache.len(), capacity, "the cache should be full");
    let estimate = cache.heap_bytes();
    drop(cache);
    (used as f64 / capacity as f64, estimate)
}

#[test]
fn a_full_hot_cache_stays_within_the_96_byte_per_entry_budget_the_pods_are_sized_from() {
    // 2M is deploy/k8s's hot_capacity; 1M and 1.5M put the table at other
    // load factors (hashbrown grows by doubling, so the cost per entry
    // depends on where the capacity falls between two powers of two).
    for capacity in [1_000_000usize, 1_500_000, 2_000_000] {
        let (per_entry, estimate) = bytes_per_entry(capacity, 3);
        println!(
            "hot cache, capacity {capacity}: {per_entry:.1} heap bytes per entry \
             (heap_bytes() estimate {:.1})",
            estimate as f64 / capacity as f64
        );
        assert!(
            per_entry <= BUDGET_BYTES_PER_ENTRY as f64,
            "capacity {capacity}: {per_entry:.1} bytes per entry exceeds the {BUDGET_BYTES_PER_ENTRY}-byte budget \
             that deploy/k8s memory requests assume (docs/runbook.md#resource-sizing)"
        );
    }
}
