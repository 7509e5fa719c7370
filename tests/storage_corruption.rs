//! Corruption on committed fixtures (tests/fixtures/storage/<case>/usage).
//!
//! Each case is the same small store — 20 events flushed to segment 1, then
//! three WAL frames of 10 events in WAL file 3 — with one byte flipped. The
//! bytes are committed; `regenerate_fixtures` (ignored) rewrites them:
//! `cargo test --test storage_corruption -- --ignored regenerate_fixtures`.
//! Tests copy a fixture to a temp directory first, since open repairs in place.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dedupd::storage::testutil::sample_event;
use dedupd::storage::{
    verify, FileKind, FileStatus, NoopObserver, RecoveryPath, StorageError, StorageObserver, StoreOptions, StoredEvent,
    UsageStore,
};

const EVENTS: u64 = 50;

fn all_events() -> Vec<StoredEvent> {
    (0..EVENTS).map(|n| sample_event(n, 0, n as i64)).collect()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/storage")
}

fn wal3(usage: &Path) -> PathBuf {
    usage.join("wal").join(format!("{:020}.wal", 3))
}

fn flip(path: &Path, at: impl FnOnce(usize) -> usize) {
    let mut b = std::fs::read(path).expect("read");
    let i = at(b.len());
    b[i] ^= 0x40;
    std::fs::write(path, b).expect("write");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("ls") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// A temp copy of fixture `case`; returns (guard, usage dir).
fn fixture(case: &str) -> (tempfile::TempDir, PathBuf) {
    let src = fixtures().join(case).join("usage");
    assert!(src.is_dir(), "missing committed fixture {}", src.display());
    let tmp = tempfile::tempdir().expect("tempdir");
    let usage = tmp.path().join("usage");
    copy_dir(&src, &usage);
    (tmp, usage)
}

#[derive(Default)]
struct Counting {
    sidecar: AtomicUsize,
    fallback: AtomicUsize,
}

impl StorageObserver for Counting {
    fn recovery_segment(&self, path: RecoveryPath) {
        match path {
            RecoveryPath::Sidecar => self.sidecar.fetch_add(1, Ordering::Relaxed),
            RecoveryPath::Fallback => self.fallback.fetch_add(1, Ordering::Relaxed),
        };
    }
}

fn contents(store: &UsageStore) -> Result<Vec<StoredEvent>, StorageError> {
    let mut out = Vec::new();
    store.for_each_event(|e| out.push(e.clone()))?;
    out.sort_by_key(|e| e.key.output);
    Ok(out)
}

fn build_clean(usage: &Path) {
    let (mut store, _) = UsageStore::open(usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    let all = all_events();
    store.append(&all[0..10]).expect("append");
    store.append(&all[10..20]).expect("append");
    store.flush().expect("flush");
    for chunk in all[20..].chunks(10) {
        store.append(chunk).expect("append");
    }
    // Dropped, not closed: the last 30 events stay in the WAL.
    drop(store);
}

#[test]
#[ignore = "rewrites the committed fixtures"]
fn regenerate_fixtures() {
    let root = fixtures();
    let _ = std::fs::remove_dir_all(&root);
    type Corrupt = fn(&Path);
    let cases: [(&str, Corrupt); 6] = [
        ("clean", |_| {}),
        ("wal_tail_flip", |u| flip(&wal3(u), |len| len - 3)),
        // Inside the first frame's payload: two valid frames follow it.
        ("wal_middle_flip", |u| flip(&wal3(u), |_| 40)),
        ("segment_flip", |u| flip(&u.join("segments").join(format!("{:020}.seg", 1)), |len| len / 2)),
        ("sidecar_flip", |u| flip(&u.join("segments").join(format!("{:020}.idx", 1)), |_| 24 + 68 * 3 + 5)),
        ("manifest_newest_flip", |u| flip(&u.join("manifest").join(format!("MANIFEST-{:020}", 2)), |len| len - 4)),
    ];
    for (case, corrupt) in cases {
        let usage = root.join(case).join("usage");
        build_clean(&usage);
        corrupt(&usage);
    }
}

#[test]
fn the_clean_fixture_opens_with_every_event_and_verifies() {
    let (_tmp, usage) = fixture("clean");
    let report = verify(&usage).expect("verify");
    assert!(report.is_clean(), "{report}");
    let (store, rec) = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    assert_eq!(rec.manifest_generation, 2);
    assert_eq!(rec.wal_events_replayed, 30);
    assert!(rec.torn_tail.is_none());
    assert_eq!(contents(&store).expect("contents"), all_events());
}

#[test]
fn a_flipped_byte_in_the_wal_tail_is_truncated_and_earlier_frames_are_kept() {
    let (_tmp, usage) = fixture("wal_tail_flip");
    let report = verify(&usage).expect("verify");
    let wal = report.files.iter().find(|f| f.path == wal3(&usage)).expect("wal 3 in report");
    assert!(matches!(wal.status, FileStatus::TornTail { .. }), "{report}");

    let (store, rec) = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    assert!(matches!(&rec.torn_tail, Some(t) if t.file == wal3(&usage) && t.dropped_bytes > 0), "{rec:?}");
    assert_eq!(contents(&store).expect("contents"), all_events()[..40].to_vec());
    assert_eq!(store.checkpoint(0), Some(39));
    drop(store);
    // The truncation is durable: a second open finds a clean log.
    let (_, rec) = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("reopen");
    assert!(rec.torn_tail.is_none());
    assert!(verify(&usage).expect("verify").is_clean());
}

#[test]
fn a_flipped_byte_in_the_middle_of_the_wal_is_a_hard_error_naming_file_and_offset() {
    let (_tmp, usage) = fixture("wal_middle_flip");
    let r = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver));
    let expected = wal3(&usage);
    assert!(matches!(&r, Err(StorageError::WalMidLogCorruption { file, offset: 0, .. }) if *file == expected), "{r:?}");
    let msg = r.expect_err("hard error").to_string();
    assert!(msg.contains(&expected.display().to_string()) && msg.contains("offset 0"), "{msg}");
    // Nothing was truncated or skipped: a second attempt fails the same way.
    assert!(matches!(
        UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)),
        Err(StorageError::WalMidLogCorruption { .. })
    ));
    let report = verify(&usage).expect("verify");
    assert!(!report.is_clean());
    assert!(report.problems().any(|f| f.kind == FileKind::Wal && f.path == expected), "{report}");
}

