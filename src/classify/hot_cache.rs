//! The hot cache: recent keys of one partition, in memory.
//!
//! ```text
//! table: HashTable<u64 seq>         ring of entries in insertion order, in chunks
//!   hash = low 64 bits of id_hash   ┌────────┬────────┬─────┐
//!   value = sequence number  ─────► │chunk 0 │chunk 1 │ ... │  head_seq .. next_seq
//!                                   └────────┴────────┴─────┘
//! entry (56 bytes): id_hash 16 | payload_hash 16 | first_seen_ms 8 | source_offset 8 | output_offset 8
//! ```
//!
//! Why this shape: the issue budget is 96 bytes per remembered key. A
//! `HashMap<IdHash, Value>` plus a separate eviction queue costs ~130 bytes at
//! the low point of the table's load factor. Here each key lives once, in a
//! ring that is also the eviction order; the table holds only an 8-byte
//! sequence number per slot. Ids are blake3 output, so their low 64 bits are
//! used as the table hash directly, with no hashing work.
//!
//! Eviction is oldest-first, by insertion order, for both the TTL and the
//! capacity bound. Insertion order is `first_seen_ms` order while the clock
//! moves forward; if it steps back, an entry may outlive its TTL until the
//! entries ahead of it expire. Lookups still check the TTL, so a stale entry is
//! never reported, it only occupies memory a little longer.
//!
//! The cache is per partition (the partition is implied, not stored), so a
//! revoked partition's memory is released by dropping its cache.

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::classify::seen::SeenKey;
use crate::event::{IdHash, PayloadHash, Position};

const MAX_CHUNK_ENTRIES: usize = 1 << 16;

#[derive(Clone, Copy)]
struct Entry {
    id_hash: IdHash,
    payload_hash: PayloadHash,
    first_seen_ms: i64,
    source_offset: i64,
    output_offset: i64,
}

/// Recent keys of one partition, bounded by a TTL and a capacity.
pub struct HotCache {
    partition: i32,
    ttl_ms: i64,
    capacity: usize,
    chunk_entries: usize,
    table: HashTable<u64>,
    chunks: VecDeque<Vec<Entry>>,
    /// Sequence number of `chunks[0][0]`.
    first_chunk_seq: u64,
    /// Sequence number of the oldest live entry.
    head_seq: u64,
    /// Sequence number the next insert gets.
    next_seq: u64,
    /// Keys dropped so far, by why.
    evictions: HotEvictions,
}

/// Keys a hot cache dropped, by cause. A key dropped at capacity was still
/// within its TTL: the cache's window is then shorter than the TTL, and its
/// retries are found only in the key store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HotEvictions {
    /// Past the TTL.
    pub expired: u64,
    /// Pushed out by a new key while the cache was full.
    pub at_capacity: u64,
}

impl std::ops::Add for HotEvictions {
    type Output = HotEvictions;

    fn add(self, other: HotEvictions) -> HotEvictions {
        HotEvictions { expired: self.expired + other.expired, at_capacity: self.at_capacity + other.at_capacity }
    }
}

