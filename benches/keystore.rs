//! Key store benchmark: a `harness = false` main that prints figures.
//!
//! ```text
//! cargo bench --bench keystore                      # all sections, 50M keys
//! DEDUPD_BENCH_KEYS=5000000 cargo bench --bench keystore -- load classify
//! ```
//!
//! Sections (all by default, or those named after `--`):
//! - `mechanism`: absent-key MultiGet over one column family vs 8 time-bucket
//!   column families holding the same keys (`DEDUPD_BENCH_MECH_KEYS`, 8M).
//! - `load`: bulk-load `DEDUPD_BENCH_KEYS` keys over 8 partitions, first seen
//!   spread over the horizon; disk bytes per key.
//! - `classify`: `PartitionClassifier` with an empty hot cache (so every id
//!   goes to the key store's MultiGet), batches of 1000, 99%-new and
//!   100%-duplicate traffic.
//! - `write`: `apply_batch` of new keys, batches of 1000, then compaction and
//!   disk bytes per key.
//! - `ageout`: one day passes: `age_out` latency, then the compaction that
//!   reclaims the day (an upper bound of what periodic compaction does daily).
//!
//! The store lives in `DEDUPD_BENCH_DIR` (default: the system temp dir) and
//! is deleted at the end.

use std::time::{Duration, Instant};

use dedupd::classify::{Candidate, ClassifierSettings, PartitionClassifier, SeenKey, Verdict};
use dedupd::event::{IdHash, PayloadHash, Position};
use dedupd::keystore::{KeyStore, KeyStoreOptions};
use rand::{Rng, SeedableRng};
use rocksdb::{BlockBasedOptions, ColumnFamilyDescriptor, DBCompressionType, Options, SstFileWriter, DB};

type R<T> = Result<T, Box<dyn std::error::Error>>;

/// As the `dedupd` binary allocates (see `src/main.rs`): with the system
/// allocator this bench measured glibc's malloc and free (5% of its main
/// thread in a conflict storm), which the binary never runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DAY_MS: i64 = 86_400_000;
const HORIZON_MS: i64 = 35 * DAY_MS;
const PARTITIONS: i32 = 8;
const BATCH: usize = 1000;
const NOW_MS: i64 = 1_800_000_000_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or(default)
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser: cheap, well-mixed, reproducible ids.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The `i`-th of `n` loaded ids of partition `p`, ascending in `i`: evenly
/// strided over the id space with random low bits, like sorted blake3 output.
fn loaded_id(p: i32, i: u64, n: u64) -> IdHash {
    let stride = u128::MAX / u128::from(n.max(1));
    let jitter = ((u128::from(mix(i ^ ((p as u64) << 40))) << 64) | u128::from(mix(!i))) % stride;
    IdHash((u128::from(i) * stride + jitter).to_be_bytes())
}

fn loaded_key(p: i32, i: u64, n: u64) -> SeenKey {
    let r = mix(i.wrapping_mul(31) ^ (p as u64));
    SeenKey {
        id_hash: loaded_id(p, i, n),
        payload_hash: PayloadHash(((u128::from(mix(r)) << 64) | u128::from(r)).to_le_bytes()),
        // Spread over the horizon, as a store in steady state holds them.
        first_seen_ms: NOW_MS - 1 - (r % (HORIZON_MS as u64 - DAY_MS as u64)) as i64,
        source: Position::new(p, (r >> 20) as i64 % (4 * n as i64)),
        output: Position::new(p, (r >> 24) as i64 % (2 * n as i64)),
    }
}

fn random_id(rng: &mut impl Rng) -> IdHash {
    IdHash(rng.random::<u128>().to_be_bytes())
}

fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn store_opts() -> KeyStoreOptions {
    let d = KeyStoreOptions::default();
    KeyStoreOptions {
        horizon_ms: HORIZON_MS,
        block_bytes: env_u64("DEDUPD_BENCH_BLOCK_BYTES", d.block_bytes as u64) as usize,
        write_buffer_bytes: env_u64("DEDUPD_BENCH_WRITE_BUFFER_BYTES", d.write_buffer_bytes as u64) as usize,
        filter_bits_per_key: env_u64("DEDUPD_BENCH_FILTER_BITS", d.filter_bits_per_key as u64) as f64,
        ..d
    }
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    let keys = env_u64("DEDUPD_BENCH_KEYS", 50_000_000);
    let base = std::env::var("DEDUPD_BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(|_| std::env::temp_dir());
    let tmp = tempfile::tempdir_in(&base)?;
    println!(
        "keystore bench: {keys} keys, {PARTITIONS} partitions, block {} bytes, dir {}",
        store_opts().block_bytes,
        tmp.path().display()
    );

    if want("mechanism") {
        mechanism(tmp.path(), env_u64("DEDUPD_BENCH_MECH_KEYS", 8_000_000))?;
    }
    let needs_store = ["load", "classify", "write", "ageout"].iter().any(|s| want(s));
    if !needs_store {
        return Ok(());
    }
    let dir = tmp.path().join("keystore");
    let ks = KeyStore::open(&dir, store_opts())?;
    let per_part = keys / PARTITIONS as u64;

    // Load.
    let t = Instant::now();
    for p in 0..PARTITIONS {
        ks.bulk_load(p, (0..per_part).map(|i| loaded_key(p, i, per_part)), Some(2 * per_part as i64))?;
    }
    let load = t.elapsed();
    let total = per_part * PARTITIONS as u64;
    println!(
        "load: {total} keys in {:.1}s = {:.0} keys/s; disk {:.2} GB = {:.1} bytes/key (bulk SSTs)",
        load.as_secs_f64(),
        per_sec(total, load),
        ks.disk_bytes() as f64 / 1e9,
        ks.disk_bytes() as f64 / total as f64
    );
    let held = ks.filter_and_index_bytes()?;
    println!(
        "load: filters and indexes {:.0} MB in memory = {:.2} bytes/key ({} bloom-equivalent filter bits per key)",
        held as f64 / 1e6,
        held as f64 / total as f64,
        store_opts().filter_bits_per_key
    );

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    if want("classify") {
        // The store alone, without the classifier: absent ids.
        let ids: Vec<IdHash> = (0..1_000_000).map(|_| random_id(&mut rng)).collect();
        let mut out = Vec::new();
        let t = Instant::now();
        for chunk in ids.chunks(BATCH) {
            ks.get_many(0, chunk, &mut out)?;
        }
        let d = t.elapsed();
        println!(
            "lookup: {:.0} absent-key get_many lookups/s (one thread, batches of {BATCH})",
            per_sec(ids.len() as u64, d)
        );
    }
    if want("classify") {
        let settings = ClassifierSettings {
            hot_ttl_ms: 7 * DAY_MS,
            hot_capacity: 1 << 20,
            horizon_ms: HORIZON_MS,
            detect_replays: true,
        };
        let classifier = PartitionClassifier::new(0, settings);
        for (name, dup_share) in [("99%-new", 0.01f64), ("100%-duplicate", 1.0)] {
            let events = env_u64("DEDUPD_BENCH_CLASSIFY_EVENTS", 2_000_000);
            let batches: Vec<Vec<Candidate>> = (0..events / BATCH as u64)
                .map(|_| {
                    (0..BATCH)
                        .map(|_| {
                            let (id, payload) = if rng.random_bool(dup_share) {
                                let k = loaded_key(0, rng.random_range(0..per_part), per_part);
                                (k.id_hash, k.payload_hash)
                            } else {
                                (random_id(&mut rng), PayloadHash([1; 16]))
                            };
                            Candidate { id_hash: id, payload_hash: payload, source: Position::new(0, 0) }
                        })
                        .collect()
                })
                .collect();
            let t = Instant::now();
            let mut known = 0u64;
            for b in &batches {
                let v = classifier.classify(b, &ks, NOW_MS)?;
                known += v.iter().filter(|v| !matches!(v, Verdict::Accepted)).count() as u64;
            }
            let d = t.elapsed();
            let n = (batches.len() * BATCH) as u64;
            println!(
                "classify {name}: {n} events in {:.2}s = {:.0} events/s (one thread, batches of {BATCH}, {known} found in the key store)",
                d.as_secs_f64(),
                per_sec(n, d)
            );
        }
    }

    if want("write") || want("ageout") {
        let n = env_u64("DEDUPD_BENCH_WRITE_KEYS", 2_000_000);
        let mut offset = 10 * per_part as i64;
        let t = Instant::now();
        let mut written = 0u64;
        while written < n {
            let p = (written / BATCH as u64 % PARTITIONS as u64) as i32;
            let batch: Vec<SeenKey> = (0..BATCH)
                .map(|_| {
                    offset += 1;
                    SeenKey {
                        id_hash: random_id(&mut rng),
                        payload_hash: PayloadHash(rng.random()),
                        first_seen_ms: NOW_MS,
                        source: Position::new(p, offset),
                        output: Position::new(p, offset),
                    }
                })
                .collect();
            ks.apply_batch(p, &batch, offset)?;
            written += BATCH as u64;
        }
        let d = t.elapsed();
        // The last layers are still in memory or being written out: the
        // figure that counts includes writing them into RocksDB.
        ks.flush()?;
        let with_flush = t.elapsed();
        println!(
            "write: {written} new keys in {:.2}s = {:.0} keys/s (apply_batch, batches of {BATCH}, logged, no fsync); \
             {:.2}s = {:.0} keys/s until every key is in RocksDB's files",
            d.as_secs_f64(),
            per_sec(written, d),
            with_flush.as_secs_f64(),
            per_sec(written, with_flush)
        );
        let t = Instant::now();
        ks.compact()?;
        let all = total + written;
        println!(
            "compact: full rewrite of {all} keys in {:.1}s; disk {:.2} GB = {:.1} bytes/key after compaction",
            t.elapsed().as_secs_f64(),
            ks.disk_bytes() as f64 / 1e9,
            ks.disk_bytes() as f64 / all as f64
        );
    }

    if want("ageout") {
        let before = ks.disk_bytes();
        let t = Instant::now();
        // Keys were loaded first seen over the last 34 days: two days on, the
        // oldest day falls past the 35-day horizon.
        let r = ks.age_out(NOW_MS + 2 * DAY_MS)?;
        let age_call = t.elapsed();
        println!(
            "ageout: age_out() for one day took {:.3} ms, floor moved past {} keys ({} buckets), window {:.2} days",
            age_call.as_secs_f64() * 1e3,
            r.keys_aged_out,
            r.buckets_dropped,
            r.window_ms.unwrap_or(0) as f64 / DAY_MS as f64
        );
        let t = Instant::now();
        ks.compact()?;
        let d = t.elapsed();
        println!(
            "ageout: reclaiming compaction {:.1}s, {} keys dropped by the filter, disk {:.2} -> {:.2} GB",
            d.as_secs_f64(),
            ks.reclaimed_keys(),
            before as f64 / 1e9,
            ks.disk_bytes() as f64 / 1e9
        );
    }
    Ok(())
}

/// Absent-key lookups in one column family vs the same keys split over 8
/// time-bucket column families (each lookup must probe every bucket).
fn mechanism(base: &std::path::Path, keys: u64) -> R<()> {
    for buckets in [1u64, 8] {
        let dir = base.join(format!("mechanism-{buckets}"));
        let mut db_opts = Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        let cf_opts = || {
            let mut o = Options::default();
            let mut t = BlockBasedOptions::default();
            t.set_bloom_filter(10.0, false);
            t.set_block_size(16 << 10);
            t.set_format_version(6);
            o.set_block_based_table_factory(&t);
            o.set_compression_type(DBCompressionType::Zstd);
            o
        };
        let names: Vec<String> = (0..buckets).map(|b| format!("bucket{b}")).collect();
        let db =
            DB::open_cf_descriptors(&db_opts, &dir, names.iter().map(|n| ColumnFamilyDescriptor::new(n, cf_opts())))?;
        let per = keys / buckets;
        let writer_opts = cf_opts();
        for (b, name) in names.iter().enumerate() {
            let path = dir.join(format!("load-{b}.sst"));
            let mut w = SstFileWriter::create(&writer_opts);
            w.open(&path)?;
            for i in 0..per {
                let k = loaded_key(b as i32, i, per);
                let mut key = [0u8; 20];
                key[4..].copy_from_slice(&k.id_hash.0);
                w.put(key, [0u8; 31])?;
            }
            w.finish()?;
            let cf = db.cf_handle(name).ok_or("missing cf")?;
            db.ingest_external_file_cf(cf, vec![path])?;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let lookups = 1_000_000u64;
        let t = Instant::now();
        let mut found = 0u64;
        for _ in 0..lookups / BATCH as u64 {
            let ids: Vec<[u8; 20]> = (0..BATCH)
                .map(|_| {
                    let mut key = [0u8; 20];
                    key[4..].copy_from_slice(&random_id(&mut rng).0);
                    key
                })
                .collect();
            for name in &names {
                let cf = db.cf_handle(name).ok_or("missing cf")?;
                for r in db.batched_multi_get_cf(cf, ids.iter(), false) {
                    found += u64::from(r?.is_some());
                }
            }
        }
        let d = t.elapsed();
        println!(
            "mechanism: {keys} keys in {buckets} column famil{}: {:.0} absent-key lookups/s ({found} false hits)",
            if buckets == 1 { "y" } else { "ies" },
            per_sec(lookups, d)
        );
        drop(db);
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}
