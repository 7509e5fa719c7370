//! Durable classify + apply through the worker's engine seam, over several
//! partitions on worker threads (issue #14, `scripts/bench engine`).
//!
//! Each partition runs the worker's batch work in a loop on real local state
//! (a state directory, fsync as asked): `classify_batch` (decode, validate,
//! both hashes, hot cache and key store lookups, the output records, the
//! ledger preview), then `apply_published` with the output offsets a broker
//! would have given. The one engine lock is taken as `dedupd run` takes it:
//! for each call to local state (the stateless work runs unlocked). Partitions are spread round-robin over the threads; each
//! thread takes its partitions' batches in turn, as a runtime would.
//! Prints events/s for each partition count and the ratio to one partition.
//!
//! ```text
//! cargo bench --bench engine -- [--partitions 1,2,4,8] [--threads N]
//!     [--events-per-partition E] [--fsync always|interval] [--rounds R]
//! ```
//!
//! `--threads` defaults to the machine's cores, so the same command measures
//! a bigger machine unchanged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dedupd::classify::{Clock, SystemClock};
use dedupd::config::EngineSettings;
use dedupd::event::Position;
use dedupd::kafka::batch::{classify_batch, BatchInput, BatchLayout};
use dedupd::kafka::{Engine, StateEngine};
use dedupd::state::LocalState;
use dedupd::storage::FsyncPolicy;

/// As the `dedupd` binary allocates (see `src/main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 1000;

struct Args {
    partitions: Vec<usize>,
    threads: usize,
    events_per_partition: usize,
    fsync: FsyncPolicy,
    rounds: usize,
    /// The key store's memtable size (`--keystore-write-buffer`), to weigh
    /// a smaller one against its flushes and compactions.
    keystore_write_buffer_bytes: u64,
}

fn args() -> Args {
    let mut a = Args {
        partitions: vec![1, 2, 4, 8],
        threads: std::thread::available_parallelism().map_or(2, usize::from),
        events_per_partition: 100_000,
        fsync: FsyncPolicy::Always,
        rounds: 1,
        keystore_write_buffer_bytes: EngineSettings::default().keystore_write_buffer_bytes,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--partitions" => {
                a.partitions = value().split(',').map(|p| p.trim().parse().expect("--partitions: numbers")).collect();
            }
            "--threads" => a.threads = value().parse().expect("--threads: a number"),
            "--events-per-partition" => a.events_per_partition = value().parse().expect("a number"),
            "--rounds" => a.rounds = value().parse().expect("--rounds: a number"),
            "--keystore-write-buffer" => a.keystore_write_buffer_bytes = value().parse().expect("bytes: a number"),
            "--fsync" => {
                a.fsync = match value().as_str() {
                    "always" => FsyncPolicy::Always,
                    "interval" => FsyncPolicy::Interval(Duration::from_millis(250)),
                    other => panic!("--fsync {other}: always or interval"),
                }
            }
            // cargo bench passes --bench; criterion-style filters are not taken.
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(a.threads > 0 && a.rounds > 0 && !a.partitions.is_empty() && a.events_per_partition >= BATCH);
    a
}

/// Partition `p`'s batch `b`: usage events of 2,000 customers × 3 meters
/// over the last two hours, distinct ids across partitions.
fn batch(p: usize, b: usize, now_ms: i64) -> Vec<Vec<u8>> {
    let meters = ["api_calls", "storage_gb", "egress_bytes"];
    (0..BATCH)
        .map(|i| {
            let n = b * BATCH + i;
            format!(
                r#"{{"event_id":"p{p}-evt_{n:09}","tenant_id":"acme","customer_id":"cus_{}","meter":"{}","quantity":"{}","timestamp":{},"kind":"usage"}}"#,
                n % 2000,
                meters[n % 3],
                n % 1000,
                now_ms - (n % 7200) as i64 * 1000
            )
            .into_bytes()
        })
        .collect()
}

/// Counts the usage store's WAL fsyncs: with group commit one may cover
/// several partitions' batches.
#[derive(Default)]
struct Fsyncs {
    count: AtomicU64,
    took_ns: AtomicU64,
}

