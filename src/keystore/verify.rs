//! `dedupd verify` for the key store: reads every key of every column family
//! with block checksums verified, without changing anything (the database is
//! opened read-only).

use std::path::Path;

use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, ReadOptions, DB};

use super::histogram::merge_meta;
use super::KeystoreError;

/// What verification read, per column family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeystoreVerifyReport {
    /// (column family, entries read) in name order.
    pub column_families: Vec<(String, u64)>,
}

/// Reads the whole key store at `dir` with checksum verification. Any
/// corrupt block is an error naming the column family.
pub fn verify(dir: &Path) -> Result<KeystoreVerifyReport, KeystoreError> {
    let opts = Options::default();
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
    Ok(report)
}