impl std::fmt::Debug for HotCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotCache")
            .field("partition", &self.partition)
            .field("ttl_ms", &self.ttl_ms)
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl HotCache {
    /// A cache for `partition` keeping keys for `ttl_ms` after first seen, at
    /// most `capacity` of them (a capacity of 0 is treated as 1).
    pub fn new(partition: i32, ttl_ms: i64, capacity: usize) -> HotCache {
        let capacity = capacity.max(1);
        HotCache {
            partition,
            ttl_ms,
            capacity,
            chunk_entries: capacity.min(MAX_CHUNK_ENTRIES),
            table: HashTable::new(),
            chunks: VecDeque::new(),
            first_chunk_seq: 0,
            head_seq: 0,
            next_seq: 0,
            evictions: HotEvictions::default(),
        }
    }

    /// Keys dropped since the cache was made.
    pub fn evictions(&self) -> HotEvictions {
        self.evictions
    }

    pub fn partition(&self) -> i32 {
        self.partition
    }

    pub fn len(&self) -> usize {
        (self.next_seq - self.head_seq) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn ttl_ms(&self) -> i64 {
        self.ttl_ms
    }

    fn entry(&self, seq: u64) -> &Entry {
        let rel = (seq - self.first_chunk_seq) as usize;
        &self.chunks[rel / self.chunk_entries][rel % self.chunk_entries]
    }

    fn is_live(&self, e: &Entry, now_ms: i64) -> bool {
        e.first_seen_ms.saturating_add(self.ttl_ms) > now_ms
    }

    /// The remembered key for `id_hash`, if it is still inside the TTL.
    pub fn get(&self, id_hash: &IdHash, now_ms: i64) -> Option<SeenKey> {
        let seq = self.find_seq(id_hash)?;
        let e = self.entry(seq);
        if !self.is_live(e, now_ms) {
            return None;
        }
        Some(self.to_seen(e))
    }

    fn find_seq(&self, id_hash: &IdHash) -> Option<u64> {
        let chunks = &self.chunks;
        let first = self.first_chunk_seq;
        let per = self.chunk_entries;
        self.table
            .find(id_hash.low_u64(), |&seq| {
                let rel = (seq - first) as usize;
                chunks[rel / per][rel % per].id_hash == *id_hash
            })
            .copied()
    }

    fn to_seen(&self, e: &Entry) -> SeenKey {
        SeenKey {
            id_hash: e.id_hash,
            payload_hash: e.payload_hash,
            first_seen_ms: e.first_seen_ms,
            source: Position::new(self.partition, e.source_offset),
            output: Position::new(self.partition, e.output_offset),
        }
    }

    /// Makes room for `additional` more keys (up to the capacity) at once.
    /// A start that recovers millions of keys from the sidecars otherwise
    /// grows the table by doubling, moving every key each time: a quarter
    /// of opening a state directory of 2M events (perf, 2026-11-29).
    pub fn reserve(&mut self, additional: usize) {
        let room = additional.min(self.capacity.saturating_sub(self.len()));
        let (chunks, first, per) = (&self.chunks, self.first_chunk_seq, self.chunk_entries);
        self.table.reserve(room, |&s| {
            let rel = (s - first) as usize;
            chunks[rel / per][rel % per].id_hash.low_u64()
        });
    }

    /// Remembers `key` unless its id is already remembered (applying the same
    /// key twice is a no-op, which keeps repair idempotent) or it is already
    /// past the TTL. Evicts expired keys and, at capacity, the oldest key.
    /// Returns whether the key was inserted.
    pub fn insert(&mut self, key: &SeenKey, now_ms: i64) -> bool {
        self.evict_expired(now_ms);
        if key.first_seen_ms.saturating_add(self.ttl_ms) <= now_ms {
            return false;
        }
        if self.len() >= self.capacity {
            // Only a key not remembered yet may push the oldest out.
            if self.find_seq(&key.id_hash).is_some() {
                return false;
            }
            self.evict_oldest();
            self.evictions.at_capacity += 1;
        }
        let seq = self.next_seq;
        // Below capacity, one probe of the table both finds a key remembered already and
        // the slot a new one goes in: a new key's probe is a cache miss or
        // two in a table of millions, and looking twice (find, then insert)
        // was a third of the insert.
        let chunks = &self.chunks;
        let first = self.first_chunk_seq;
        let per = self.chunk_entries;
        let at = |s: u64| {
            let rel = (s - first) as usize;
            &chunks[rel / per][rel % per]
        };
        match self.table.entry(key.id_hash.low_u64(), |&s| at(s).id_hash == key.id_hash, |&s| at(s).id_hash.low_u64()) {
            hashbrown::hash_table::Entry::Occupied(_) => return false,
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(seq);
            }
        }
        let rel = (seq - self.first_chunk_seq) as usize;
        if rel / self.chunk_entries == self.chunks.len() {
            self.chunks.push_back(Vec::with_capacity(self.chunk_entries));
        }
        let entry = Entry {
            id_hash: key.id_hash,
            payload_hash: key.payload_hash,
            first_seen_ms: key.first_seen_ms,
            source_offset: key.source.offset,
            output_offset: key.output.offset,
        };
        if let Some(chunk) = self.chunks.back_mut() {
            chunk.push(entry);
        }
        self.next_seq += 1;
        true
    }

    /// Drops every key whose TTL has passed, oldest first; stops at the first
    /// live key (see the module doc for clocks that step back).
    pub fn evict_expired(&mut self, now_ms: i64) -> usize {
        let mut evicted = 0;
        while self.head_seq < self.next_seq {
            let e = *self.entry(self.head_seq);
            if self.is_live(&e, now_ms) {
                break;
            }
            self.evict_oldest();
            evicted += 1;
        }
        self.evictions.expired += evicted as u64;
        evicted
    }

    fn evict_oldest(&mut self) {
        if self.head_seq == self.next_seq {
            return;
        }
        let seq = self.head_seq;
        let hash = self.entry(seq).id_hash.low_u64();
        if let Ok(found) = self.table.find_entry(hash, |&s| s == seq) {
            found.remove();
        }
        self.head_seq += 1;
        if self.head_seq - self.first_chunk_seq == self.chunk_entries as u64 {
            self.chunks.pop_front();
            self.first_chunk_seq += self.chunk_entries as u64;
        }
        if self.head_seq == self.next_seq {
            // Empty: start the ring over so the last chunk is released too.
            self.chunks.clear();
            self.first_chunk_seq = self.head_seq;
        }
    }

    /// First-seen time of the oldest key still remembered (for the dedupe
    /// window metric).
    pub fn oldest_first_seen_ms(&self) -> Option<i64> {
        if self.is_empty() {
            None
        } else {
            Some(self.entry(self.head_seq).first_seen_ms)
        }
    }

    /// Every remembered key, oldest first (for tests and snapshots).
    pub fn iter(&self) -> impl Iterator<Item = SeenKey> + '_ {
        (self.head_seq..self.next_seq).map(move |s| self.to_seen(self.entry(s)))
    }

    /// Heap bytes held: the ring's chunks plus the table's slots and control
    /// bytes. An estimate of the allocator's view, used by the metrics.
    pub fn heap_bytes(&self) -> usize {
        let ring = self.chunks.iter().map(|c| c.capacity()).sum::<usize>() * std::mem::size_of::<Entry>();
        let slots = self.table.capacity();
        let buckets = if slots == 0 { 0 } else { (slots * 8 / 7).next_power_of_two() };
        ring + buckets * (std::mem::size_of::<u64>() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64, payload: u8, first_seen_ms: i64) -> SeenKey {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
        id[8..].copy_from_slice(&n.to_le_bytes());
        SeenKey {
            id_hash: IdHash(id),
            payload_hash: PayloadHash([payload; 16]),
            first_seen_ms,
            source: Position::new(3, n as i64),
            output: Position::new(3, 100 + n as i64),
        }
    }

    #[test]
    fn entry_is_56_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 56);
    }

    /// A commit of many keys grows the table once, never by doubling
    /// under them, and never beyond what the capacity lets in.
    #[test]
    fn a_reserved_table_takes_its_keys_without_growing() {
        let mut c = HotCache::new(3, i64::MAX / 2, 50_000);
        c.insert(&key(0, 1, 10), 10);
        c.reserve(40_000);
        let room = c.table.capacity();
        assert!(room >= 40_001, "{room}");
        for n in 1..=40_000 {
            c.insert(&key(n, 1, 10), 10);
        }
        assert_eq!(c.table.capacity(), room, "the table grew under the keys it had room for");
        // Near the capacity, room for what it may still take only.
        let mut small = HotCache::new(3, i64::MAX / 2, 100);
        small.reserve(1_000_000);
        assert!(small.table.capacity() < 1_000, "{}", small.table.capacity());
        let mut model = HotCache::new(3, i64::MAX / 2, 100);
        for n in 0..300 {
            small.insert(&key(n, 1, n as i64), 10);
            model.insert(&key(n, 1, n as i64), 10);
        }
        for n in 0..300 {
            assert_eq!(small.get(&key(n, 1, 0).id_hash, 10), model.get(&key(n, 1, 0).id_hash, 10));
        }
    }

    #[test]
    fn remembers_until_ttl_then_forgets() {
        let mut c = HotCache::new(3, 1000, 10);
        let k = key(1, 7, 5_000);
        assert!(c.insert(&k, 5_000));
        assert_eq!(c.get(&k.id_hash, 5_999), Some(k));
        assert_eq!(c.get(&k.id_hash, 6_000), None);
        assert_eq!(c.evict_expired(6_000), 1);
        assert!(c.is_empty());
    }

    #[test]
    fn capacity_evicts_oldest_first() {
        let mut c = HotCache::new(3, i64::MAX / 2, 3);
        for n in 0..5 {
            c.insert(&key(n, 1, n as i64), 10);
        }
        assert_eq!(c.len(), 3);
        assert!(c.get(&key(0, 1, 0).id_hash, 10).is_none());
        assert!(c.get(&key(1, 1, 1).id_hash, 10).is_none());
        for n in 2..5 {
            assert!(c.get(&key(n, 1, n as i64).id_hash, 10).is_some(), "key {n}");
        }
        assert_eq!(c.oldest_first_seen_ms(), Some(2));
    }

    #[test]
    fn evictions_are_counted_by_cause() {
        // Capacity 3, TTL 1000: five keys at t=0 push two out at capacity;
        // at t=1000 the three left expire.
        let mut c = HotCache::new(3, 1000, 3);
        for n in 0..5 {
            assert!(c.insert(&key(n, 1, 0), 0));
        }
        assert_eq!(c.evictions(), HotEvictions { expired: 0, at_capacity: 2 });
        assert_eq!(c.evict_expired(1000), 3);
        assert_eq!(c.evictions(), HotEvictions { expired: 3, at_capacity: 2 });
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn insert_of_known_id_is_a_no_op() {
        let mut c = HotCache::new(3, 1000, 10);
        assert!(c.insert(&key(1, 1, 0), 0));
        assert!(!c.insert(&key(1, 2, 5), 5));
        assert_eq!(c.get(&key(1, 1, 0).id_hash, 5).map(|k| k.payload_hash), Some(PayloadHash([1; 16])));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn already_expired_keys_are_not_inserted() {
        let mut c = HotCache::new(3, 1000, 10);
        assert!(!c.insert(&key(1, 1, 0), 1000));
        assert!(c.is_empty());
    }

    #[test]
    fn survives_many_chunk_boundaries() {
        let cap = 1000;
        let mut c = HotCache::new(0, i64::MAX / 2, cap);
        for n in 0..10_000u64 {
            c.insert(&key(n, 1, n as i64), 0);
            assert!(c.len() <= cap);
        }
        for n in 0..9_000u64 {
            assert!(c.get(&key(n, 1, 0).id_hash, 0).is_none());
        }
        for n in 9_000..10_000u64 {
            assert_eq!(c.get(&key(n, 1, 0).id_hash, 0).map(|k| k.source.offset), Some(n as i64));
        }
        assert_eq!(c.iter().count(), cap);
    }

    /// What the cache must do, kept naively: keys in insertion order,
    /// expired ones dropped from the front up to the first live one, the
    /// oldest pushed out at capacity, a known id never inserted again.
    #[derive(Default)]
    struct Model {
        keys: std::collections::VecDeque<SeenKey>,
    }

    impl Model {
        fn insert(&mut self, key: &SeenKey, ttl: i64, cap: usize, now: i64) -> bool {
            while self.keys.front().is_some_and(|k| k.first_seen_ms + ttl <= now) {
                self.keys.pop_front();
            }
            if key.first_seen_ms + ttl <= now || self.keys.iter().any(|k| k.id_hash == key.id_hash) {
                return false;
            }
            if self.keys.len() >= cap {
                self.keys.pop_front();
            }
            self.keys.push_back(*key);
            true
        }

        fn get(&self, id: &IdHash, ttl: i64, now: i64) -> Option<SeenKey> {
            self.keys.iter().find(|k| k.id_hash == *id).filter(|k| k.first_seen_ms + ttl > now).copied()
        }
    }

    proptest::proptest! {
        /// Inserts, lookups and a clock that moves (and sometimes steps
        /// back), against the model. Ids are drawn from a few low halves,
        /// so different ids share a table hash and the probe must compare
        /// whole ids; small capacities cross chunk boundaries often.
        #[test]
        fn behaves_as_the_model(
            cap in 1usize..12,
            ttl in 1i64..40,
            ops in proptest::collection::vec((0u8..3, 0u64..24, 0u64..3, 0i64..12, 0u8..3), 1..300),
        ) {
            let mut cache = HotCache::new(5, ttl, cap);
            let mut model = Model::default();
            let mut now = 100i64;
            for (op, n, low, back, payload) in ops {
                let mut k = key(n, payload, now - back);
                k.id_hash.0[..8].copy_from_slice(&low.to_le_bytes());
                k.source = Position::new(5, k.source.offset);
                k.output = Position::new(5, k.output.offset);
                match op {
                    0 => proptest::prop_assert_eq!(cache.insert(&k, now), model.insert(&k, ttl, cap, now)),
                    1 => proptest::prop_assert_eq!(cache.get(&k.id_hash, now), model.get(&k.id_hash, ttl, now)),
                    _ => now = if back == 0 { now - 3 } else { now + back },
                }
                proptest::prop_assert_eq!(cache.len(), model.keys.len());
            }
            proptest::prop_assert_eq!(cache.iter().collect::<Vec<_>>(), model.keys.iter().copied().collect::<Vec<_>>());
        }
    }
}
