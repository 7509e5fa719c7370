//! Classification throughput on pre-decoded events: identity hashes (id and
//! canonical payload) plus the hot-cache lookup, with 1M and 10M keys
//! resident; and the memory each resident key costs, measured with a
//! counting allocator (what the process really asked for, table slack
//! included).
//!
//! A third group holds the keys of one partition of 16 under the default
//! partitioner (`low_u64 % 16 == 0`), as a worker's cache does: ids that are
//! not uniform in the bits the partitioner reads.
//!
//! Run: `cargo bench --bench classify`. Figures go in the note.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use rust_decimal::Decimal;

use dedupd::classify::{Candidate, ClassifierSettings, HotCache, NoLongHorizon, PartitionClassifier, SeenKey};
use dedupd::event::{id_hash, payload_hash_with, EventKind, IdHash, PayloadHash, Position, UsageEvent};

struct Counting;
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const NOW_MS: i64 = 1_795_262_400_000;
const BATCH: usize = 1000;

fn event(n: u64) -> UsageEvent {
    UsageEvent {
        event_id: format!("evt_{n:012}"),
        event_id_derived: false,
        tenant_id: ["acme", "globex", "initech"][(n % 3) as usize].to_owned(),
        customer_id: format!("cus_{}", n % 5000),
        meter: "api_calls".to_owned(),
        quantity: Decimal::new((n % 100_000) as i64, 3),
        timestamp_ms: NOW_MS - (n % 86_400_000) as i64,
        kind: EventKind::Usage,
        correction_ref: None,
        resource_id: Some(format!("req-{n}")),
        unit: Some("requests".to_owned()),
        source: Some("edge-1".to_owned()),
        dimensions: vec![("region".to_owned(), "eu".to_owned()), ("tier".to_owned(), "pro".to_owned())],
    }
}

fn resident_key(n: u64) -> SeenKey {
    let h = blake3::hash(&n.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.as_bytes()[..16]);
    let mut p = [0u8; 16];
    p.copy_from_slice(&h.as_bytes()[16..]);
    SeenKey {
        id_hash: IdHash(id),
        payload_hash: PayloadHash(p),
        first_seen_ms: NOW_MS - 1000,
        source: Position::new(0, n as i64),
        output: Position::new(0, n as i64),
    }
}

fn filled(resident: u64) -> (PartitionClassifier, f64) {
    let settings = ClassifierSettings {
        hot_ttl_ms: 7 * 86_400_000,
        hot_capacity: resident as usize,
        horizon_ms: 35 * 86_400_000,
        detect_replays: true,
    };
    let before = ALLOCATED.load(Ordering::Relaxed);
    let mut c = PartitionClassifier::new(0, settings);
    for n in 0..resident {
        c.commit(std::iter::once(&resident_key(n)), NOW_MS);
    }
    let after = ALLOCATED.load(Ordering::Relaxed);
    let per_entry = (after - before) as f64 / resident as f64;
    (c, per_entry)
}

fn bench(c: &mut Criterion) {
    let events: Vec<UsageEvent> = (0..100_000u64).map(event).collect();
    for resident in [1_000_000u64, 10_000_000] {
        let (classifier, per_entry) = filled(resident);
        eprintln!(
            "hot cache: {resident} keys resident, {per_entry:.1} bytes per entry (allocator view), estimate {} bytes",
            classifier.hot_cache().heap_bytes() / resident as usize
        );
        let mut group = c.benchmark_group(format!("classify_{}M_resident", resident / 1_000_000));
        group.throughput(Throughput::Elements(BATCH as u64));
        group.sample_size(20);
        let mut start = 0usize;
        // Mostly-new traffic: every event is absent from the cache.
        group.bench_function("hash_and_lookup_new", |b| {
            b.iter_batched(
                || {
                    start = (start + BATCH) % (events.len() - BATCH);
                    start
                },
                |s| {
                    let mut scratch = Vec::with_capacity(256);
                    let batch: Vec<Candidate> = events[s..s + BATCH]
                        .iter()
                        .enumerate()
                        .map(|(i, e)| Candidate {
                            id_hash: id_hash(&e.tenant_id, &e.event_id),
                            payload_hash: payload_hash_with(e, &mut scratch),
                            source: Position::new(0, i as i64),
                        })
                        .collect();
                    classifier.classify(&batch, &NoLongHorizon, NOW_MS)
                },
                BatchSize::SmallInput,
            )
        });
        // All-duplicate traffic: every lookup hits a resident key.
        let hits: Vec<Candidate> = (0..BATCH as u64 * 50)
            .map(|n| {
                let k = resident_key(n * (resident / (BATCH as u64 * 50)));
                Candidate { id_hash: k.id_hash, payload_hash: k.payload_hash, source: Position::new(0, -1) }
            })
            .collect();
        let mut hit_start = 0usize;
        group.bench_function("lookup_resident_duplicates", |b| {
            b.iter(|| {
                hit_start = (hit_start + BATCH) % (hits.len() - BATCH);
                classifier.classify(&hits[hit_start..hit_start + BATCH], &NoLongHorizon, NOW_MS)
            })
        });
        group.finish();
    }
}

/// `count` keys whose ids the default partitioner sends to partition 0 of
/// `partitions`, starting the search at `n`.
fn keys_of_partition_zero(partitions: u64, mut n: u64, count: usize) -> Vec<SeenKey> {
    let mut keys = Vec::with_capacity(count);
    while keys.len() < count {
        let k = resident_key(n);
        if k.id_hash.low_u64() % partitions == 0 {
            keys.push(k);
        }
        n += 1;
    }
    keys
}

/// The hot cache alone, holding 1M keys of one partition of 16: filling it
/// (printed, one pass), then looking up ids it holds and ids it does not.
fn one_partition_of_sixteen(c: &mut Criterion) {
    const RESIDENT: usize = 1_000_000;
    let resident = keys_of_partition_zero(16, 0, RESIDENT);
    let absent = keys_of_partition_zero(16, 1 << 40, 50 * BATCH);
    let mut cache = HotCache::new(0, 7 * 86_400_000, RESIDENT);
    let t = std::time::Instant::now();
    for k in &resident {
        cache.insert(k, NOW_MS);
    }
    eprintln!(
        "hot cache, one partition of 16: {RESIDENT} inserts in {:.0} ms ({:.0} ns each)",
        t.elapsed().as_secs_f64() * 1e3,
        t.elapsed().as_nanos() as f64 / RESIDENT as f64
    );
    let mut group = c.benchmark_group("hot_cache_1M_one_partition_of_16");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    let stride = RESIDENT / (50 * BATCH);
    let hits: Vec<IdHash> = (0..50 * BATCH).map(|i| resident[i * stride].id_hash).collect();
    let misses: Vec<IdHash> = absent.iter().map(|k| k.id_hash).collect();
    for (name, ids) in [("get_resident", &hits), ("get_absent", &misses)] {
        let mut start = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                start = (start + BATCH) % (ids.len() - BATCH);
                ids[start..start + BATCH].iter().filter(|id| cache.get(id, NOW_MS).is_some()).count()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench, one_partition_of_sixteen);
criterion_main!(benches);
