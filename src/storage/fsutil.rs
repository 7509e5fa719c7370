//! Small filesystem helpers with the durability rules written once.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::error::IoContext;
use super::StorageError;

/// fsyncs a directory so a create, rename or unlink in it survives power loss.
pub(crate) fn fsync_dir(dir: &Path) -> Result<(), StorageError> {
    File::open(dir).and_then(|d| d.sync_all()).at(dir)
}

/// Writes `bytes` to `path` atomically and durably: `<path>.tmp`, write,
/// fsync, rename over `path`, fsync the directory. A crash leaves either the
/// old file (or none) or the complete new one, plus possibly a `.tmp` that
/// recovery deletes.
pub(crate) fn write_atomic(
    path: &Path,
    bytes: &[u8],
    after_temp: Option<&'static str>,
    crash_at: Option<&str>,
) -> Result<(), StorageError> {
    let tmp = path.with_extension(tmp_extension(path));
    {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).at(&tmp)?;
        f.write_all(bytes).at(&tmp)?;
        f.sync_all().at(&tmp)?;
    }
    if let Some(name) = after_temp {
        super::failpoint::check(name, crash_at)?;
    }
    std::fs::rename(&tmp, path).at(path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    fsync_dir(dir)
}

fn tmp_extension(path: &Path) -> String {
    match path.extension().and_then(|e| e.to_str()) {
        Some(ext) => format!("{ext}.tmp"),
        None => "tmp".to_string(),
    }
}

/// Creates `dir` and its parents, fsyncing the parent so the new entry is durable.
pub(crate) fn create_dir_durable(dir: &Path) -> Result<(), StorageError> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).at(dir)?;
    if let Some(parent) = dir.parent() {
        fsync_dir(parent)?;
    }
    Ok(())
}

/// Removes a file if present; a missing file is fine (a crash may have removed it already).
pub(crate) fn remove_if_exists(path: &Path) -> Result<(), StorageError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io(path, e)),
    }
}

/// The files in `dir` whose name `number_of` maps to a number, as
/// `(number, path)` in ascending order. A missing directory has none.
pub(crate) fn list_numbered(
    dir: &Path,
    number_of: impl Fn(&str) -> Option<u64>,
) -> Result<Vec<(u64, PathBuf)>, StorageError> {
    let mut out = Vec::new();
    if !dir.is_dir() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(dir).at(dir)? {
        let path = entry.at(dir)?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if let Some(n) = number_of(name) {
            out.push((n, path));
        }
    }
    out.sort();
    Ok(out)
}
