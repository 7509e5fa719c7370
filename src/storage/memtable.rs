//! The memtable: events appended since the last flush, in append order.
//! It is exactly the content of the live WAL files, rebuilt by replay.

use hashbrown::HashMap;

use super::StoredEvent;
use crate::classify::{IdBuildHasher, SeenKey};
use crate::event::IdHash;

#[derive(Default)]
pub(crate) struct Memtable {
    events: Vec<StoredEvent>,
    /// First row holding each id: `get` returns the first stored copy.
    first_row: HashMap<IdHash, u32, IdBuildHasher>,
}

impl Memtable {
    pub(crate) fn push(&mut self, e: StoredEvent) {
        let row = self.events.len() as u32;
        self.first_row.entry(e.key.id_hash).or_insert(row);
        self.events.push(e);
    }

    pub(crate) fn len(&self) -> usize {
        self.events.len()
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

    pub(crate) fn keys(&self) -> impl Iterator<Item = &SeenKey> {
        self.events.iter().map(|e| &e.key)
    }

    pub(crate) fn clear(&mut self) {
        self.events.clear();
        self.first_row.clear();
    }
}
