//! Model-based test: random sequences of append (with replays), flush,
//! maintain (compaction + retention), crash (power loss keeping part of the
//! unsynced WAL tail) and clean reopen, against an in-memory model. After
//! every step the store's contents and checkpoints equal the model's.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dedupd::storage::testutil::sample_event_at;
use dedupd::storage::{failpoint, FsyncPolicy, NoopObserver, StoreOptions, StoredEvent, UsageStore};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// `count` events on `partition`, the first `replayed` of them re-sending
    /// already stored offsets (must be skipped).
    Append {
        partition: i32,
        count: usize,
        replayed: usize,
        gap: i64,
    },
    Flush,
    Maintain {
        advance_ms: i64,
    },
    Crash {
        unsynced_bytes_kept: u64,
    },
    /// The process dies (page cache survives) at a named failpoint during a
    /// flush and maintenance pass, then restarts.
    CrashAtFailpoint {
        failpoint: usize,
        advance_ms: i64,
    },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3i32, 1..30usize, 0..5usize, 0..3i64)
            .prop_map(|(partition, count, replayed, gap)| Op::Append { partition, count, replayed, gap }),
        1 => Just(Op::Flush),
        2 => (0..4000i64).prop_map(|advance_ms| Op::Maintain { advance_ms }),
        2 => prop_oneof![Just(0u64), 0..20_000u64, Just(u64::MAX)].prop_map(|k| Op::Crash { unsynced_bytes_kept: k }),
        1 => Just(Op::Reopen),
        2 => (0..failpoint::ALL.len(), 0..4000i64)
            .prop_map(|(failpoint, advance_ms)| Op::CrashAtFailpoint { failpoint, advance_ms }),
    ]
}

type Contents = BTreeMap<(i32, i64), StoredEvent>;

struct Model {
    /// What a power loss cannot take.
    durable: Contents,
    durable_checkpoints: BTreeMap<i32, i64>,
    /// Batches acknowledged but not yet fsynced, oldest first.
    pending: Vec<Vec<StoredEvent>>,
    checkpoints: BTreeMap<i32, i64>,
}

impl Model {
    fn all(&self) -> Contents {
        let mut c = self.durable.clone();
        for b in &self.pending {
            c.extend(b.iter().map(|e| ((e.key.output.partition, e.key.output.offset), e.clone())));
        }
        c
    }

    fn mark_durable(&mut self) {
        self.durable = self.all();
        self.pending.clear();
        self.durable_checkpoints = self.checkpoints.clone();
    }
}

/// After maintenance: the store may have dropped what was first seen before
/// `cutoff` (retention), nothing else; the model forgets the same events.
fn accept_retention(model: &mut Model, got: &Contents, cutoff: i64) {
    for (k, e) in &model.all() {
        if !got.contains_key(k) {
            assert!(e.key.first_seen_ms < cutoff, "{k:?} dropped though inside retention");
            model.durable.remove(k);
            for b in &mut model.pending {
                b.retain(|x| (x.key.output.partition, x.key.output.offset) != *k);
            }
        }
    }
}

fn contents(store: &UsageStore) -> Contents {
    let mut out = BTreeMap::new();
    store
        .for_each_event(|e| {
            let previous = out.insert((e.key.output.partition, e.key.output.offset), e.clone());
            assert!(previous.is_none(), "position {} stored twice", e.key.output);
        })
        .expect("scan");
    out
}

fn open(dir: &Path, opts: &StoreOptions) -> UsageStore {
    UsageStore::open(dir, opts.clone(), Arc::new(NoopObserver)).expect("open").0
}

