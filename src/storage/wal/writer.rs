//! Appending to the WAL: group commit and the fsync policy.
//!
//! With `--fsync always` a batch's write returns a [`PendingSync`] instead of
//! fsyncing under the store's lock. The caller waits on it after letting the
//! lock go, so other partitions' batches append meanwhile; the first waiter
//! to find no fsync running becomes the leader and fsyncs everything
//! written by then (through [`FileSyncer`], a second handle on the file),
//! and every batch that fsync covers returns with it: one fsync for every
//! batch waiting at that moment.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::frame::{write_frame, MAX_PAYLOAD};
use crate::storage::codec::encode_event;
use crate::storage::error::IoContext;
use crate::storage::fs::{AppendFile, FileSyncer, FileSystem};
use crate::storage::{failpoint, fsutil, FsyncPolicy, StorageError, StorageObserver, StoredEvent};

/// What the group commit knows of the active WAL file, shared by the store
/// (under its lock) and the batches waiting for their fsync (outside it).
pub(crate) struct GroupCommit {
    state: Mutex<Commits>,
    /// Signalled when an fsync ends (well or not).
    fsync_ended: Condvar,
}

struct Commits {
    /// The active file: its number, a handle to fsync it through, and its path.
    seq: u64,
    file: Option<Arc<dyn FileSyncer>>,
    path: PathBuf,
    /// Bytes of the active file handed to the kernel, and known durable.
    written: u64,
    durable: u64,
    /// A leader's fsync is running.
    syncing: bool,
    /// The first failed fsync: after it nothing is known durable again (the
    /// kernel may have dropped the dirty pages and marked them clean), and
    /// the store refuses all work.
    failed: Option<String>,
}

impl GroupCommit {
    pub(crate) fn new() -> Arc<GroupCommit> {
        Arc::new(GroupCommit {
            state: Mutex::new(Commits {
                seq: 0,
                file: None,
                path: PathBuf::new(),
                written: 0,
                durable: 0,
                syncing: false,
                failed: None,
            }),
            fsync_ended: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Commits> {
        // Only counters live under this lock, each written in one statement.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The first failed fsync, if any.
    pub(crate) fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Bytes of file `seq` known durable (0 for a file no longer active: the
    /// writer that asks knows its own file).
    fn durable(&self, seq: u64) -> u64 {
        let st = self.lock();
        if st.seq == seq {
            st.durable
        } else {
            0
        }
    }

    /// Waits until byte `len` of WAL file `seq` is durable, fsyncing as the
    /// leader when no fsync is running. A file older than the active one
    /// was fsynced whole before the next was created.
    fn wait(&self, seq: u64, len: u64, observer: &dyn StorageObserver) -> Result<(), StorageError> {
        let mut st = self.lock();
        loop {
            if let Some(cause) = &st.failed {
                return Err(StorageError::Poisoned { cause: cause.clone() });
            }
            if st.seq > seq || st.durable >= len {
                return Ok(());
            }
            if st.syncing {
                st = self.fsync_ended.wait(st).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let Some(file) = st.file.clone() else {
                return Err(StorageError::Poisoned { cause: "no WAL file to fsync".to_string() });
            };
            let (path, target) = (st.path.clone(), st.written);
            st = self.fsync_as_leader(st, file.as_ref(), &path, target, observer);
        }
    }

    /// One fsync of the active file, covering its first `target` bytes, with
    /// no other running: the first fsync to see a writeback error is the
    /// only one the kernel tells (a later one of the same file succeeds over
    /// the lost pages), so fsyncs of one file never overlap, and the failure
    /// is recorded before anyone is told anything newer is durable. Takes
    /// and returns the lock, letting it go for the fsync itself.
    fn fsync_as_leader<'a>(
        &'a self,
        mut st: MutexGuard<'a, Commits>,
        file: &dyn FileSyncer,
        path: &Path,
        target: u64,
        observer: &dyn StorageObserver,
    ) -> MutexGuard<'a, Commits> {
        let file_seq = st.seq;
        st.syncing = true;
        drop(st);
        // Should the fsync or the observer panic, waiters must not sleep
        // forever behind a fsync that will never end.
        let leading = Leading(self);
        let started = Instant::now();
        let synced = file.sync_data();
        observer.wal_fsync(started.elapsed());
        std::mem::forget(leading);
        let mut st = self.lock();
        st.syncing = false;
        match synced {
            Ok(()) if st.seq == file_seq => st.durable = st.durable.max(target),
            Ok(()) => {}
            Err(e) => {
                let failure = StorageError::Io { path: path.to_path_buf(), source: e };
                st.failed.get_or_insert_with(|| failure.to_string());
            }
        }
        self.fsync_ended.notify_all();
        st
    }
}

/// Held by a leader over its fsync; dropped only by a panic, which it
/// records as a failure so that waiters wake and fail.
struct Leading<'a>(&'a GroupCommit);

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.syncing = false;
        st.failed.get_or_insert_with(|| "a WAL fsync panicked".to_string());
        self.0.fsync_ended.notify_all();
    }
}

/// A batch's WAL bytes, written and not yet known durable: see the module
/// doc. [`wait`](PendingSync::wait) returns once an fsync covers them.
#[must_use = "a batch is durable only once its pending fsync is waited for"]
pub struct PendingSync {
    commits: Arc<GroupCommit>,
    observer: Arc<dyn StorageObserver>,
    seq: u64,
    len: u64,
    crash_at: Option<String>,
}

impl std::fmt::Debug for PendingSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSync").field("wal", &self.seq).field("through_byte", &self.len).finish()
    }
}

