//! Behaviour of the usage store across reopen, flush, compaction, retention
//! and crashes at every named failpoint.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dedupd::storage::testutil::{sample_event, sample_event_at};
use dedupd::storage::{
    failpoint, FsyncPolicy, NoopObserver, RecoveryPath, StorageError, StorageObserver, StoreOptions, StoredEvent,
    UsageStore,
};

#[derive(Default)]
struct Counting {
    sidecar: AtomicUsize,
    fallback: AtomicUsize,
    fsyncs: AtomicUsize,
}

impl StorageObserver for Counting {
    fn wal_fsync(&self, _took: Duration) {
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
    }
    fn recovery_segment(&self, path: RecoveryPath) {
        match path {
            RecoveryPath::Sidecar => self.sidecar.fetch_add(1, Ordering::Relaxed),
            RecoveryPath::Fallback => self.fallback.fetch_add(1, Ordering::Relaxed),
        };
    }
}

fn open(dir: &Path, opts: StoreOptions) -> UsageStore {
    UsageStore::open(dir, opts, Arc::new(NoopObserver)).expect("open").0
}

fn contents(store: &UsageStore) -> BTreeMap<(i32, i64), StoredEvent> {
    let mut out = BTreeMap::new();
    store
        .for_each_event(|e| {
            out.insert((e.key.output.partition, e.key.output.offset), e.clone());
        })
        .expect("scan");
    out
}

fn events(range: std::ops::Range<u64>, partition: i32) -> Vec<StoredEvent> {
    range.map(|n| sample_event(n, partition, n as i64)).collect()
}

#[test]
fn appended_events_survive_a_reopen_without_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path(), StoreOptions::default());
    assert_eq!(store.append(&events(0..100, 0)).expect("append"), 100);
    assert_eq!(store.append(&events(100..150, 1)).expect("append"), 50);
    let before = contents(&store);
    drop(store);
    let (store, report) =
        UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver)).expect("reopen");
    assert_eq!(report.wal_events_replayed, 150);
    assert!(report.torn_tail.is_none());
    assert_eq!(contents(&store), before);
    assert_eq!(store.checkpoint(0), Some(99));
    assert_eq!(store.checkpoint(1), Some(149));
    assert_eq!(store.checkpoint(2), None);
}

#[test]
fn appending_at_or_below_the_checkpoint_is_a_no_op() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path(), StoreOptions::default());
    assert_eq!(store.append(&events(0..10, 0)).expect("append"), 10);
    assert_eq!(store.append(&events(0..10, 0)).expect("replay"), 0);
    assert_eq!(store.append(&events(5..15, 0)).expect("overlap"), 5);
    store.flush().expect("flush");
    assert_eq!(store.append(&events(0..15, 0)).expect("replay after flush"), 0);
    drop(store);
    let store = open(dir.path(), StoreOptions::default());
    assert_eq!(contents(&store).len(), 15);
    assert_eq!(store.checkpoint(0), Some(14));
}

#[test]
fn flushed_segments_serve_get_and_recent_keys_like_the_memtable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions { memtable_max_events: 40, ..StoreOptions::default() };
    let mut store = open(dir.path(), opts.clone());
    let all: Vec<StoredEvent> = (0..100).map(|n| sample_event(n, (n % 2) as i32, n as i64)).collect();
    for chunk in all.chunks(10) {
        store.append(chunk).expect("append");
    }
    assert_eq!(store.segments().len(), 2, "two flushes at 40 events each");
    assert_eq!(store.memtable_len(), 20);
    for e in &all {
        let got = store.get(Some(e.key.output.partition), &e.key.id_hash).expect("get");
        assert_eq!(got.as_ref(), Some(e));
    }
    assert_eq!(store.get(Some(5), &all[0].key.id_hash).expect("get"), None);

    let since = all[49].key.first_seen_ms;
    let keys = store.recent_keys(1, since, usize::MAX).expect("recent");
    let expected: Vec<_> =
        all.iter().filter(|e| e.key.output.partition == 1 && e.key.first_seen_ms > since).map(|e| e.key).collect();
    assert_eq!(keys, expected);
    let newest3 = store.recent_keys(1, i64::MIN, 3).expect("recent");
    let p1: Vec<_> = all.iter().filter(|e| e.key.output.partition == 1).map(|e| e.key).collect();
    assert_eq!(newest3, p1[p1.len() - 3..].to_vec());

    let all_partitions = store.recent_keys_all(since, usize::MAX).expect("recent all");
    assert_eq!(all_partitions.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(all_partitions[&1], keys);
    assert_eq!(all_partitions[&0], store.recent_keys(0, since, usize::MAX).expect("recent"));

    store.close().expect("close");
    let (store, report) = UsageStore::open(dir.path(), opts, Arc::new(NoopObserver)).expect("reopen");
    assert_eq!(report.wal_events_replayed, 0, "close flushed everything");
    assert_eq!(contents(&store).len(), 100);
}