fn run(ops: Vec<Op>, interval: bool, small_wal: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        fsync: if interval { FsyncPolicy::Interval(Duration::from_secs(3600)) } else { FsyncPolicy::Always },
        wal_rotate_bytes: if small_wal { 8 << 10 } else { 64 << 20 },
        memtable_max_events: 40,
        retention_ms: 20_000,
        compaction_target_rows: 70,
        compaction_min_segments: 2,
        compaction_max_rows: 150,
        ..StoreOptions::default()
    };
    let mut store = Some(open(dir.path(), &opts));
    let mut opened_marks = store.as_ref().map(UsageStore::marks);
    let mut model = Model {
        durable: BTreeMap::new(),
        durable_checkpoints: BTreeMap::new(),
        pending: Vec::new(),
        checkpoints: BTreeMap::new(),
    };
    let mut now_ms = 1_000_000i64;
    let mut n = 0u64;
    for op in ops {
        let s = store.as_mut().expect("store open");
        match op {
            Op::Append { partition, count, replayed, gap } => {
                let cp = model.checkpoints.get(&partition).copied();
                let mut batch = Vec::new();
                if let Some(cp) = cp {
                    for off in (cp - replayed as i64 + 1).max(0)..=cp {
                        batch.push(sample_event_at(n, partition, off, now_ms));
                        n += 1;
                    }
                }
                let mut next = cp.map_or(0, |c| c + 1);
                let mut fresh = Vec::new();
                for _ in 0..count {
                    next += gap;
                    now_ms += 7;
                    let e = sample_event_at(n, partition, next, now_ms);
                    n += 1;
                    next += 1;
                    batch.push(e.clone());
                    fresh.push(e);
                }
                let stored = s.append(&batch).expect("append");
                assert_eq!(stored, fresh.len(), "replayed offsets are skipped");
                if let Some(last) = fresh.last() {
                    model.checkpoints.insert(partition, last.key.output.offset);
                }
                model.pending.push(fresh);
                if s.unsynced_wal_bytes() == 0 {
                    model.mark_durable();
                }
            }
            Op::Flush => {
                s.flush().expect("flush");
                model.mark_durable();
            }
            Op::Maintain { advance_ms } => {
                now_ms += advance_ms;
                s.maintain(now_ms).expect("maintain");
                if s.unsynced_wal_bytes() == 0 {
                    model.mark_durable();
                }
                let got = contents(s);
                accept_retention(&mut model, &got, now_ms - opts.retention_ms);
            }
            Op::CrashAtFailpoint { failpoint, advance_ms } => {
                let name = failpoint::ALL[failpoint];
                // A process crash: everything written survives in the page cache.
                store.take().expect("store").simulate_crash(u64::MAX).expect("crash");
                let crashing = StoreOptions { crash_at: Some(name.to_string()), ..opts.clone() };
                let mut s = open(dir.path(), &crashing);
                now_ms += advance_ms;
                if s.flush().is_ok() {
                    let _ = s.maintain(now_ms);
                }
                s.simulate_crash(u64::MAX).expect("crash");
                let s = store.insert(open(dir.path(), &opts));
                opened_marks = Some(s.marks());
                // Replay fsyncs what it recovered, so all of it is durable now.
                model.mark_durable();
                let got = contents(s);
                accept_retention(&mut model, &got, now_ms - opts.retention_ms);
            }
            Op::Crash { unsynced_bytes_kept } => {
                store.take().expect("store").simulate_crash(unsynced_bytes_kept).expect("crash");
                let s = store.insert(open(dir.path(), &opts));
                opened_marks = Some(s.marks());
                let got = contents(s);
                // Recovery keeps the durable data plus a prefix of the unsynced batches.
                let mut candidate = model.durable.clone();
                let mut checkpoints = model.durable_checkpoints.clone();
                let mut matched = candidate == got;
                for b in &model.pending {
                    if matched {
                        break;
                    }
                    for e in b {
                        candidate.insert((e.key.output.partition, e.key.output.offset), e.clone());
                        checkpoints.insert(e.key.output.partition, e.key.output.offset);
                    }
                    matched = candidate == got;
                }
                assert!(
                    matched,
                    "after a crash the store holds neither the durable data nor a prefix of the pending batches"
                );
                model.durable = got;
                model.durable_checkpoints = checkpoints.clone();
                model.checkpoints = checkpoints;
                model.pending.clear();
            }
            Op::Reopen => {
                store.take().expect("store").close().expect("close");
                store = Some(open(dir.path(), &opts));
                opened_marks = store.as_ref().map(UsageStore::marks);
                model.mark_durable();
            }
        }
        let s = store.as_ref().expect("store");
        assert_eq!(contents(s), model.all());
        // What the ledger's fold reads without the store's lock, through
        // the handle it took at open, is what the store holds.
        let marks = opened_marks.as_ref().expect("marks");
        assert_eq!(marks.next_segment_id(), s.next_segment_id(), "next segment id without the lock");
        for p in 0..3 {
            assert_eq!(s.checkpoint(p), model.checkpoints.get(&p).copied(), "checkpoint of partition {p}");
            assert_eq!(marks.checkpoint(p), s.checkpoint(p), "checkpoint of partition {p} without the lock");
        }
    }
    let s = store.take().expect("store");
    s.close().expect("close");
    assert!(dedupd::storage::verify(dir.path()).expect("verify").is_clean());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn store_contents_always_equal_the_model(
        ops in proptest::collection::vec(op(), 1..40),
        interval in any::<bool>(),
        small_wal in any::<bool>(),
    ) {
        run(ops, interval, small_wal);
    }
}