#[test]
fn a_flipped_byte_in_a_segment_is_reported_by_verify_and_by_reads_of_that_segment() {
    let (_tmp, usage) = fixture("segment_flip");
    let seg = usage.join("segments").join(format!("{:020}.seg", 1));
    let report = verify(&usage).expect("verify");
    assert!(!report.is_clean());
    let bad: Vec<_> = report.problems().collect();
    assert!(
        matches!(bad.as_slice(), [f] if f.path == seg && matches!(f.status, FileStatus::Corrupt { .. })),
        "{report}"
    );
    let printed = report.to_string();
    assert!(printed.contains(&format!("segment  {} CORRUPT", seg.display())), "{printed}");
    assert!(printed.ends_with("1 corrupt or missing"), "{printed}");

    // Documented behaviour: open does not read segment bodies, so it succeeds;
    // the hot-cache rebuild goes through the intact sidecar; reading events of
    // the damaged segment fails naming it.
    let observer = Arc::new(Counting::default());
    let (store, _) = UsageStore::open(&usage, StoreOptions::default(), observer.clone()).expect("open");
    let keys = store.recent_keys(0, i64::MIN, usize::MAX).expect("recent keys");
    assert_eq!(keys, all_events().iter().map(|e| e.key).collect::<Vec<_>>());
    assert_eq!(observer.sidecar.load(Ordering::Relaxed), 1);
    let r = contents(&store);
    assert!(
        matches!(&r, Err(StorageError::ChecksumMismatch { file, .. } | StorageError::Corrupt { file, .. }) if *file == seg),
        "{r:?}"
    );
    assert!(store.get(Some(0), &all_events()[5].key.id_hash).is_err());
    assert_eq!(
        store.get(Some(0), &all_events()[45].key.id_hash).expect("memtable get"),
        Some(all_events()[45].clone())
    );
}

#[test]
fn a_flipped_byte_in_a_sidecar_takes_the_fallback_scan_and_counts_it() {
    let (_tmp, usage) = fixture("sidecar_flip");
    let idx = usage.join("segments").join(format!("{:020}.idx", 1));
    let report = verify(&usage).expect("verify");
    assert!(report.problems().any(|f| f.path == idx && f.kind == FileKind::Sidecar), "{report}");

    let observer = Arc::new(Counting::default());
    let (store, _) = UsageStore::open(&usage, StoreOptions::default(), observer.clone()).expect("open");
    let keys = store.recent_keys(0, i64::MIN, usize::MAX).expect("recent keys");
    assert_eq!(keys, all_events().iter().map(|e| e.key).collect::<Vec<_>>());
    assert_eq!(observer.fallback.load(Ordering::Relaxed), 1);
    assert_eq!(observer.sidecar.load(Ordering::Relaxed), 0);
    assert_eq!(store.get(Some(0), &all_events()[3].key.id_hash).expect("get"), Some(all_events()[3].clone()));
    assert_eq!(contents(&store).expect("contents"), all_events());
}

