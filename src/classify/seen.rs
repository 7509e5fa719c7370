//! What every state tier remembers about an accepted event.

use crate::event::{IdHash, PayloadHash, Position};

/// The memory of one accepted event: enough to tell a later delivery of the
/// same id apart as a duplicate, a conflict or a replay, and to say where the
/// canonical copy was published.
///
/// `first_seen_ms` is ingest time (dedupd's clock when the event was first
/// accepted), never event time: horizons and TTLs count from it, so a
/// back-dated event is remembered as long as a fresh one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeenKey {
    pub id_hash: IdHash,
    pub payload_hash: PayloadHash,
    pub first_seen_ms: i64,
    /// Input partition and offset of the record that was accepted.
    pub source: Position,
    /// Output partition and offset where it was published: the checkpoint unit.
    pub output: Position,
}
