//! Settings of the key store and the RocksDB options they turn into.
//!
//! The defaults are sized for a 2-core host that also runs the consumer, the
//! classifier and the usage store: see "RocksDB settings and why" in
//! `docs/keystore.md` for the reasoning behind each one.

use rocksdb::{
    BlockBasedOptions, Cache, DBCompressionType, DBRecoveryMode, DataBlockIndexType, MemtableFactory, Options,
    ReadOptions, SliceTransform,
};

use super::codec::KEY_LEN;

use super::error::KeystoreError;
use super::histogram::merge_meta;
use super::horizon::{Floor, FloorFilterFactory};

const DAY_MS: i64 = 86_400_000;

/// Settings of a [`KeyStore`](super::KeyStore).
#[derive(Clone, Debug)]
pub struct KeyStoreOptions {
    /// Dedupe horizon (`--horizon`), counted from `first_seen_ms` (ingest time).
    pub horizon_ms: i64,
    /// How long the classifier counts a key as remembered (a key's
    /// lifetime), at most `horizon_ms`: the store may keep keys a while
    /// longer, and an id the classifier accepted again once its key's
    /// lifetime was over replaces that key when applied, rather than being
    /// dropped as "remembered already" (its retries would find the old key,
    /// which the classifier no longer counts, and be billed again).
    pub lifetime_ms: i64,
    /// Size cap (`--keystore-max-bytes`); oldest keys go first when it binds.
    pub max_bytes: Option<u64>,
    /// When the size cap shortens the window below this, `age_out` logs an
    /// error and [`KeyStore::window_below_floor`](super::KeyStore::window_below_floor) says so.
    pub window_floor_ms: i64,
    /// Block cache for data blocks (filters and indexes are held by the open
    /// table readers, outside this budget: see
    /// [`KeyStore::filter_and_index_bytes`](super::KeyStore::filter_and_index_bytes)).
    pub block_cache_bytes: usize,
    /// Memtable size of the keys column family.
    pub write_buffer_bytes: usize,
    /// RocksDB flush + compaction threads.
    pub background_jobs: i32,
    /// Policy for the caller: keep a revoked partition's keys (it often comes
    /// back) or drop them with [`KeyStore::drop_partition`](super::KeyStore::drop_partition).
    pub keep_revoked_partitions: bool,
    /// fsync the WAL on every `apply_batch`. Off by default: the output topic
    /// is the source of truth and repair replays it from the checkpoint, and
    /// the WAL is written before `apply_batch` returns, so a process crash
    /// loses nothing; only a host crash can lose the last batches, which
    /// repair then re-applies. Callers wanting a durable point call `flush`.
    pub sync_writes: bool,
    /// Whole-key filter strength, in bloom-equivalent bits per key: the
    /// false-positive rate of a bloom filter with this many bits. Tables
    /// below level 0 carry a Ribbon filter of that rate in about 70% of the
    /// memory; level 0, rewritten soon, a bloom filter (cheaper to build).
    pub filter_bits_per_key: f64,
    /// Data block size: a found key costs one block read of this size;
    /// smaller blocks grow the index.
    pub block_bytes: usize,
    /// Width of the first-seen histogram's buckets: the granularity of the
    /// size cap and of the window estimate.
    pub histogram_bucket_ms: i64,
    /// Rewrites SST files older than this, so expired keys in quiet key
    /// ranges are reclaimed within this delay (RocksDB `periodic_compaction_seconds`).
    pub periodic_compaction_secs: u64,
    /// Threads that read parts of a large batched lookup beside its caller
    /// (see `lookups.rs`): keys found in the store cost a block read each,
    /// and a retry storm of old events is bound by them. 0 keeps every
    /// lookup on its caller.
    pub lookup_helpers: usize,
}

impl Default for KeyStoreOptions {
    fn default() -> KeyStoreOptions {
        KeyStoreOptions {
            horizon_ms: 35 * DAY_MS,
            lifetime_ms: 35 * DAY_MS,
            max_bytes: None,
            // The window the default limits need (max event age 35 days,
            // future skew an hour, a millisecond): a shorter window lets a
            // retry of an event the age check accepts through as new.
            window_floor_ms: crate::event::Limits::default().window_needed_ms(),
            block_cache_bytes: 128 << 20,
            write_buffer_bytes: 64 << 20,
            background_jobs: 2,
            keep_revoked_partitions: true,
            sync_writes: false,
            filter_bits_per_key: 14.0,
            block_bytes: 4 << 10,
            histogram_bucket_ms: 3_600_000,
            periodic_compaction_secs: 86_400,
            lookup_helpers: default_lookup_helpers(),
        }
    }
}

/// Most lookup helpers a store may start (`--keystore-lookup-threads`).
pub const MAX_LOOKUP_HELPERS: usize = 64;

/// One helper per core beyond the caller's, at most three: a batch's
/// lookup is rarely more than a few thousand keys, so more parts would
/// each be too small to pay for waking a thread.
pub fn default_lookup_helpers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(1).min(3)
}