#[test]
fn a_flipped_byte_in_the_newest_manifest_falls_back_to_the_previous_generation() {
    let (_tmp, usage) = fixture("manifest_newest_flip");
    let newest = usage.join("manifest").join(format!("MANIFEST-{:020}", 2));
    let report = verify(&usage).expect("verify");
    assert_eq!(report.manifest_generation, Some(1));
    assert!(report.problems().any(|f| f.path == newest), "{report}");

    let (mut store, rec) = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("open");
    assert_eq!(rec.manifest_generation, 1);
    assert!(matches!(rec.skipped_manifests.as_slice(), [(p, _)] if *p == newest), "{rec:?}");
    // Generation 1 predates the flush; its WAL files were kept, so nothing is lost.
    assert_eq!(contents(&store).expect("contents"), all_events());
    assert_eq!(store.checkpoint(0), Some(49));
    // The next generation is numbered past the damaged one.
    store.flush().expect("flush");
    assert!(store.generation() > 2);
    drop(store);
    let (store, rec) = UsageStore::open(&usage, StoreOptions::default(), Arc::new(NoopObserver)).expect("reopen");
    assert!(rec.skipped_manifests.is_empty());
    assert_eq!(contents(&store).expect("contents"), all_events());
}

/// What open refuses, verify must not call clean: a live WAL file gone
/// from the middle of the run (its events are nowhere else in the usage
/// store), data with no manifest left to name it, and a segment that
/// passes its own checksums but is not the one the manifest recorded
/// (copied in from another state directory under the same name).
#[test]
fn verify_reports_a_missing_live_wal_file_data_without_a_manifest_and_a_segment_from_elsewhere() {
    let open = |usage: &Path| UsageStore::open(usage, StoreOptions::default(), Arc::new(NoopObserver));
    let problem = |usage: &Path, kind: FileKind, missing: bool| {
        let report = verify(usage).expect("verify");
        assert!(!report.is_clean(), "{report}");
        let found = report.problems().any(|f| f.kind == kind && (f.status == FileStatus::Missing) == missing);
        assert!(found, "no {kind:?} problem reported: {report}");
    };

    let (_a, usage) = fixture("clean");
    drop(open(&usage).expect("open"));
    // Live WAL files are now 3 and 4 (each open starts one); 3 holds the
    // last 30 events.
    std::fs::remove_file(wal3(&usage)).expect("rm");
    assert!(matches!(open(&usage), Err(StorageError::MissingWal { .. })));
    problem(&usage, FileKind::Wal, true);

    let (_b, usage) = fixture("clean");
    for m in std::fs::read_dir(usage.join("manifest")).expect("ls") {
        std::fs::remove_file(m.expect("entry").path()).expect("rm");
    }
    assert!(matches!(open(&usage), Err(StorageError::NoValidManifest { .. })));
    problem(&usage, FileKind::Manifest, true);

    let (_c, usage) = fixture("clean");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let (mut other, _) = open(elsewhere.path()).expect("open");
    other.append(&all_events()[0..10]).expect("append");
    other.flush().expect("flush");
    drop(other);
    for ext in ["seg", "idx"] {
        let name = format!("{:020}.{ext}", 1);
        std::fs::copy(elsewhere.path().join("segments").join(&name), usage.join("segments").join(&name)).expect("cp");
    }
    problem(&usage, FileKind::Segment, false);
}

