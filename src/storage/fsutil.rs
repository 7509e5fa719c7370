//! Small filesystem helpers with the durability rules written once.

use std::path::{Path, PathBuf};

use super::error::IoContext;
use super::fs::FileSystem;
use super::StorageError;

/// fsyncs a directory so a create, rename or unlink in it survives power loss.
pub(crate) fn fsync_dir(fs: &dyn FileSystem, dir: &Path) -> Result<(), StorageError> {
    fs.sync_dir(dir).at(dir)
}

/// Writes `bytes` to `path` atomically and durably: `<path>.tmp`, write,
/// fsync, rename over `path`, fsync the directory. A crash leaves either the
/// old file (or none) or the complete new one, plus possibly a `.tmp` that
/// recovery deletes.
pub(crate) fn write_atomic(
    fs: &dyn FileSystem,
    path: &Path,
    bytes: &[u8],
    after_temp: Option<&'static str>,
    crash_at: Option<&str>,
) -> Result<(), StorageError> {
    let tmp = path.with_extension(tmp_extension(path));
    fs.write_file_synced(&tmp, bytes).at(&tmp)?;
    if let Some(name) = after_temp {
        super::failpoint::check(name, crash_at)?;
    }
    fs.rename(&tmp, path).at(path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    fsync_dir(fs, dir)
}

fn tmp_extension(path: &Path) -> String {
    match path.extension().and_then(|e| e.to_str()) {
        Some(ext) => format!("{ext}.tmp"),
        None => "tmp".to_string(),
    }
}

/// Creates `dir` and any missing parents, one level at a time, fsyncing
/// each new directory's parent so every new entry is durable: syncing only
/// the last parent would leave a new ancestor's own entry to chance, and
/// with it the whole tree below.
pub(crate) fn create_dir_durable(fs: &dyn FileSystem, dir: &Path) -> Result<(), StorageError> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !fs.is_dir(d)).collect();
    for d in missing.into_iter().rev() {
        fs.create_dir_all(d).at(d)?;
        if let Some(parent) = d.parent().filter(|p| !p.as_os_str().is_empty()) {
            fsync_dir(fs, parent)?;
        }
    }
    Ok(())
}

/// Removes a file if present; a missing file is fine (a crash may have removed it already).
pub(crate) fn remove_if_exists(fs: &dyn FileSystem, path: &Path) -> Result<(), StorageError> {
    match fs.remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io(path, e)),
    }
}

/// The files in `dir` whose name `number_of` maps to a number, as
/// `(number, path)` in ascending order. A missing directory has none.
pub(crate) fn list_numbered(
    fs: &dyn FileSystem,
    dir: &Path,
    number_of: impl Fn(&str) -> Option<u64>,
) -> Result<Vec<(u64, PathBuf)>, StorageError> {
    let mut out = Vec::new();
    if !fs.is_dir(dir) {
        return Ok(out);
    }
    for path in fs.list_dir(dir).at(dir)? {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if let Some(n) = number_of(name) {
            out.push((n, path));
        }
    }
    out.sort();
    Ok(out)
}

/// A RocksDB directory that holds table or log files but no `CURRENT`
/// (the file naming the live `MANIFEST`): the first such file found, or
/// `None` when the directory is whole, empty or missing. Opened with
/// `create_if_missing`, RocksDB would start an empty database there and
/// delete the tables as obsolete: a store that lost one small file would
/// lose every key (or every ledger total) with it.
pub(crate) fn rocksdb_data_without_current(dir: &std::path::Path) -> std::io::Result<Option<String>> {
    if dir.join("CURRENT").exists() {
        return Ok(None);
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        // Not `MANIFEST-*`: creating a database writes its first MANIFEST
        // before CURRENT, so one killed in between left a MANIFEST and no
        // data, which opening again simply recreates. Data lives only in
        // tables and write-ahead logs, made after CURRENT.
        if name.ends_with(".sst") || name.ends_with(".log") {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// What an operator can do about [`rocksdb_data_without_current`].
pub(crate) const LOST_CURRENT_ADVICE: &str = "restore CURRENT (one line naming the newest MANIFEST-* file, \
     e.g. `printf 'MANIFEST-000005\\n' > CURRENT`), or move the directory aside and let the state be repaired \
     from the output";

#[cfg(test)]
mod lost_current_tests {
    use super::*;

    /// Only tables and logs make a directory without CURRENT a lost store:
    /// a database killed while being created (its first MANIFEST written,
    /// CURRENT not yet) is created again on the next open, not refused
    /// for good.
    #[test]
    fn a_store_without_current_is_lost_only_when_it_holds_tables_or_logs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        assert_eq!(rocksdb_data_without_current(&d.join("missing")).expect("missing dir"), None);
        for f in ["MANIFEST-000001", "IDENTITY", "LOCK", "LOG", "OPTIONS-000003"] {
            std::fs::write(d.join(f), b"").expect("write");
        }
        assert_eq!(rocksdb_data_without_current(d).expect("list"), None, "a creation killed before CURRENT");
        std::fs::write(d.join("000004.log"), b"x").expect("write");
        assert_eq!(rocksdb_data_without_current(d).expect("list"), Some("000004.log".to_string()));
        std::fs::write(d.join("CURRENT"), b"MANIFEST-000001\n").expect("write");
        assert_eq!(rocksdb_data_without_current(d).expect("list"), None, "whole");
    }
}
