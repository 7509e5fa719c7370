//! `dedupd verify` for the key store: reads every key of every column family
//! with block checksums verified, without changing anything (the database is
//! opened read-only), and every frame of the logs of keys not yet written
//! into RocksDB (`recent.rs`).

use std::path::Path;

use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, ReadOptions, DB};

use super::histogram::merge_meta;
use super::KeystoreError;

/// What verification read, per column family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeystoreVerifyReport {
    /// (column family, entries read) in name order.
    pub column_families: Vec<(String, u64)>,
    /// The logs of applied keys not yet in RocksDB's files, oldest first.
    pub logs: Vec<LogCheck>,
}

/// What one log of applied keys holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogCheck {
    pub path: std::path::PathBuf,
    /// Frames that check: one per apply or partition drop.
    pub frames: u64,
    /// Where the first frame that does not check starts, if one does not.
    pub damaged_at: Option<u64>,
    /// Whether it is the newest log: damage there is a torn tail (a crash
    /// mid-write), which the next open replays up to; in an older log it
    /// is corruption.
    pub newest: bool,
}

impl KeystoreVerifyReport {
    /// No log is damaged anywhere but at the newest one's tail.
    pub fn is_clean(&self) -> bool {
        self.logs.iter().all(|l| l.damaged_at.is_none() || l.newest)
    }
}

/// Reads the whole key store at `dir` with checksum verification. Any
/// corrupt block is an error naming the column family.
pub fn verify(dir: &Path) -> Result<KeystoreVerifyReport, KeystoreError> {
    let opts = Options::default();
    super::store::refuse_lost_current(dir)?;
    let mut cfs = DB::list_cf(&opts, dir).map_err(|source| KeystoreError::Open { dir: dir.to_owned(), source })?;
    cfs.sort();
    // Reading merged values needs the merge operator the writer used.
    let descriptors = cfs.iter().map(|name| {
        let mut cf_opts = Options::default();
        cf_opts.set_merge_operator_associative("dedupd.keystore.meta.v1", merge_meta);
        ColumnFamilyDescriptor::new(name, cf_opts)
    });
    let db = DB::open_cf_descriptors_read_only(&opts, dir, descriptors, false)
        .map_err(|source| KeystoreError::Open { dir: dir.to_owned(), source })?;
    let mut report = KeystoreVerifyReport::default();
    for name in &cfs {
        let cf = db.cf_handle(name).ok_or(KeystoreError::MissingColumnFamily { name: "listed column family" })?;
        let mut read = ReadOptions::default();
        read.set_verify_checksums(true);
        // A full read must not evict the live working set from the cache.
        read.fill_cache(false);
        let mut entries = 0u64;
        for item in db.iterator_cf_opt(&cf, read, IteratorMode::Start) {
            item.map_err(|source| KeystoreError::Rocks { op: "verify read", source })?;
            entries += 1;
        }
        report.column_families.push((name.clone(), entries));
    }
    let recent = dir.join(super::recent::RECENT_DIR);
    if recent.exists() {
        let logs = super::recent::list_logs(&recent)?;
        let newest = logs.last().map(|(seq, _)| *seq);
        for (seq, path) in logs {
            let (frames, good, damaged) = super::recent::read_log(&path)?;
            report.logs.push(LogCheck {
                path,
                frames: frames.len() as u64,
                damaged_at: damaged.then_some(good),
                newest: Some(seq) == newest,
            });
        }
    }
    Ok(report)
}
