//! What a partition's last lookup found absent, kept for its next apply.
//!
//! A batch's apply must not overwrite a key already remembered (the first
//! delivery wins, and a key is counted once in the histogram), so it reads
//! its keys before it writes them. In the worker and in `dedupd dedupe` the
//! same batch's classification read those very keys a moment before: every
//! key it accepts was a hot-cache miss looked up here and found absent. That
//! answer still holds at the apply as long as nothing has written the
//! partition's keys since, and reading them again was a second MultiGet per
//! batch (perf, `scripts/bench engine`, 2026-11-29: 6–7% of a durable
//! batch's CPU, and a hand-off to the lookup helpers each time).
//!
//! So a lookup notes the ids it found absent together with two marks taken
//! *before* it read: the partition's count of writes and the store's epoch.
//! The apply trusts the note only while both marks are unchanged, and reads
//! only the ids not in it. Every write bumps its mark *after* its write is
//! visible:
//!
//! - a partition's apply bumps the partition's count, whether it wrote or
//!   failed (an unchanged mark must mean "nothing written since");
//! - store-wide writes (dropping a partition, bulk loading one) bump the
//!   epoch.
//!
//! A lookup racing a write therefore either read after the write (and saw
//! its keys) or carries a mark the write has since moved (and its note is
//! ignored). Raising the floor needs no mark: it only hides keys, and an id
//! absent above the old floor is absent above a higher one.
//!
//! A note is per partition and replaced by the partition's next lookup.
//! Lookups of more than [`MAX_NOTED_IDS`] ids are not noted (their batch's
//! apply reads all its keys, as before), so memory stays bounded: about
//! 2.2 MiB at most per partition looked up and not dropped (a hash set of
//! 16-byte ids, a control byte each, a power-of-two table at 7/8 load),
//! some 40 KiB for a batch of 2,000. A dropped partition's entry goes.

use std::sync::{Mutex, PoisonError};

use hashbrown::{HashMap, HashSet};

use crate::classify::IdBuildHasher;
use crate::event::IdHash;

/// Largest lookup whose absent ids are noted: a batch's lookup is at most
/// the batch's records (2,000 by default in the worker, 1,000 offline).
pub(crate) const MAX_NOTED_IDS: usize = 1 << 16;

/// The marks a note is valid under: taken before a lookup reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Marks {
    epoch: u64,
    writes: u64,
}

#[derive(Default)]
struct PartitionNotes {
    /// Applies of this partition that have ended since the entry was made
    /// (a replay or a failed write counts: a write may have happened).
    writes: u64,
    /// Ids the last lookup found absent, noted only if nothing wrote the
    /// partition while it read, and dropped at the next write.
    noted: Option<HashSet<IdHash, IdBuildHasher>>,
}

#[derive(Default)]
struct Notes {
    /// Store-wide writes since open.
    epoch: u64,
    partitions: HashMap<i32, PartitionNotes>,
}

/// The notes of every partition behind one lock, held only to read or
/// change the marks and swap a note in or out (never across a read or a
/// write of RocksDB).
#[derive(Default)]
pub(crate) struct AbsentNotes {
    notes: Mutex<Notes>,
}

impl AbsentNotes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Notes> {
        // Only marks and notes live here; a note that survived a panic is
        // still guarded by its marks.
        self.notes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The marks to note a lookup of `partition` under: take them before
    /// the lookup reads.
    pub(crate) fn marks(&self, partition: i32) -> Marks {
        let mut n = self.lock();
        let epoch = n.epoch;
        Marks { epoch, writes: n.partitions.entry(partition).or_default().writes }
    }

    /// Notes which of `ids` the lookup begun under `marks` found absent
    /// (`answers[i]` is `None`); ignored when a write has moved the marks
    /// since, or the lookup was too large to keep.
    pub(crate) fn note<T>(&self, partition: i32, marks: Marks, ids: &[IdHash], answers: &[Option<T>]) {
        if ids.len() > MAX_NOTED_IDS || ids.len() != answers.len() {
            return;
        }
        let mut absent: HashSet<IdHash, IdBuildHasher> = HashSet::with_capacity_and_hasher(ids.len(), IdBuildHasher);
        absent.extend(ids.iter().zip(answers).filter(|(_, a)| a.is_none()).map(|(id, _)| *id));
        let mut n = self.lock();
        let epoch = n.epoch;
        let Some(p) = n.partitions.get_mut(&partition) else { return };
        if (Marks { epoch, writes: p.writes }) == marks {
            p.noted = Some(absent);
        }
    }

    /// The ids the partition's last lookup found absent, if nothing has
    /// written the partition's keys since it began (a write drops the
    /// note; a lookup that a write overlapped noted nothing); the note is
    /// used up.
    /// Call it holding the partition's apply lock, so no other apply of the
    /// partition runs until this one's [`wrote`](Self::wrote).
    pub(crate) fn take(&self, partition: i32) -> Option<HashSet<IdHash, IdBuildHasher>> {
        self.lock().partitions.get_mut(&partition)?.noted.take()
    }