impl PendingSync {
    /// Blocks until the batch's bytes are durable. An error means they may
    /// not be, ever: the store is poisoned, and the process must stop and
    /// repair from the output topic.
    pub fn wait(self) -> Result<(), StorageError> {
        self.commits.wait(self.seq, self.len, self.observer.as_ref())?;
        let crashed = failpoint::check("wal_after_fsync", self.crash_at.as_deref());
        if let Err(e) = &crashed {
            // The store stops here, as a process would.
            self.commits.lock().failed.get_or_insert_with(|| e.to_string());
        }
        crashed
    }
}

/// The active (unsealed) WAL file.
///
/// Invariant: bytes `0..synced_len()` of the file are durable; the rest
/// were written but may be lost on power failure (with
/// [`FsyncPolicy::Interval`], or with `Always` until the batch's
/// [`PendingSync`] is waited for).
pub(crate) struct WalWriter {
    seq: u64,
    path: PathBuf,
    file: Box<dyn AppendFile>,
    commits: Arc<GroupCommit>,
    len: u64,
    /// Durable by this writer's own fsyncs; group commits add to it
    /// (see [`synced_len`](WalWriter::synced_len)).
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
    ///
    /// `commits` is the store's group commit, which moves to this file: every
    /// byte of the previous one must already be durable.
    /// Creates WAL file `seq`, opened by a link frame recording where the
    /// file before it ended (`previous`: its seq and length; none for a new
    /// store's first file). The link is fsynced at once (one fsync a
    /// rotation or an open): a new file's length is then durable, as it was
    /// when new files were empty, which the group commit's accounting and
    /// `unsynced_bytes` rely on.
    pub(crate) fn create(
        fs: &dyn FileSystem,
        dir: &Path,
        seq: u64,
        previous: Option<(u64, u64)>,
        skip_dir_fsync: bool,
        commits: &Arc<GroupCommit>,
    ) -> Result<WalWriter, StorageError> {
        let path = super::wal_path(dir, seq);
        let mut file = fs.create_append(&path).at(&path)?;
        if !skip_dir_fsync {
            fsutil::fsync_dir(fs, dir)?;
        }
        let mut link = Vec::new();
        if let Some((previous_seq, previous_len)) = previous {
            super::frame::write_link_frame(&mut link, previous_seq, previous_len);
            file.append(&link).at(&path)?;
        }
        let len = link.len() as u64;
        let syncer = file.syncer().at(&path)?;
        if len > 0 {
            syncer.sync_data().at(&path)?;
        }
        {
            let mut st = commits.lock();
            st.seq = seq;
            st.file = Some(syncer);
            st.path = path.clone();
            st.written = len;
            st.durable = len;
        }
        Ok(WalWriter {
            seq,
            path,
            file,
            commits: Arc::clone(commits),
            len,
            synced_len: len,
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

    /// Bytes of this file known durable, by this writer's fsyncs or a
    /// group commit's.
    pub(crate) fn synced_len(&self) -> u64 {
        self.synced_len.max(self.commits.durable(self.seq))
    }

    /// What a caller waits on for everything written so far to be durable.
    pub(crate) fn pending(&self, observer: &Arc<dyn StorageObserver>, crash_at: Option<&str>) -> PendingSync {
        PendingSync {
            commits: Arc::clone(&self.commits),
            observer: Arc::clone(observer),
            seq: self.seq,
            len: self.len,
            crash_at: crash_at.map(str::to_string),
        }
    }

    /// Writes `events` as one frame (more if over [`MAX_PAYLOAD`]) with a
    /// single `write`. Durability is the caller's next step: with `Always`,
    /// a [`PendingSync`] ([`pending`](WalWriter::pending)) waited for; with
    /// an interval, [`WalWriter::sync`] when
    /// [`WalWriter::sync_due_after_write`] says so.
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
        self.commits.lock().written = self.len;
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
    ///
    /// Called under the store's lock (rotation, flush, upkeep, close). It
    /// takes its turn with the group commit's fsyncs, never beside one (see
    /// `GroupCommit::fsync_as_leader`); waiting for a running one needs
    /// nothing the store's lock guards.
    pub(crate) fn sync(&mut self, observer: &dyn StorageObserver) -> Result<(), StorageError> {
        let commits = Arc::clone(&self.commits);
        let mut st = commits.lock();
        loop {
            if let Some(cause) = &st.failed {
                return Err(StorageError::Poisoned { cause: cause.clone() });
            }
            if !st.syncing {
                break;
            }
            st = commits.fsync_ended.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        let durable = if st.seq == self.seq { st.durable } else { 0 };
        if self.synced_len.max(durable) < self.len {
            let file = st.file.clone();
            st = match file {
                Some(file) if st.seq == self.seq => {
                    commits.fsync_as_leader(st, file.as_ref(), &self.path, self.len, observer)
                }
                _ => return Err(StorageError::Poisoned { cause: "no WAL file to fsync".to_string() }),
            };
            if let Some(cause) = &st.failed {
                return Err(StorageError::Poisoned { cause: cause.clone() });
            }
        }
        drop(st);
        self.synced_len = self.len;
        self.last_sync = Instant::now();
        Ok(())
    }

    /// True when an interval policy's deadline has passed with unsynced bytes.
    pub(crate) fn sync_due(&self, policy: &FsyncPolicy) -> bool {
        match policy {
            FsyncPolicy::Always => self.synced_len() < self.len,
            FsyncPolicy::Interval(every) => self.synced_len() < self.len && self.last_sync.elapsed() >= *every,
        }
    }

    /// Bytes written but not yet fsynced.
    pub(crate) fn unsynced_bytes(&self) -> u64 {
        self.len - self.synced_len()
    }
}
