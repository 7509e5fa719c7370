//! Appending to the WAL: group commit and the fsync policy.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::frame::{write_frame, MAX_PAYLOAD};
use crate::storage::codec::encode_event;
use crate::storage::error::IoContext;
use crate::storage::fs::{AppendFile, FileSystem};
use crate::storage::{failpoint, fsutil, FsyncPolicy, StorageError, StorageObserver, StoredEvent};

/// The active (unsealed) WAL file.
///
/// Invariant: bytes `0..synced_len` of the file are durable; `synced_len..len`
/// were written but may be lost on power failure (only possible with
/// [`FsyncPolicy::Interval`]).
pub(crate) struct WalWriter {
    seq: u64,
    path: PathBuf,
    file: Box<dyn AppendFile>,
    len: u64,
    synced_len: u64,
    last_sync: Instant,
    frame_buf: Vec<u8>,
    payload_buf: Vec<u8>,
}

impl WalWriter {
    /// Creates WAL file `seq` in `dir` (which must not exist yet) and makes
    /// its directory entry durable: without the directory fsync an fsynced
    /// frame could vanish together with its file after a power loss.
    /// `skip_dir_fsync` is the simulator's deliberate bug
    /// ([`Mutation::WalCreatedWithoutDirFsync`](crate::pipeline::Mutation)),
    /// never set outside test builds.
    pub(crate) fn create(
        fs: &dyn FileSystem,
        dir: &Path,
        seq: u64,
        skip_dir_fsync: bool,
    ) -> Result<WalWriter, StorageError> {
        let path = super::wal_path(dir, seq);
        let file = fs.create_append(&path).at(&path)?;
        if !skip_dir_fsync {
            fsutil::fsync_dir(fs, dir)?;
        }
        Ok(WalWriter {
            seq,
            path,
            file,
            len: 0,
            synced_len: 0,
            last_sync: Instant::now(),
            frame_buf: Vec::new(),
            payload_buf: Vec::new(),
        })
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn synced_len(&self) -> u64 {
        self.synced_len
    }

    /// Writes `events` as one frame (more if over [`MAX_PAYLOAD`]) with a
    /// single `write`. Durability is the caller's next step: [`WalWriter::sync`]
    /// when [`WalWriter::sync_due_after_write`] says so (group commit: one
    /// fsync per `append` with `Always`, at most one per interval otherwise).
    pub(crate) fn write(&mut self, events: &[&StoredEvent], crash_at: Option<&str>) -> Result<(), StorageError> {
        self.frame_buf.clear();
        let mut i = 0;
        while i < events.len() {
            self.payload_buf.clear();
            self.payload_buf.extend_from_slice(&0u32.to_le_bytes());
            let mut count = 0u32;
            while i < events.len() && (count == 0 || self.payload_buf.len() < MAX_PAYLOAD / 2) {
                encode_event(events[i], &mut self.payload_buf);
                count += 1;
                i += 1;
            }
            self.payload_buf[0..4].copy_from_slice(&count.to_le_bytes());
            write_frame(&mut self.frame_buf, &self.payload_buf);
        }
        self.file.append(&self.frame_buf).at(&self.path)?;
        self.len += self.frame_buf.len() as u64;
        failpoint::check("wal_after_write", crash_at)
    }

    /// Whether the policy wants an fsync right after a write.
    pub(crate) fn sync_due_after_write(&self, policy: &FsyncPolicy) -> bool {
        match policy {
            FsyncPolicy::Always => true,
            FsyncPolicy::Interval(every) => self.last_sync.elapsed() >= *every,
        }
    }

    /// Makes everything written so far durable. An error here must poison the
    /// caller: after a failed fsync the kernel may have dropped the dirty pages
    /// and marked them clean, so a retry could "succeed" over lost data.
    pub(crate) fn sync(&mut self, observer: &dyn StorageObserver) -> Result<(), StorageError> {
        if self.synced_len == self.len {
            self.last_sync = Instant::now();
            return Ok(());
        }
        let started = Instant::now();
        self.file.sync_data().at(&self.path)?;
        observer.wal_fsync(started.elapsed());
        self.synced_len = self.len;
        self.last_sync = Instant::now();
        Ok(())
    }

    /// True when an interval policy's deadline has passed with unsynced bytes.
    pub(crate) fn sync_due(&self, policy: &FsyncPolicy) -> bool {
        match policy {
            FsyncPolicy::Always => self.synced_len < self.len,
            FsyncPolicy::Interval(every) => self.synced_len < self.len && self.last_sync.elapsed() >= *every,
        }
    }

    /// Bytes written but not yet fsynced.
    pub(crate) fn unsynced_bytes(&self) -> u64 {
        self.len - self.synced_len
    }
}