    /// An apply of `partition` is over (written or failed): every note
    /// taken before it is stale.
    pub(crate) fn wrote(&self, partition: i32) {
        let mut n = self.lock();
        let p = n.partitions.entry(partition).or_default();
        p.writes = p.writes.wrapping_add(1);
        p.noted = None;
    }

    /// A store-wide write is over: every note is stale, and `forget`'s
    /// entry goes (a dropped partition's; its count starts again, the
    /// epoch keeps older marks from matching).
    pub(crate) fn wrote_store_wide(&self, forget: Option<i32>) {
        let mut n = self.lock();
        n.epoch = n.epoch.wrapping_add(1);
        if let Some(p) = forget {
            n.partitions.remove(&p);
        }
        for p in n.partitions.values_mut() {
            p.noted = None;
        }
    }
}

/// Bumps a mark when dropped: after the write it guards, on every path out
/// of it, an early error included.
pub(crate) struct BumpOnDrop<'a> {
    notes: &'a AbsentNotes,
    /// `Some(p)`: a write to partition `p`; `None`: a store-wide write.
    partition: Option<i32>,
    forget: Option<i32>,
}

impl<'a> BumpOnDrop<'a> {
    pub(crate) fn partition(notes: &'a AbsentNotes, partition: i32) -> BumpOnDrop<'a> {
        BumpOnDrop { notes, partition: Some(partition), forget: None }
    }

    pub(crate) fn store_wide(notes: &'a AbsentNotes, forget: Option<i32>) -> BumpOnDrop<'a> {
        BumpOnDrop { notes, partition: None, forget }
    }
}

impl Drop for BumpOnDrop<'_> {
    fn drop(&mut self) {
        match self.partition {
            Some(p) => self.notes.wrote(p),
            None => self.notes.wrote_store_wide(self.forget),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> IdHash {
        IdHash([n; 16])
    }

    #[test]
    fn a_note_is_taken_once_and_holds_only_the_absent_ids() {
        let notes = AbsentNotes::default();
        let marks = notes.marks(3);
        notes.note(3, marks, &[id(1), id(2), id(3)], &[None, Some(()), None]);
        let taken = notes.take(3).expect("nothing wrote since the lookup began");
        let mut ids: Vec<IdHash> = taken.into_iter().collect();
        ids.sort_unstable();
        assert_eq!(ids, [id(1), id(3)]);
        assert!(notes.take(3).is_none(), "a note serves one apply");
        assert!(notes.take(4).is_none(), "another partition has no note");
    }

    #[test]
    fn a_write_begun_before_the_lookup_noted_makes_the_note_stale() {
        let notes = AbsentNotes::default();
        // The lookup takes its marks, an apply of the same partition ends,
        // then the lookup notes what it read (perhaps before the write).
        let marks = notes.marks(0);
        notes.wrote(0);
        notes.note(0, marks, &[id(1)], &[None::<()>]);
        assert!(notes.take(0).is_none());
        // A note made, then an apply: the next apply may not trust it.
        let marks = notes.marks(0);
        notes.note(0, marks, &[id(1)], &[None::<()>]);
        notes.wrote(0);
        assert!(notes.take(0).is_none());
    }

    #[test]
    fn another_partitions_apply_leaves_a_note_but_a_store_wide_write_does_not() {
        let notes = AbsentNotes::default();
        let marks = notes.marks(0);
        notes.note(0, marks, &[id(1)], &[None::<()>]);
        notes.wrote(1);
        assert!(notes.take(0).is_some(), "partition 1's apply wrote none of partition 0's keys");

        let marks = notes.marks(0);
        notes.note(0, marks, &[id(1)], &[None::<()>]);
        drop(BumpOnDrop::store_wide(&notes, None));
        assert!(notes.take(0).is_none());

        // A lookup begun before a drop of its partition notes nothing: the
        // entry went with the drop, and the epoch moved.
        let marks = notes.marks(5);
        drop(BumpOnDrop::store_wide(&notes, Some(5)));
        notes.note(5, marks, &[id(1)], &[None::<()>]);
        assert!(notes.take(5).is_none());
        let _ = notes.marks(5);
        notes.note(5, marks, &[id(1)], &[None::<()>]);
        assert!(notes.take(5).is_none(), "the old marks do not match the fresh entry");
    }

    #[test]
    fn a_lookup_too_large_to_keep_is_not_noted() {
        let notes = AbsentNotes::default();
        let ids: Vec<IdHash> = (0..=MAX_NOTED_IDS).map(|n| IdHash((n as u128).to_le_bytes())).collect();
        let answers = vec![None::<()>; ids.len()];
        let marks = notes.marks(0);
        notes.note(0, marks, &ids, &answers);
        assert!(notes.take(0).is_none());
    }
}