/// The first live WAL file removed (files before it gone with a flush)
/// and the next renamed down to its number: one live file is left, no
/// number missing and no file before it to check against; its own link
/// still names the removed file, and open and verify refuse it.
#[test]
fn the_first_live_wal_file_removed_and_the_next_renamed_down_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let usage = tmp.path().join("usage");
    let opts = StoreOptions { wal_rotate_bytes: 1024, ..StoreOptions::default() };
    let (mut store, _) = UsageStore::open(&usage, opts.clone(), Arc::new(NoopObserver)).expect("open");
    let events = all_events();
    // Two flushes: the files the manifest before the last one named are
    // kept for it, and go with the second.
    let quarters: Vec<&[StoredEvent]> = events.chunks(events.len().div_ceil(4)).collect();
    for (i, quarter) in quarters.iter().enumerate() {
        for chunk in quarter.chunks(5) {
            store.append(chunk).expect("append");
        }
        if i < 2 {
            store.flush().expect("flush");
        }
    }
    drop(store);
    let list = |usage: &Path| -> Vec<PathBuf> {
        let mut wal: Vec<PathBuf> =
            std::fs::read_dir(usage.join("wal")).expect("ls").map(|e| e.expect("entry").path()).collect();
        wal.sort();
        wal
    };
    let seq = |p: &Path| -> u64 { p.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse().ok()).expect("seq") };
    // Where the live files start, as the newest manifest says (verify
    // prints it); the files below it are kept for the manifest before.
    let report = verify(&usage).expect("verify");
    let newest = report.files.iter().find(|f| f.kind == FileKind::Manifest).expect("a manifest");
    let wal_start: u64 =
        newest.detail.rsplit("wal_start ").next().and_then(|n| n.trim().parse().ok()).expect("wal_start");
    let wal: Vec<PathBuf> = list(&usage).into_iter().filter(|p| seq(p) >= wal_start).collect();
    assert!(wal_start > 1 && wal.len() >= 2, "two live files after the flushes, the first ones gone: {wal:?}");
    std::fs::remove_file(&wal[0]).expect("remove the first live file");
    for pair in wal.windows(2) {
        std::fs::rename(&pair[1], &pair[0]).expect("renumber");
    }
    let reopened = UsageStore::open(&usage, opts, Arc::new(NoopObserver));
    assert!(
        matches!(&reopened, Err(StorageError::WalMidLogCorruption { file, .. }) if file == &wal[0]),
        "{:?}",
        reopened.map(|_| ())
    );
    let report = verify(&usage).expect("verify");
    assert!(report.problems().any(|f| f.path == wal[0]), "{report}");
}

/// A sealed WAL file is never written again, and each newer file opens
/// with a link frame recording where the one before it ended. A sealed
/// file cut at a frame boundary, or emptied, holds only valid frames, so
/// nothing in it shows the loss: the link does. Open refuses it (its
/// events are nowhere else in the usage store; a later file's would move
/// the checkpoint past them) and verify reports it.
///
/// A sealed file removed with the files after it renumbered down (so no
/// number is missing) is refused too: the renamed file's link names the
/// removed one (checked for every file, the first live one included; see
/// `check_own_link`'s test).
#[test]
fn a_sealed_wal_file_cut_at_a_frame_boundary_or_emptied_is_a_hard_error_and_verify_says_so() {
    for damage in ["emptied", "cut to its first batch", "removed, the later files renumbered"] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let usage = tmp.path().join("usage");
        let opts = StoreOptions { wal_rotate_bytes: 4096, ..StoreOptions::default() };
        let (mut store, _) = UsageStore::open(&usage, opts.clone(), Arc::new(NoopObserver)).expect("open");
        for chunk in all_events().chunks(5) {
            store.append(chunk).expect("append");
        }
        drop(store);
        let mut wal: Vec<PathBuf> =
            std::fs::read_dir(usage.join("wal")).expect("ls").map(|e| e.expect("entry").path()).collect();
        wal.sort();
        assert!(wal.len() >= 3, "rotation made several files: {wal:?}");
        let middle = &wal[1];
        let bytes = std::fs::read(middle).expect("read");
        // The link frame (16-byte header, 16-byte payload), then batches.
        let header = |at: usize| u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes")) as usize;
        assert_eq!(header(0), 16, "the file opens with its link");
        let first_batch_end = 32 + 16 + header(32);
        assert!(first_batch_end < bytes.len(), "the middle file holds more than one batch");
        // The file open names as corrupt: the damaged one, or for a
        // removal the renamed file whose link names the removed one.
        let named = match damage {
            "emptied" | "cut to its first batch" => {
                let len = if damage == "emptied" { 0 } else { first_batch_end };
                std::fs::OpenOptions::new().write(true).open(middle).expect("open").set_len(len as u64).expect("cut");
                middle
            }
            _ => {
                std::fs::remove_file(middle).expect("remove");
                for pair in wal[1..].windows(2) {
                    std::fs::rename(&pair[1], &pair[0]).expect("renumber");
                }
                middle
            }
        };
        let reopened = UsageStore::open(&usage, opts.clone(), Arc::new(NoopObserver));
        assert!(
            matches!(&reopened, Err(StorageError::WalMidLogCorruption { file, .. }) if file == named),
            "{damage}: {:?}",
            reopened.map(|_| ())
        );
        let report = verify(&usage).expect("verify");
        assert!(report.problems().any(|f| &f.path == named), "{damage}: {report}");
    }
}