#[test]
fn recovery_reads_only_sidecars_of_segments_inside_the_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path(), StoreOptions::default());
    for seg in 0..4i64 {
        let batch: Vec<_> =
            (0..10).map(|i| sample_event_at((seg * 10 + i) as u64, 0, seg * 10 + i, seg * 1000 + i)).collect();
        store.append(&batch).expect("append");
        store.flush().expect("flush");
    }
    drop(store);
    let observer = Arc::new(Counting::default());
    let (store, _) = UsageStore::open(dir.path(), StoreOptions::default(), observer.clone()).expect("open");
    let keys = store.recent_keys(0, 2000, usize::MAX).expect("recent");
    assert_eq!(keys.len(), 19, "segment 2 from first_seen 2001 on, and all of segment 3");
    assert_eq!(observer.sidecar.load(Ordering::Relaxed), 2, "segments 0 and 1 are skipped by the manifest range");
    assert_eq!(observer.fallback.load(Ordering::Relaxed), 0);
}

#[test]
fn compaction_merges_small_segments_and_keeps_every_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions { compaction_min_segments: 3, ..StoreOptions::default() };
    let mut store = open(dir.path(), opts.clone());
    for i in 0..5u64 {
        store.append(&events(i * 20..(i + 1) * 20, 0)).expect("append");
        store.flush().expect("flush");
    }
    let before = contents(&store);
    let report = store.maintain(1_700_000_000_000).expect("maintain");
    assert_eq!(report.compacted_segments, 5);
    assert!(report.compacted_into.is_some());
    assert_eq!(store.segments().len(), 1);
    assert_eq!(contents(&store), before);
    for e in before.values() {
        assert_eq!(store.get(None, &e.key.id_hash).expect("get").as_ref(), Some(e));
    }
    drop(store);
    let store = open(dir.path(), opts);
    assert_eq!(contents(&store), before);
    let files = std::fs::read_dir(dir.path().join("segments")).expect("ls").count();
    assert_eq!(files, 2 * 6, "the previous generation's segments are kept until the next generation");
}

#[test]
fn retention_drops_data_first_seen_before_the_window_but_keeps_checkpoints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions { retention_ms: 1000, compaction_min_segments: 2, ..StoreOptions::default() };
    let mut store = open(dir.path(), opts.clone());
    let old: Vec<_> = (0..10).map(|i| sample_event_at(i, 0, i as i64, 100 + i as i64)).collect();
    let mixed: Vec<_> = (10..20).map(|i| sample_event_at(i, 0, i as i64, 1000 + (i as i64 - 10) * 100)).collect();
    let new: Vec<_> = (20..30).map(|i| sample_event_at(i, 0, i as i64, 5000 + i as i64)).collect();
    for batch in [&old, &mixed, &new] {
        store.append(batch).expect("append");
        store.flush().expect("flush");
    }
    let report = store.maintain(2500).expect("maintain");
    assert_eq!(report.expired_segments, 1);
    assert_eq!(report.expired_rows, 10 + 5, "the old segment, and mixed rows first seen before 1500");
    let kept: Vec<i64> = contents(&store).keys().map(|(_, o)| *o).collect();
    assert_eq!(kept, (15..30).collect::<Vec<_>>());
    assert_eq!(store.checkpoint(0), Some(29));
    assert_eq!(store.append(&old).expect("replay"), 0, "retention never lets old offsets back in");
}

