//! Usage store benchmarks: ingest throughput under both fsync policies
//! (batches of 1,000), hot-cache recovery through sidecars vs segment scans,
//! a conflict's original and a storm's batch of 100 originals,
//! and bytes on disk per event.
//!
//! `DEDUPD_BENCH_EVENTS` sets the recovery store size (default 1,000,000).
//! The store lives in a temp dir under `$TMPDIR` (put it on the disk you mean to measure).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dedupd::storage::testutil::{sample_event, sample_event_at};
use dedupd::storage::{FsyncPolicy, NoopObserver, StorageObserver, StoreOptions, StoredEvent, UsageStore};
use std::sync::atomic::{AtomicU64, Ordering};

const BATCH: usize = 1000;

/// Sums WAL fsync latency, to tell disk time from CPU time in the ingest figures.
#[derive(Default)]
struct FsyncTimer {
    count: AtomicU64,
    nanos: AtomicU64,
}

impl StorageObserver for FsyncTimer {
    fn wal_fsync(&self, took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }
}

fn batch(base: u64) -> Vec<StoredEvent> {
    (0..BATCH as u64).map(|i| sample_event(base + i, 0, (base + i) as i64)).collect()
}

fn dir_bytes(dir: &Path, ext: &str) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().extension().and_then(|x| x.to_str()) == Some(ext))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(6));
    group.throughput(Throughput::Elements(BATCH as u64));
    // A pool of distinct batches, re-offset per iteration outside the timer.
    let pool: Vec<Vec<StoredEvent>> = (0..16).map(|i| batch(i * BATCH as u64)).collect();
    for (name, policy) in [
        ("fsync_always", FsyncPolicy::Always),
        ("fsync_interval_250ms", FsyncPolicy::Interval(Duration::from_millis(250))),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = StoreOptions { fsync: policy, ..StoreOptions::default() };
        let timer = Arc::new(FsyncTimer::default());
        let (mut store, _) = UsageStore::open(dir.path(), opts, timer.clone()).expect("open");
        let mut next_offset = 0i64;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let mut events = pool[(i % 16) as usize].clone();
                    for e in &mut events {
                        e.key.output.offset = next_offset;
                        next_offset += 1;
                    }
                    let started = Instant::now();
                    let stored = store.append(&events).expect("append");
                    total += started.elapsed();
                    assert_eq!(stored, BATCH);
                }
                total
            })
        });
        store.close().expect("close");
        let count = timer.count.load(Ordering::Relaxed).max(1);
        eprintln!(
            "{name}: {} WAL fsyncs for {} events, mean fsync {:.2} ms",
            count,
            next_offset,
            timer.nanos.load(Ordering::Relaxed) as f64 / count as f64 / 1e6
        );
    }
    group.finish();
}

fn recovery(c: &mut Criterion) {
    let n: u64 = std::env::var("DEDUPD_BENCH_EVENTS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let with_sidecars = dir.path().join("sidecars");
    let started = Instant::now();
    {
        let opts = StoreOptions { fsync: FsyncPolicy::Interval(Duration::from_secs(1)), ..StoreOptions::default() };
        let (mut store, _) = UsageStore::open(&with_sidecars, opts, Arc::new(NoopObserver)).expect("open");
        let mut base = 0;
        while base < n {
            store.append(&batch(base)).expect("append");
            base += BATCH as u64;
        }
        store.close().expect("close");
    }
    let segs = with_sidecars.join("segments");
    let (seg_bytes, idx_bytes) = (dir_bytes(&segs, "seg"), dir_bytes(&segs, "idx"));
    eprintln!(
        "store of {n} events built in {:.1?}: segments {:.1} B/event, sidecars {:.1} B/event, total {:.1} B/event",
        started.elapsed(),
        seg_bytes as f64 / n as f64,
        idx_bytes as f64 / n as f64,
        (seg_bytes + idx_bytes) as f64 / n as f64
    );
    {
        // WAL bytes per event: one WAL file of 100 batches.
        let wal_dir = dir.path().join("walsize");
        let (mut store, _) = UsageStore::open(&wal_dir, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
        for i in 0..100 {
            store.append(&batch(i * BATCH as u64)).expect("append");
        }
        eprintln!("WAL: {:.1} B/event", dir_bytes(&wal_dir.join("wal"), "wal") as f64 / (100 * BATCH) as f64);
        drop(store);
    }
    // The same store without sidecars: every segment takes the fallback scan.
    let without = dir.path().join("scan");
    std::fs::create_dir_all(without.join("segments")).expect("mkdir");
    for sub in ["wal", "manifest"] {
        std::fs::create_dir_all(without.join(sub)).expect("mkdir");
        for e in std::fs::read_dir(with_sidecars.join(sub)).expect("ls").flatten() {
            std::fs::copy(e.path(), without.join(sub).join(e.file_name())).expect("copy");
        }
    }
    for e in std::fs::read_dir(&segs).expect("ls").flatten() {
        if e.path().extension().and_then(|x| x.to_str()) == Some("seg") {
            std::fs::hard_link(e.path(), without.join("segments").join(e.file_name())).expect("link");
        }
    }

    let mut group = c.benchmark_group("recovery");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(n));
    for (name, path) in [("sidecar", &with_sidecars), ("segment_scan", &without)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let (store, _) = UsageStore::open(path, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
                let keys = store.recent_keys(0, i64::MIN, usize::MAX).expect("recent keys");
                assert_eq!(keys.len() as u64, n);
                keys.len()
            })
        });
    }
    // For scale: a scan that decodes every column of every row, as a
    // row-oriented store (or a reader without column projection) would.
    group.bench_function("full_decode_scan", |b| {
        b.iter(|| {
            let (store, _) = UsageStore::open(&without, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
            let mut count = 0u64;
            store.for_each_event(|_| count += 1).expect("scan");
            assert_eq!(count, n);
            count
        })
    });
    group.finish();
}

