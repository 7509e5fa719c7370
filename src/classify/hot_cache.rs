//! The hot cache: recent keys of one partition, in memory.
//!
//! ```text
//! table: HashTable<u64 slot>        ring of entries in insertion order, in chunks
//!   slot = tag 32 | seq 32          ┌────────┬────────┬─────┐
//!   tag = id_hash bytes 8..12       │chunk 0 │chunk 1 │ ... │  head_seq .. next_seq
//!   seq = sequence number  ───────► └────────┴────────┴─────┘
//!         (low 32 bits)
//! entry (56 bytes): id_hash 16 | payload_hash 16 | first_seen_ms 8 | source_offset 8 | output_offset 8
//! ```
//!
//! Why this shape: the issue budget is 96 bytes per remembered key. A
//! `HashMap<IdHash, Value>` plus a separate eviction queue costs ~130 bytes at
//! the low point of the table's load factor. Here each key lives once, in a
//! ring that is also the eviction order; the table holds only an 8-byte
//! slot per key: 32 bits of the id (the tag) beside the low 32 bits of the
//! key's sequence number. Ids are blake3 output, so the tag needs no hashing
//! work, only a multiply that spreads it over the 64 bits the table uses.
//! The tag is taken from bytes 8..12, not from the low 64 bits the default
//! partitioner reads (`low_u64 % partitions`): within one partition those
//! bits are not uniform (with 2^k partitions their low k bits are the
//! partition's number), and the table picks a key's bucket from its hash's
//! low bits, so a tag taken there would crowd a partition's keys into a
//! 2^k-th of the buckets. (Until 2026-11-29 the table hashed `low_u64`
//! itself and crowded them so.)
//!
//! Why the tag is in the slot: growing the table re-hashes every key, and
//! a table of sequence numbers alone had to read each key's entry in the
//! ring to do it, a cache miss per key. That was a tenth of the offline
//! path's time over a million new ids (perf, 2026-11-29). With the tag, a
//! growth reads the slots only, in order, and a lookup compares the tag
//! before it reads an entry.
//!
//! A slot holds 32 bits of the sequence number; the full number is the one
//! within 2^32 at or after `head_seq`. That is exact because a cache never
//! holds more than 2^32 - 1 keys ([`MAX_KEYS`]; `hot_capacity` is checked
//! against it).
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

/// The most keys one partition's hot cache holds: its slots number keys in
/// 32 bits. At 56 bytes an entry that is 240 GB, beyond any deployment.
pub const MAX_KEYS: usize = u32::MAX as usize;

