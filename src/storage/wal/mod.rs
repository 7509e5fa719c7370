//! The write-ahead log: every accepted event is framed, checksummed and
//! appended here before `append` returns; the memtable is its in-memory view.
//!
//! Files are `wal/<seq:020>.wal`, `seq` increasing. The newest file is the
//! active one; older ones are sealed (fsynced before the next was created).
//! The manifest's `wal_start` names the first file not yet captured by a
//! segment; files below it are deleted once no readable manifest generation
//! needs them. Frame format: see [`frame`].

pub(crate) mod frame;
pub(crate) mod reader;
pub(crate) mod writer;

use std::path::{Path, PathBuf};

use super::fs::FileSystem;
use super::StorageError;

pub(crate) fn wal_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.wal"))
}

/// The WAL files in `dir`, sorted by sequence number.
pub(crate) fn list(fs: &dyn FileSystem, dir: &Path) -> Result<Vec<(u64, PathBuf)>, StorageError> {
    super::fsutil::list_numbered(fs, dir, |name| name.strip_suffix(".wal").and_then(|s| s.parse::<u64>().ok()))
}
