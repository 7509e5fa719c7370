//! The memtable: events appended since the last flush, in append order.
//! It is exactly the content of the live WAL files, rebuilt by replay.

use hashbrown::HashMap;

use super::StoredEvent;
use crate::classify::{IdBuildHasher, SeenKey};
use crate::event::IdHash;

/// The most events a memtable reserves room for up front: far above the
/// default bounds (about 370k events in 128 MiB), and a bound set higher
/// than this only grows the memtable as it used to.
const MAX_RESERVED_EVENTS: usize = 1 << 21;

#[derive(Default)]
pub(crate) struct Memtable {
    events: Vec<StoredEvent>,
    /// First row holding each id: `get` returns the first stored copy.
    first_row: HashMap<IdHash, u32, IdBuildHasher>,
    /// What the events hold in memory, about: the bound on a memtable is
    /// in bytes as well as in events, since one event's strings can be
    /// a hundred times another's.
    bytes: usize,
}

/// The memory one stored event takes in the memtable: the struct, its
/// strings' heap and its slot in the id map.
pub(crate) fn event_bytes(e: &StoredEvent) -> usize {
    let ev = &e.event;
    let opt = |s: &Option<String>| s.as_ref().map_or(0, String::capacity);
    std::mem::size_of::<StoredEvent>()
        + std::mem::size_of::<(IdHash, u32)>()
        + ev.event_id.capacity()
        + ev.tenant_id.capacity()
        + ev.customer_id.capacity()
        + ev.meter.capacity()
        + opt(&ev.resource_id)
        + opt(&ev.unit)
        + opt(&ev.source)
        + ev.correction_ref.as_ref().map_or(0, |c| c.original_event_id.capacity() + opt(&c.reason))
        + ev.dimensions.capacity() * std::mem::size_of::<(String, String)>()
        + ev.dimensions.iter().map(|(k, v)| k.capacity() + v.capacity()).sum::<usize>()
}

impl Memtable {
    /// An empty memtable with room for as many events as its bounds let
    /// it hold (no event takes less than its struct and id slot), so it
    /// seldom grows by doubling (only past its bound, while a flush is
    /// out): each step copied every event so far into a fresh mapping the
    /// kernel zeroed first. The room is address space until events fill
    /// it, and at most [`MAX_RESERVED_EVENTS`] whatever the bounds say.
    pub(crate) fn sized_for(max_events: usize, max_bytes: usize) -> Memtable {
        let floor = std::mem::size_of::<StoredEvent>() + std::mem::size_of::<(IdHash, u32)>();
        let events = max_events.min(max_bytes / floor + 1).min(MAX_RESERVED_EVENTS);
        Memtable {
            events: Vec::with_capacity(events),
            first_row: HashMap::with_capacity_and_hasher(events, IdBuildHasher),
            bytes: 0,
        }
    }

    pub(crate) fn push(&mut self, e: StoredEvent) {
        let row = self.events.len() as u32;
        self.first_row.entry(e.key.id_hash).or_insert(row);
        self.bytes += event_bytes(&e);
        self.events.push(e);
    }

    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub(crate) fn events(&self) -> &[StoredEvent] {
        &self.events
    }

    /// The first stored copy of `id` (on `partition`, when given).
    pub(crate) fn get(&self, partition: Option<i32>, id: &IdHash) -> Option<&StoredEvent> {
        let row = *self.first_row.get(id)? as usize;
        let first = self.events.get(row)?;
        match partition {
            // The first copy of the id is the first on its own partition.
            Some(p) if first.key.output.partition != p => {
                // Rare: the same id stored on two partitions. Only the rows
                // after the first copy can hold it. (This scan once ran for
                // every lookup by partition, a conflict's original among
                // them: 61% of a run with 10% conflicts.)
                self.events[row + 1..].iter().find(|e| e.key.id_hash == *id && e.key.output.partition == p)
            }
            _ => Some(first),
        }
    }

    /// This memtable emptied for reuse, its allocations kept: a memtable of
    /// the default bounds holds about a hundred MiB of events and id slots,
    /// and fresh memory costs the appending batch the kernel's zeroing of
    /// every page first (with growth by doubling, a sixth of durable
    /// ingest's CPU in a profile).
    pub(crate) fn recycled(mut self) -> Memtable {
        self.events.clear();
        self.first_row.clear();
        self.bytes = 0;
        self
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &SeenKey> {
        self.events.iter().map(|e| &e.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::testutil::sample_event_at;

    /// Looked up by partition, an id stored on two partitions gives each
    /// partition's first copy, and an id only on another partition none.
    #[test]
    fn a_lookup_by_partition_finds_that_partitions_first_copy() {
        let mut m = Memtable::default();
        let on = |n: u64, p: i32, offset: i64| sample_event_at(n, p, offset, 1_700_000_000_000);
        // Id 7 on partition 1 first, then twice on partition 0.
        m.push(on(1, 0, 0));
        m.push(on(7, 1, 0));
        m.push(on(2, 0, 1));
        m.push(on(7, 0, 2));
        m.push(on(7, 0, 3));
        let id = on(7, 0, 0).key.id_hash;
        let found = |p| m.get(p, &id).map(|e| (e.key.output.partition, e.key.output.offset));
        assert_eq!(found(None), Some((1, 0)));
        assert_eq!(found(Some(1)), Some((1, 0)));
        assert_eq!(found(Some(0)), Some((0, 2)));
        assert_eq!(found(Some(5)), None);
        let single = on(2, 0, 0).key.id_hash;
        assert_eq!(m.get(Some(0), &single).map(|e| e.key.output.offset), Some(1));
        assert_eq!(m.get(Some(1), &single).map(|e| e.key.output.offset), None);
    }
}