impl dedupd::storage::StorageObserver for Fsyncs {
    fn wal_fsync(&self, took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.took_ns.fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// Where a run's time went, summed over its threads: inside the engine
/// lock for classification's calls to local state, and for applies.
#[derive(Default)]
struct Spent {
    classify_locked_ns: AtomicU64,
    apply_locked_ns: AtomicU64,
    batch_ns: AtomicU64,
}

fn add(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// One run: `partitions` partitions on `threads` threads: events/s, where
/// the time went, WAL fsyncs per batch and their mean time in ms.
fn run(partitions: usize, a: &Args) -> (f64, Spent, f64, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let settings = EngineSettings {
        fsync: a.fsync.clone(),
        keystore_write_buffer_bytes: a.keystore_write_buffer_bytes,
        ..EngineSettings::default()
    };
    let fsyncs = Arc::new(Fsyncs::default());
    let state =
        LocalState::open_observed(Some(dir.path()), settings.clone(), true, fsyncs.clone()).expect("open local state");
    let engine: Arc<RwLock<Box<dyn Engine>>> =
        Arc::new(RwLock::new(Box::new(StateEngine::new(state, settings.validator()))));
    let now = SystemClock.now_ms();
    for p in 0..partitions {
        engine.write().expect("engine").assign(i32::try_from(p).expect("partition"), now).expect("assign");
    }
    let batches = a.events_per_partition / BATCH;
    // The input, made before the clock starts.
    let input: Vec<Vec<Vec<Vec<u8>>>> =
        (0..partitions).map(|p| (0..batches).map(|b| batch(p, b, now)).collect()).collect();
    let input = Arc::new(input);
    let layout = BatchLayout {
        placement: None,
        conflicts_partitions: 1,
        rejected_partitions: 1,
        max_rejected_raw_bytes: 256 * 1024,
        rollups_partitions: None,
        republish_replays: false,
    };
    let threads = a.threads.min(partitions);
    let spent = Spent::default();
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (engine, input, spent) = (engine.clone(), input.clone(), &spent);
            s.spawn(move || {
                let mine: Vec<usize> = (t..partitions).step_by(threads).collect();
                for b in 0..batches {
                    for &p in &mine {
                        let partition = i32::try_from(p).expect("partition");
                        let base = i64::try_from(b * BATCH).expect("offset");
                        let inputs: Vec<BatchInput<'_>> = input[p][b]
                            .iter()
                            .enumerate()
                            .map(|(i, payload)| BatchInput {
                                offset: base + i as i64,
                                key: None,
                                payload: Some(payload.as_slice()),
                            })
                            .collect();
                        let now_ms = SystemClock.now_ms();
                        let batch_started = Instant::now();
                        // The engine lock for each call to local state, as
                        // the worker takes it.
                        let with = |f: &mut dyn FnMut(&dyn Engine)| {
                            let engine = engine.read().expect("engine");
                            let locked = Instant::now();
                            f(engine.as_ref());
                            add(&spent.classify_locked_ns, locked);
                        };
                        let prepared = classify_batch(&with, partition, &inputs, now_ms, &layout).expect("classify");
                        assert_eq!(prepared.accepted.len(), BATCH, "every event is new");
                        // The broker's answer: output offsets in publish order.
                        let stored: Vec<_> = prepared
                            .accepted
                            .into_iter()
                            .enumerate()
                            .map(|(i, (_, mut s))| {
                                s.key.output = Position::new(partition, base + i as i64);
                                s
                            })
                            .collect();
                        {
                            let engine = engine.read().expect("engine");
                            let locked = Instant::now();
                            engine.apply_published(partition, &stored, now_ms).expect("apply");
                            add(&spent.apply_locked_ns, locked);
                        }
                        add(&spent.batch_ns, batch_started);
                    }
                }
            });
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let count = fsyncs.count.load(Ordering::Relaxed);
    let fsyncs_per_batch = count as f64 / (partitions * batches) as f64;
    let fsync_ms = fsyncs.took_ns.load(Ordering::Relaxed) as f64 / count.max(1) as f64 / 1e6;
    engine.write().expect("engine").close().expect("close");
    ((partitions * batches * BATCH) as f64 / seconds, spent, fsyncs_per_batch, fsync_ms)
}

/// The median round of `a.rounds` by events/s.
fn median_run(partitions: usize, a: &Args) -> (f64, Spent, f64, f64) {
    let mut runs: Vec<(f64, Spent, f64, f64)> = (0..a.rounds).map(|_| run(partitions, a)).collect();
    runs.sort_by(|x, y| x.0.total_cmp(&y.0));
    runs.swap_remove(runs.len() / 2)
}

fn main() {
    // As `dedupd` does at start, so this measures what ships.
    dedupd::process::disable_transparent_huge_pages();
    let a = args();
    println!(
        "engine: durable classify+apply, batches of {BATCH}, {} events per partition, {} thread(s), fsync {:?}, \
         median of {} round(s)",
        a.events_per_partition, a.threads, a.fsync, a.rounds
    );
    println!(
        "{:>10} {:>14} {:>13} {:>18} {:>15} {:>16} {:>12}",
        "partitions", "events/s", "ratio to one", "locked: classify", "locked: apply", "fsyncs per batch", "fsync (ms)"
    );
    let mut one = None;
    for &p in &a.partitions {
        let (rate, spent, fsyncs, fsync_ms) = median_run(p, &a);
        let base = *one.get_or_insert(if p == 1 { rate } else { median_run(1, &a).0 });
        // Shares of the threads' batch time spent holding the engine lock.
        let total = spent.batch_ns.load(Ordering::Relaxed).max(1) as f64;
        let share = |c: &AtomicU64| 100.0 * c.load(Ordering::Relaxed) as f64 / total;
        println!(
            "{p:>10} {rate:>14.0} {:>12.2}x {:>17.0}% {:>14.0}% {fsyncs:>16.2} {fsync_ms:>12.2}",
            rate / base,
            share(&spent.classify_locked_ns),
            share(&spent.apply_locked_ns)
        );
    }
}
