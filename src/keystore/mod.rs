//! The long-horizon key store: every accepted key, for the dedupe horizon,
//! in RocksDB under `<state-dir>/keystore` (DESIGN §5).
//!
//! The hot cache answers recent retries; this store answers the hot cache's
//! misses in one batched MultiGet per batch, so a retry that arrives after
//! hot eviction or a restart is still caught. It is a materialised view of
//! the output topic: every applied batch records the partition's checkpoint
//! (the output offset of its last record) with its keys, atomically.
//!
//! ```text
//! apply_batch(p, keys, ckpt) ──► one frame { p, ckpt, new keys } appended to the active layer's log,
//!                                 the keys into the active layer (a hash map per partition)
//! layer full (write buffer)  ──► frozen; on a thread: keys sorted -> one SST ingested into keys CF,
//!                                 then meta { "h"(bucket,p) += n, "c"(p) = ckpt } synced; log deleted
//! lookup_many(p, ids)        ──► the layers, then one batched MultiGet on keys CF for the rest
//!                                 (filters answer absent ids), in parts on helper threads when large
//! age_out(now)               ──► floor = max(now - horizon, size-cap floor); compactions drop keys <= floor
//! ```
//!
//! The layers are the store's own memtable (`recent.rs` says why RocksDB's
//! was replaced: its flush sorted a hash memtable one random skip-list
//! insert per key, 30% of a durable run's CPU).
//!
//! # Ageing out: a first-seen floor applied by a compaction filter
//!
//! Keys live in one column family keyed by `(partition, id_hash)`. Ageing
//! out raises a single number, the floor: reads hide keys first seen at or
//! before it immediately, and a compaction filter drops them physically
//! whenever RocksDB rewrites their file — no tombstones and no scans. Leveled
//! compaction rewrites the bottommost level about once per tenth of its size
//! written, and `periodic_compaction_seconds` (1 day) bounds the lag in quiet
//! key ranges, so dead keys cost at most ~10% extra disk, which the size cap
//! leaves as headroom. The size cap becomes a floor too: a small in-memory
//! histogram of key counts per (hour, partition), persisted beside the keys,
//! gives the oldest-first cut without reading any key.
//!
//! The alternative, one column family per time bucket dropped whole, frees
//! space exactly and at once, but every lookup must probe every live bucket:
//! for the mostly-absent lookups of 99%-new traffic that multiplies the
//! bloom-filter work by the bucket count. The benchmark (`benches/keystore.rs`,
//! `mechanism` section, figures in `docs/keystore.md`) measured absent-key
//! MultiGet over 8 bucket column families at several times the cost of one,
//! while ageing out by compaction filter added nothing measurable to
//! compaction. Range deletes over a time index would need a point delete
//! per key in the primary index: the tombstone storm the issue rules out.
//!
//! # Durability
//!
//! `apply_batch` returns once the batch's frame is in the active layer's
//! log (by default not fsynced: a process crash loses nothing, a host crash
//! may lose the last batches, which repair re-applies from the output topic
//! because the checkpoint went back with them). Open replays the logs and
//! writes what they hold into RocksDB. `sync_writes` or [`KeyStore::flush`]
//! (which writes every layer out) give a durable point.
//!
//! # Files
//!
//! - `absent.rs`: what a partition's last lookup found absent, so its
//!   batch's apply need not read those keys again.
//! - `codec.rs`: key/value/meta encodings (the format block).
//! - `histogram.rs`: first-seen histogram and the meta merge operator.
//! - `horizon.rs`: the floor and the compaction filter.
//! - `lookups.rs`: helper threads that share a large lookup with its caller.
//! - `options.rs`: settings and the RocksDB options they become.
//! - `recent.rs`: the layers of applied keys not yet in RocksDB, and their logs.
//! - `store.rs`: [`KeyStore`].

mod absent;
mod codec;
#[cfg(test)]
mod contract;
mod error;
mod histogram;
mod horizon;
mod lookups;
mod options;
mod recent;
mod store;
mod verify;

pub use error::KeystoreError;

use crate::classify::{LongHorizon, SeenKey};

/// What local state needs of the long-horizon key store: the contract
/// [`KeyStore`] (RocksDB) implements and the simulator models
/// (`sim::disk::SimKeyStore`, with unsynced writes lost at a power loss).
/// The same scripted checks run against both (`keystore/contract.rs`), so
/// the model cannot drift from the store.
///
/// - `apply_batch` is atomic: a batch's keys and the partition's new
///   checkpoint become visible, and survive a crash, together or not at all.
/// - A batch at or below the checkpoint changes nothing; within a batch and
///   across batches the first delivery of an id wins while it is above the
///   floor.
/// - `age_out` raises the floor; keys first seen at or below it are gone.
/// - `drop_partition` forgets a partition's keys and checkpoint atomically.
/// - Writes are durable against a process crash once applied, against a
///   power loss after `flush`; a power loss keeps a prefix of the batches
///   applied since.
pub trait KeyTier: LongHorizon + Send + Sync {
    fn checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError>;
    fn apply_batch(&self, partition: i32, keys: &[SeenKey], checkpoint: i64) -> Result<(), KeystoreError>;
    fn age_out(&self, now_ms: i64) -> Result<(), KeystoreError>;
    fn drop_partition(&self, partition: i32) -> Result<(), KeystoreError>;
    fn oldest_first_seen_ms(&self) -> Result<Option<i64>, KeystoreError>;
    fn window_below_floor(&self, now_ms: i64) -> Result<bool, KeystoreError>;
    fn disk_bytes(&self) -> u64;
    fn flush(&self) -> Result<(), KeystoreError>;
}

impl KeyTier for KeyStore {
    fn checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError> {
        KeyStore::checkpoint(self, partition)
    }

    fn apply_batch(&self, partition: i32, keys: &[SeenKey], checkpoint: i64) -> Result<(), KeystoreError> {
        KeyStore::apply_batch(self, partition, keys, checkpoint)
    }

    fn age_out(&self, now_ms: i64) -> Result<(), KeystoreError> {
        KeyStore::age_out(self, now_ms).map(drop)
    }

    fn drop_partition(&self, partition: i32) -> Result<(), KeystoreError> {
        KeyStore::drop_partition(self, partition)
    }

    fn oldest_first_seen_ms(&self) -> Result<Option<i64>, KeystoreError> {
        KeyStore::oldest_first_seen_ms(self)
    }

    fn window_below_floor(&self, now_ms: i64) -> Result<bool, KeystoreError> {
        KeyStore::window_below_floor(self, now_ms)
    }

    fn disk_bytes(&self) -> u64 {
        KeyStore::disk_bytes(self)
    }

    fn flush(&self) -> Result<(), KeystoreError> {
        KeyStore::flush(self)
    }
}
pub use options::{default_lookup_helpers, KeyStoreOptions, MAX_LOOKUP_HELPERS};
pub use store::{AgeOutReport, KeyStore};
pub use verify::{verify, KeystoreVerifyReport, LogCheck};
