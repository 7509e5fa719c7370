//! One process per state directory.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use fs4::fs_std::FileExt;

use super::error::IoContext;
use super::StorageError;

/// An exclusive `flock` on `<state-dir>/LOCK`, held for the life of the value.
///
/// flock, not a pid file: the kernel drops it when the process dies, even by
/// SIGKILL, so a crash never leaves a stale lock behind. The holder's pid is
/// written into the file only to make the error message useful.
#[derive(Debug)]
pub struct StateDirLock {
    _file: File,
    path: PathBuf,
}

impl StateDirLock {
    /// Takes the lock or fails at once (never waits) naming the directory.
    pub fn acquire(state_dir: &Path) -> Result<StateDirLock, StorageError> {
        super::fsutil::create_dir_durable(&super::fs::RealFs, state_dir)?;
        let path = state_dir.join("LOCK");
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).at(&path)?;
        if !file.try_lock_exclusive().at(&path)? {
            let mut holder = String::new();
            // Best effort: the pid is informational only.
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() { String::new() } else { format!(" (pid {holder})") };
            return Err(StorageError::Locked { dir: state_dir.into(), holder });
        }
        file.set_len(0).at(&path)?;
        file.seek(SeekFrom::Start(0)).at(&path)?;
        file.write_all(std::process::id().to_string().as_bytes()).at(&path)?;
        Ok(StateDirLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_fails_at_once_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = StateDirLock::acquire(dir.path()).expect("first lock");
        let second = StateDirLock::acquire(dir.path());
        assert!(matches!(&second, Err(StorageError::Locked { dir: d, .. }) if d == dir.path()));
        let msg = second.expect_err("locked").to_string();
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        drop(first);
        assert!(StateDirLock::acquire(dir.path()).is_ok());
    }
}
