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

    pub(crate) fn get(&self, partition: Option<i32>, id: &IdHash) -> Option<&StoredEvent> {
        let row = *self.first_row.get(id)?;
        match partition {
            None => self.events.get(row as usize),
            // Rare: the same id stored on two partitions; fall back to a scan.
            Some(p) => self.events.iter().find(|e| e.key.id_hash == *id && e.key.output.partition == p),
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