#[test]
fn a_crash_at_any_failpoint_loses_nothing_acknowledged() {
    for name in failpoint::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = StoreOptions { compaction_min_segments: 2, ..StoreOptions::default() };
        let mut store = open(dir.path(), opts.clone());
        let mut acked: BTreeMap<(i32, i64), StoredEvent> = BTreeMap::new();
        for i in 0..3u64 {
            let batch = events(i * 10..(i + 1) * 10, 0);
            store.append(&batch).expect("append");
            acked.extend(batch.into_iter().map(|e| ((0, e.key.output.offset), e)));
            store.flush().expect("flush");
        }
        drop(store);
        let mut store = open(dir.path(), StoreOptions { crash_at: Some(name.to_string()), ..opts.clone() });
        let batch = events(30..40, 0);
        let appended = store.append(&batch);
        let mut hit = appended.is_err();
        if appended.is_ok() {
            acked.extend(batch.iter().map(|e| ((0, e.key.output.offset), e.clone())));
            let flushed = store.flush();
            hit |= flushed.is_err();
            if flushed.is_ok() {
                hit |= store.maintain(1_700_000_000_000).is_err();
            }
        }
        assert!(hit, "failpoint {name} was never reached");
        assert!(matches!(store.append(&events(40..41, 0)), Err(StorageError::Poisoned { .. })), "{name}");
        store.simulate_crash(0).expect("crash");

        let store = open(dir.path(), opts.clone());
        let got = contents(&store);
        for (k, e) in &acked {
            assert_eq!(got.get(k), Some(e), "failpoint {name}: event {k:?} lost");
        }
        assert!(got.len() <= 40, "failpoint {name}: {} events", got.len());
        assert!(dedupd::storage::verify(dir.path()).expect("verify").is_clean(), "failpoint {name}");
    }
}

#[test]
fn interval_fsync_keeps_a_prefix_of_batches_after_power_loss() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions { fsync: FsyncPolicy::Interval(Duration::from_secs(3600)), ..StoreOptions::default() };
    let mut store = open(dir.path(), opts.clone());
    store.append(&events(0..10, 0)).expect("append");
    store.flush().expect("flush makes it durable");
    store.append(&events(10..20, 0)).expect("append");
    let frame_len = store.unsynced_wal_bytes();
    store.append(&events(20..30, 0)).expect("append");
    assert!(frame_len > 0 && store.unsynced_wal_bytes() > frame_len);
    // Keep the first unsynced frame whole and half of the second: a torn tail.
    store.simulate_crash(frame_len + frame_len / 2).expect("crash");
    let (store, report) = UsageStore::open(dir.path(), opts, Arc::new(NoopObserver)).expect("reopen");
    assert!(report.torn_tail.is_some());
    assert_eq!(contents(&store).len(), 20);
    assert_eq!(store.checkpoint(0), Some(19));
}

#[test]
fn fsync_policy_parses_the_documented_spellings() {
    assert!(matches!("always".parse::<FsyncPolicy>(), Ok(FsyncPolicy::Always)));
    assert!(
        matches!("interval:250".parse::<FsyncPolicy>(), Ok(FsyncPolicy::Interval(d)) if d == Duration::from_millis(250))
    );
    for bad in ["", "sometimes", "interval:", "interval:0", "interval:-5", "interval:1.5"] {
        assert!(matches!(bad.parse::<FsyncPolicy>(), Err(StorageError::InvalidOption { key: "fsync", .. })), "{bad:?}");
    }
    assert_eq!(FsyncPolicy::Interval(Duration::from_millis(250)).to_string(), "interval:250");
}

#[test]
fn every_always_append_is_one_fsync() {
    let dir = tempfile::tempdir().expect("tempdir");
    let observer = Arc::new(Counting::default());
    let (mut store, _) = UsageStore::open(dir.path(), StoreOptions::default(), observer.clone()).expect("open");
    for i in 0..5 {
        store.append(&events(i * 100..(i + 1) * 100, 0)).expect("append");
    }
    assert_eq!(observer.fsyncs.load(Ordering::Relaxed), 5);
}