/// The table's 64-bit hash of a tag. The multiply by an odd constant is a
/// bijection that carries every bit of the tag into the top seven (the
/// table's control byte); the low bits (the bucket) come from the tag's own
/// low bits, which are uniform because the tag is not what partitions
/// (see the module doc).
fn tag_hash(tag: u32) -> u64 {
    u64::from(tag).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn tag_of(id_hash: &IdHash) -> u32 {
    let b = &id_hash.0;
    u32::from_le_bytes([b[8], b[9], b[10], b[11]])
}

fn slot_of(tag: u32, seq: u64) -> u64 {
    (u64::from(tag) << 32) | (seq & 0xFFFF_FFFF)
}

fn slot_tag(slot: u64) -> u32 {
    (slot >> 32) as u32
}

fn slot_hash(slot: &u64) -> u64 {
    tag_hash(slot_tag(*slot))
}

/// The full sequence number of a slot's key: the one at or after `head_seq`
/// whose low 32 bits the slot holds (see the module doc).
fn slot_seq(slot: u64, head_seq: u64) -> u64 {
    head_seq + u64::from((slot as u32).wrapping_sub(head_seq as u32))
}

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
    /// most `capacity` of them (a capacity of 0 is treated as 1, one above
    /// [`MAX_KEYS`] as `MAX_KEYS`; the configuration refuses both).
    pub fn new(partition: i32, ttl_ms: i64, capacity: usize) -> HotCache {
        let capacity = capacity.clamp(1, MAX_KEYS);
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

    /// An empty cache whose first key gets sequence number `seq`, as if
    /// `seq` keys had come and gone: lets tests cross the 32-bit boundary
    /// of the slots' sequence numbers.
    #[cfg(test)]
    fn numbering_from(mut self, seq: u64) -> HotCache {
        assert!(self.is_empty());
        (self.first_chunk_seq, self.head_seq, self.next_seq) = (seq, seq, seq);
        self
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
        let tag = tag_of(id_hash);
        let head = self.head_seq;
        self.table
            .find(tag_hash(tag), |&slot| slot_tag(slot) == tag && self.entry(slot_seq(slot, head)).id_hash == *id_hash)
            .map(|&slot| slot_seq(slot, head))
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
        self.table.reserve(room, slot_hash);
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
        let tag = tag_of(&key.id_hash);
        let (chunks, first, per, head) = (&self.chunks, self.first_chunk_seq, self.chunk_entries, self.head_seq);
        let same_id = |&slot: &u64| {
            let rel = (slot_seq(slot, head) - first) as usize;
            slot_tag(slot) == tag && chunks[rel / per][rel % per].id_hash == key.id_hash
        };
        match self.table.entry(tag_hash(tag), same_id, slot_hash) {
            hashbrown::hash_table::Entry::Occupied(_) => return false,
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                vacant.insert(slot_of(tag, seq));
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
        let slot = slot_of(tag_of(&self.entry(seq).id_hash), seq);
        if let Ok(found) = self.table.find_entry(slot_hash(&slot), |&s| s == slot) {
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

    /// Keys numbered across 2^32, where the slots' sequence numbers wrap:
    /// each is found with its own entry, pushed out oldest first at
    /// capacity, and once below capacity a known id is still found by the
    /// insert's own probe; a growth of the table (which hashes the slots
    /// alone) loses none.
    #[test]
    fn keys_numbered_across_two_to_the_32_are_found_and_evicted_in_order() {
        let mut c = HotCache::new(3, 10_000, 1_000).numbering_from((1 << 32) - 500);
        for n in 0..1_500 {
            assert!(c.insert(&key(n, 1, n as i64), 1_500));
        }
        assert_eq!(c.len(), 1_000);
        assert_eq!(c.evictions().at_capacity, 500);
        for n in 0..500 {
            assert_eq!(c.get(&key(n, 1, n as i64).id_hash, 1_500), None, "key {n} was pushed out");
        }
        for n in 500..1_500 {
            assert_eq!(c.get(&key(n, 1, n as i64).id_hash, 1_500), Some(key(n, 1, n as i64)), "key {n}");
        }
        // Keys 500..=600 expire: below capacity, an insert finds a known id
        // in the same probe that would place a new one.
        let now = 10_600;
        assert_eq!(c.evict_expired(now), 101);
        for n in 601..1_500 {
            assert!(!c.insert(&key(n, 2, now), now), "key {n} is remembered");
            assert_eq!(c.get(&key(n, 1, n as i64).id_hash, now), Some(key(n, 1, n as i64)), "key {n}");
        }
        assert!(c.insert(&key(1_500, 1, now), now));
        let held: Vec<SeenKey> = (601..1_500).map(|n| key(n, 1, n as i64)).chain([key(1_500, 1, now)]).collect();
        assert_eq!(c.iter().collect::<Vec<_>>(), held);
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
        /// back), against the model. Ids are drawn from a few high halves,
        /// so different ids share a tag (the table's hash) and the probe
        /// must compare whole ids; small capacities cross chunk boundaries
        /// often. Half the runs number their keys from just below 2^32, so
        /// the slots' 32-bit sequence numbers wrap while keys are held.
        #[test]
        fn behaves_as_the_model(
            cap in 1usize..12,
            ttl in 1i64..40,
            ops in proptest::collection::vec((0u8..3, 0u64..24, 0u64..3, 0i64..12, 0u8..3), 1..300),
            first_seq in proptest::prop_oneof![proptest::strategy::Just(0u64), (1u64 << 32) - 30..(1u64 << 32) + 3],
        ) {
            let mut cache = HotCache::new(5, ttl, cap).numbering_from(first_seq);
            let mut model = Model::default();
            let mut now = 100i64;
            for (op, n, high, back, payload) in ops {
                let mut k = key(n, payload, now - back);
                k.id_hash.0[8..].copy_from_slice(&high.to_le_bytes());
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