impl KeyStoreOptions {
    pub fn validate(&self) -> Result<(), KeystoreError> {
        let bad = |key, detail: &str| Err(KeystoreError::InvalidOption { key, detail: detail.to_string() });
        if self.horizon_ms <= 0 {
            return bad("horizon", "must be positive");
        }
        if self.histogram_bucket_ms <= 0 {
            return bad("histogram_bucket_ms", "must be positive");
        }
        if self.background_jobs < 1 {
            return bad("keystore_background_jobs", "must be at least 1");
        }
        if self.write_buffer_bytes < (1 << 20) {
            return bad("keystore_write_buffer_bytes", "must be at least 1 MiB");
        }
        if !(1.0..=32.0).contains(&self.filter_bits_per_key) {
            return bad("keystore_filter_bits_per_key", "must be within 1..=32");
        }
        if !(1024..=(1 << 20)).contains(&self.block_bytes) {
            return bad("keystore_block_bytes", "must be within 1 KiB..=1 MiB");
        }
        if self.lookup_helpers > MAX_LOOKUP_HELPERS {
            return bad("keystore_lookup_threads", &format!("must be at most {MAX_LOOKUP_HELPERS}"));
        }
        if self.max_bytes == Some(0) {
            return bad("keystore_max_bytes", "must be positive when set");
        }
        Ok(())
    }
}

pub(crate) const KEYS_CF: &str = "keys";
pub(crate) const META_CF: &str = "meta";

pub(crate) fn db_options(o: &KeyStoreOptions) -> Options {
    let mut db = Options::default();
    db.create_if_missing(true);
    db.create_missing_column_families(true);
    db.set_max_background_jobs(o.background_jobs);
    db.set_max_subcompactions(1);
    // Required: the keys family's hash memtable (see `keys_cf_options`)
    // takes no concurrent inserts, and RocksDB refuses to open a database
    // that asks for them. Partitions write side by side all the same:
    // RocksDB's write group inserts their batches one after another (the
    // concurrent path, measured with the skiplist memtable, was no faster
    // with two partitions on two cores: scripts/bench engine, 2026-11-25).
    db.set_allow_concurrent_memtable_write(false);
    // Keys and meta are written in one batch; flushing them together keeps
    // the SSTs consistent with each other even without the WAL.
    db.set_atomic_flush(true);
    db.set_wal_recovery_mode(DBRecoveryMode::PointInTime);
    // Bounds WAL replay time at open and the disk the WAL takes.
    db.set_max_total_wal_size((o.write_buffer_bytes as u64).saturating_mul(4));
    // Smooths writeback so compaction output does not stall foreground fsyncs.
    db.set_bytes_per_sync(1 << 20);
    db.set_keep_log_file_num(4);
    db.set_max_log_file_size(16 << 20);
    db
}

pub(crate) fn keys_cf_options(o: &KeyStoreOptions, cache: &Cache, floor: Floor) -> Options {
    keys_options(o, cache, floor, Tables::Lasting)
}

/// What the tables a set of options writes are for, which decides their
/// filter (see `keys_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tables {
    /// Tables that stay a while: RocksDB's flushes and compactions (by
    /// level), and bulk loads, ingested into the bottommost level.
    Lasting,
    /// A layer of applied keys written out (`recent.rs`): its ids are
    /// random, so it is usually ingested into level 0 (into the bottommost
    /// level when nothing there overlaps it, as on an empty store) and
    /// compacted soon.
    Layer,
}