#[test]
fn wal_files_rotate_by_size_and_replay_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions { wal_rotate_bytes: 4096, ..StoreOptions::default() };
    let mut store = open(dir.path(), opts.clone());
    for i in 0..20 {
        store.append(&events(i * 10..(i + 1) * 10, 0)).expect("append");
    }
    let wal_files = std::fs::read_dir(dir.path().join("wal")).expect("ls").count();
    assert!(wal_files > 3, "{wal_files} WAL files");
    let before = contents(&store);
    drop(store);
    let store = open(dir.path(), opts);
    assert_eq!(contents(&store), before);
    assert_eq!(before.len(), 200);
}

#[test]
fn a_store_whose_manifests_are_gone_refuses_to_start_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path(), StoreOptions::default());
    store.append(&events(0..10, 0)).expect("append");
    store.flush().expect("flush");
    drop(store);
    for entry in std::fs::read_dir(dir.path().join("manifest")).expect("ls") {
        std::fs::remove_file(entry.expect("entry").path()).expect("rm");
    }
    let r = UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver));
    assert!(matches!(r, Err(StorageError::NoValidManifest { .. })));
}

/// Runs in a child process (see the next test): opens the store named by the
/// environment and flushes, which must abort at `DEDUPD_FAILPOINT`.
#[test]
fn child_process_flushes_until_the_failpoint_aborts_it() {
    let Ok(dir) = std::env::var("DEDUPD_STORAGE_TEST_CHILD_DIR") else { return };
    let mut store = open(Path::new(&dir), StoreOptions::default());
    store.append(&events(0..10, 0)).expect("append");
    store.flush().expect("flush");
    store.append(&events(10..20, 0)).expect("append");
    store.flush().expect("flush");
    std::process::exit(0);
}

#[test]
fn the_failpoint_environment_variable_aborts_the_process_at_the_named_step() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child_process_flushes_until_the_failpoint_aborts_it", "--test-threads=1"])
        .env("DEDUPD_STORAGE_TEST_CHILD_DIR", dir.path())
        .env("DEDUPD_FAILPOINT", "flush_after_manifest")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("spawn");
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{status:?}");
    // It died right after the first manifest swap: the first flush is durable.
    let store = open(dir.path(), StoreOptions::default());
    assert_eq!(store.segments().len(), 1);
    assert_eq!(contents(&store).len(), 10);
}

#[test]
fn a_crash_during_the_very_first_open_leaves_a_store_that_opens_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let crashing = StoreOptions { crash_at: Some("manifest_after_temp".to_string()), ..StoreOptions::default() };
    let r = UsageStore::open(dir.path(), crashing, Arc::new(NoopObserver));
    assert!(matches!(r, Err(StorageError::Failpoint { name: "manifest_after_temp" })));
    let (mut store, report) =
        UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    assert!(report.created);
    assert_eq!(store.append(&events(0..3, 0)).expect("append"), 3);
}

/// A first open whose manifest never became durable, then a second open
/// that made WAL file 2 (its link frame fsynced) before a power loss took
/// the manifest again: WAL files with no events and no manifest are a
/// store that never stored anything, made afresh, not refused on every
/// start for want of a manifest. A WAL file with events and no manifest
/// is still refused.
#[test]
fn wal_files_holding_only_a_link_frame_and_no_manifest_are_a_fresh_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(open(dir.path(), StoreOptions::default()));
    drop(open(dir.path(), StoreOptions::default()));
    let wal2 = dir.path().join("wal").join(format!("{:020}.wal", 2));
    assert_eq!(std::fs::metadata(&wal2).expect("wal 2").len(), 32, "WAL 2 holds its link frame only");
    for m in std::fs::read_dir(dir.path().join("manifest")).expect("ls") {
        std::fs::remove_file(m.expect("entry").path()).expect("rm manifest");
    }
    let (mut store, report) =
        UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    assert!(report.created, "made afresh");
    store.append(&events(0..3, 0)).expect("append");
    drop(store);
    for m in std::fs::read_dir(dir.path().join("manifest")).expect("ls") {
        std::fs::remove_file(m.expect("entry").path()).expect("rm manifest");
    }
    let refused = UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver));
    assert!(matches!(refused, Err(StorageError::NoValidManifest { .. })), "{:?}", refused.map(|_| ()));
}