/// A conflict's original: the lookup by first-seen time the hot path makes
/// (one segment) against the full scan of every sidecar `inspect` makes, in
/// a store of `DEDUPD_BENCH_SEGMENTS` (default 200) segments of 1,000 events
/// written a minute apart. Originals are drawn evenly from the whole history.
/// Both decode only the row, but decompress whole columns of its segment:
/// what remains of the cost grows with the segment's size (1,000 rows here).
fn conflict_original(c: &mut Criterion) {
    let segments: u64 = std::env::var("DEDUPD_BENCH_SEGMENTS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    // Each event first seen a millisecond after the one before, a minute
    // between segments.
    let (_dir, store, all) = history(segments, true, |s, i| s as i64 * 60_000 + i as i64);
    let keys: Vec<_> = all.into_iter().step_by(97).collect();
    let mut group = c.benchmark_group("conflict_original");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    group.bench_function(format!("by_first_seen_{segments}_segments"), |b| {
        b.iter(|| {
            let k = keys[i % keys.len()];
            i += 1;
            store.get_first_seen(0, &k.id_hash, k.first_seen_ms).expect("lookup").expect("found")
        })
    });
    group.bench_function(format!("scan_{segments}_segments"), |b| {
        b.iter(|| {
            let k = keys[i % keys.len()];
            i += 1;
            store.get(Some(0), &k.id_hash).expect("lookup").expect("found")
        })
    });
    group.finish();
}

/// A conflict storm's batch of originals, as the worker asks for them: 100
/// at once, drawn evenly from a history written as a worker writes it (each
/// batch of 1,000 shares one first-seen time, so each original has four or
/// five candidate groups). Reported per original.
fn storm_batch_originals(c: &mut Criterion) {
    let segments: u64 = std::env::var("DEDUPD_BENCH_SEGMENTS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let (_dir, store, keys) = history(segments, false, |s, _| s as i64 * 50);
    let keys: Vec<_> = keys.iter().map(|k| (k.id_hash, k.first_seen_ms)).collect();
    let mut group = c.benchmark_group("conflict_original");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(100));
    let mut walk = 0u64;
    group.bench_function(format!("storm_batch_of_100_{segments}k_events"), |b| {
        b.iter(|| {
            let wanted: Vec<_> = (0..100)
                .map(|_| {
                    walk = walk.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    keys[(walk >> 33) as usize % keys.len()]
                })
                .collect();
            let found = store.get_first_seen_many(0, &wanted).expect("lookup");
            assert!(found.iter().all(Option::is_some));
            found
        })
    });
    group.finish();
}

criterion_group!(benches, ingest, recovery, conflict_original, storm_batch_originals);
criterion_main!(benches);

/// A store of `segments` batches of 1,000 sample events (event `i` of batch
/// `s` first seen `first_seen(s, i)` ms after 1_700_000_000_000), flushed
/// after each batch or once at the end, and every event's key in order.
fn history(
    segments: u64,
    flush_each_batch: bool,
    first_seen: impl Fn(u64, u64) -> i64,
) -> (tempfile::TempDir, UsageStore, Vec<dedupd::classify::SeenKey>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        fsync: FsyncPolicy::Interval(Duration::from_secs(1)),
        memtable_max_events: usize::MAX,
        compaction_min_segments: usize::MAX,
        retention_ms: i64::MAX / 4,
        ..StoreOptions::default()
    };
    let (mut store, _) = UsageStore::open(dir.path(), opts, Arc::new(NoopObserver)).expect("open");
    let mut keys = Vec::new();
    for s in 0..segments {
        let events: Vec<StoredEvent> = (0..BATCH as u64)
            .map(|i| {
                let n = s * BATCH as u64 + i;
                sample_event_at(n, 0, n as i64, 1_700_000_000_000 + first_seen(s, i))
            })
            .collect();
        store.append(&events).expect("append");
        if flush_each_batch {
            store.flush().expect("flush");
        }
        keys.extend(events.iter().map(|e| e.key));
    }
    if !flush_each_batch {
        store.flush().expect("flush");
    }
    (dir, store, keys)
}