fn keys_options(o: &KeyStoreOptions, cache: &Cache, floor: Floor, tables: Tables) -> Options {
    let mut cf = Options::default();
    let mut t = BlockBasedOptions::default();
    t.set_block_cache(cache);
    // Lookups are mostly for absent keys: every level needs its filter,
    // including the bottommost (so no optimize_filters_for_hits). A false
    // positive costs a data block read, from disk when the block is cold:
    // at 50M keys with 10-bit bloom filters (~1% false positives) those
    // reads were most of an absent key's lookup. Ribbon filters at
    // 14 bloom-equivalent bits (~0.2%) take the memory 10-bit bloom filters
    // took, and absent-key lookups ran about twice as fast
    // (benches/keystore.rs, 2026-11-30). Level 0 and a layer's table keep
    // bloom filters of as many bits (the same rate, more memory): building
    // a Ribbon filter costs several times the CPU, and level-0 tables are
    // rewritten soon. RocksDB picks by level, and takes a table written
    // outside it (a layer's, a bulk load's) for the bottommost level.
    match tables {
        Tables::Lasting => t.set_hybrid_ribbon_filter(o.filter_bits_per_key, 1),
        Tables::Layer => t.set_bloom_filter(o.filter_bits_per_key, false),
    }
    t.set_whole_key_filtering(true);
    // Filters and indexes stay with the table readers, always in memory:
    // an absent-key probe then never waits on a cache miss.
    t.set_cache_index_and_filter_blocks(false);
    t.set_block_size(o.block_bytes);
    // A hash index in each data block: a point lookup of a key that is
    // there (a late retry) goes from the block's hash to its entry instead
    // of binary-searching the block's restart points. A retry storm of keys
    // all found in the store ran ~10% faster at 50M keys for 1.4 B/key more
    // disk (benches/keystore.rs, 2026-11-29). Iterators still search.
    t.set_data_block_index_type(DataBlockIndexType::BinaryAndHash);
    t.set_data_block_hash_ratio(0.75);
    t.set_format_version(6);
    cf.set_block_based_table_factory(&t);
    cf.set_optimize_filters_for_hits(false);
    // Applies no longer write this family's memtable (the store's own
    // layers hold them, `recent.rs`): a small one for whatever might.
    cf.set_write_buffer_size(rocksdb_memtable_bytes(o.write_buffer_bytes));
    cf.set_max_write_buffer_number(3);
    cf.set_level_compaction_dynamic_level_bytes(true);
    cf.set_target_file_size_base(64 << 20);
    cf.set_max_bytes_for_level_base((o.write_buffer_bytes as u64).saturating_mul(4).max(256 << 20));
    // No compression: an entry is mostly two random hashes (the id in the
    // key, the payload hash in the value), so zstd saved 16% of the bytes
    // (49 against 58 a key) and lz4 nothing (RocksDB stores a block raw
    // when it compresses too little, after trying). What zstd cost is on
    // every key found in the store, a late retry: its block decompressed,
    // a fifth of the lookup (perf, benches/keystore.rs, 2026-11-26).
    // Uncompressed, the OS page cache holds blocks as they are read.
    cf.set_compression_type(DBCompressionType::None);
    cf.set_bottommost_compression_type(DBCompressionType::None);
    // The memtable is a hash table of short lists, not one skiplist: an
    // id is random, so inserting a batch's sorted keys into a skiplist of
    // a whole memtable (~800k keys at 64 MiB) walked most of its levels per
    // key through cold memory, half of a durable batch's CPU (perf,
    // benches/ledger.rs ingest_paired, 2026-11-26). A hash bucket is a key
    // or two. The sorted order a flush needs is built then, on the flush
    // thread; iterators over this family ask for total order (see
    // `total_order`). The hash needs a prefix extractor: the whole key, so
    // lookups and filters see exactly what they saw without one (RocksDB
    // adds a prefix equal to its key to a filter once).
    cf.set_prefix_extractor(SliceTransform::create_fixed_prefix(KEY_LEN));
    cf.set_memtable_factory(MemtableFactory::HashLinkList {
        bucket_count: memtable_buckets(rocksdb_memtable_bytes(o.write_buffer_bytes)),
    });
    // A memtable probe for an absent key would walk its bucket; this bloom
    // answers most of them from a cache line. The prefix is the whole key,
    // so the bloom holds prefixes only (whole keys too would add each
    // key twice).
    cf.set_memtable_prefix_bloom_ratio(0.05);
    cf.set_memtable_whole_key_filtering(false);
    cf.set_periodic_compaction_seconds(o.periodic_compaction_secs);
    cf.set_compaction_filter_factory(FloorFilterFactory::new(floor));
    cf
}

/// Hash buckets of a keys memtable of `write_buffer_bytes`: about one per
/// key it holds (a key, its value and its list node take ~75 bytes). The
/// bucket array comes out of the memtable's own budget (8 bytes a bucket,
/// an eighth of it at 64 bytes a bucket).
/// The keys family's RocksDB memtable: a sixteenth of the write buffer
/// the layers are sized by, at least 1 MiB.
fn rocksdb_memtable_bytes(write_buffer_bytes: usize) -> usize {
    (write_buffer_bytes / 16).max(1 << 20)
}

fn memtable_buckets(write_buffer_bytes: usize) -> usize {
    (write_buffer_bytes / 64).max(1024)
}

/// Read options for an iterator over the keys family: in key order across
/// the whole family. Without `total_order_seek` a seek stays within the
/// seek key's prefix (here the whole key), and the hash memtable would
/// show an iterator only that bucket.
pub(crate) fn total_order() -> ReadOptions {
    let mut r = ReadOptions::default();
    r.set_total_order_seek(true);
    r
}

pub(crate) fn meta_cf_options() -> Options {
    let mut cf = Options::default();
    cf.set_merge_operator_associative("dedupd.keystore.meta.v1", merge_meta);
    cf.set_write_buffer_size(4 << 20);
    cf
}

/// Options for writing SST files to ingest (a bulk load's, a layer's): the
/// keys CF's table format, uncompressed like the level they land in, with
/// the filter their tables want.
pub(crate) fn sst_writer_options(o: &KeyStoreOptions, cache: &Cache, floor: Floor, tables: Tables) -> Options {
    keys_options(o, cache, floor, tables)
}

/// Read options for looking keys up: the blocks read do not go into the
/// block cache. Ids are uniformly random, so a found key's block is one of
/// every block of the store (about 700k at 50M keys; the default cache
/// holds 32k), rarely read again before it is evicted; inserting it and
/// evicting another cost more than the few hits saved (a retry storm of
/// found keys 146-162k events/s filling the cache, 222-244k not, one
/// thread, 50M keys). The hot cache, not this one, is what answers
/// recent ids.
pub(crate) fn lookup() -> ReadOptions {
    let mut r = ReadOptions::default();
    r.fill_cache(false);
    r
}
