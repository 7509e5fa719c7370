//! A faulty disk for the simulator (issue #11): the usage store's
//! [`FileSystem`] seam and the key store's [`KeyTier`] contract, modelled
//! with what a crash keeps and what a failing disk does.
//!
//! # What a power loss keeps
//!
//! - **File bytes** up to the file's last fsync. Bytes appended after it
//!   survive as a random prefix (the page cache writes back in order, as
//!   ext4's `data=ordered` does for appends), and the last bytes of that
//!   prefix may be garbage (a torn sector). A file cut shorter or rewritten
//!   since its last fsync comes back as it was at that fsync.
//! - **Directory entries** (create, rename, unlink, mkdir) up to the
//!   directory's last fsync, then a random prefix of the later changes in
//!   the order they were made (a journalling filesystem commits metadata in
//!   order; a rename is one change, so it is atomic). A file whose entry is
//!   lost is gone with all its bytes, fsynced or not.
//! - A process crash (SIGKILL) keeps everything: the page cache outlives
//!   the process. What is still unsynced stays at risk of a later power loss.
//!
//! # Faults while running
//!
//! Writes fail with `EIO` after writing a random prefix; fsyncs fail with
//! `EIO` and leave the data unsynced; a disk with a capacity fails writes
//! past it with `ENOSPC`, after writing what fits. Not modelled: Linux may
//! drop the dirty pages of a failed fsync and let a later fsync succeed
//! over them. Here a later successful fsync makes them durable, so a
//! retried fsync would look safe; the store never retries one (it poisons
//! itself), and recovery's fsync of a replayed WAL runs in a new process.
//! Faults are drawn from the disk's own seeded generator while switched on.
//!
//! # The key store
//!
//! [`SimKeyStore`] keeps [`KeyStore`](crate::keystore::KeyStore)'s
//! semantics (first delivery wins, the checkpoint written atomically with
//! the batch's keys, replays at or below the checkpoint ignored, a floor
//! hiding aged-out keys, a partition dropped atomically) over a WAL that is
//! not fsynced until `flush`: a power loss keeps a prefix of the write
//! batches since the last flush, as RocksDB's WAL recovery does. It has no
//! size cap (`window_below_floor` is always false).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::classify::{HorizonError, LongHorizon, SeenKey};
use crate::event::IdHash;
use crate::keystore::{KeyTier, KeystoreError};
use crate::sim::SimRng;
use crate::storage::{AppendFile, FileSystem};

/// Which faults the disk injects, per million operations of each kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskFaults {
    pub write_error_per_million: u32,
    pub fsync_error_per_million: u32,
    /// Bytes the disk holds; writes past it fail with `ENOSPC`.
    pub capacity_bytes: Option<u64>,
}

/// What the disk did, for the schedule's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounts {
    pub write_errors: usize,
    pub fsync_errors: usize,
    pub full_disk_errors: usize,
    pub power_losses: usize,
    /// Unsynced bytes a power loss took, over all files.
    pub bytes_lost: usize,
    /// Directory changes a power loss took.
    pub entries_lost: usize,
}

impl std::ops::AddAssign for DiskCounts {
    fn add_assign(&mut self, other: DiskCounts) {
        self.write_errors += other.write_errors;
        self.fsync_errors += other.fsync_errors;
        self.full_disk_errors += other.full_disk_errors;
        self.power_losses += other.power_losses;
        self.bytes_lost += other.bytes_lost;
        self.entries_lost += other.entries_lost;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    File(u64),
    Dir,
}

#[derive(Clone, Debug)]
enum DirOp {
    Link(String, Entry),
    Unlink(String),
    Rename { from: String, to: String, entry: Entry },
}

impl DirOp {
    fn apply(&self, entries: &mut BTreeMap<String, Entry>) {
        match self {
            DirOp::Link(name, e) => {
                entries.insert(name.clone(), *e);
            }
            DirOp::Unlink(name) => {
                entries.remove(name);
            }
            DirOp::Rename { from, to, entry } => {
                entries.remove(from);
                entries.insert(to.clone(), *entry);
            }
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Dir {
    live: BTreeMap<String, Entry>,
    durable: BTreeMap<String, Entry>,
    /// Changes since the last fsync of this directory, in order.
    pending: Vec<DirOp>,
}

#[derive(Clone, Debug, Default)]
struct FileData {
    data: Vec<u8>,
    synced: Vec<u8>,
}

#[derive(Debug)]
struct DiskState {
    root: PathBuf,
    dirs: BTreeMap<PathBuf, Dir>,
    files: BTreeMap<u64, FileData>,
    next_inode: u64,
    faults: DiskFaults,
    rng: SimRng,
    counts: DiskCounts,
}

/// What Linux returns for a failed write or fsync.
fn eio() -> io::Error {
    io::Error::from_raw_os_error(5)
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{} does not exist", path.display()))
}

fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let parent = path.parent().ok_or_else(|| not_found(path))?.to_path_buf();
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| not_found(path))?.to_string();
    Ok((parent, name))
}

impl DiskState {
    fn entry(&self, path: &Path) -> Option<Entry> {
        let (parent, name) = split(path).ok()?;
        self.dirs.get(&parent)?.live.get(&name).copied()
    }

    fn inode(&self, path: &Path) -> io::Result<u64> {
        match self.entry(path) {
            Some(Entry::File(inode)) => Ok(inode),
            _ => Err(not_found(path)),
        }
    }

    fn change_dir(&mut self, parent: &Path, op: DirOp) -> io::Result<()> {
        let dir = self.dirs.get_mut(parent).ok_or_else(|| not_found(parent))?;
        op.apply(&mut dir.live);
        dir.pending.push(op);
        Ok(())
    }

    fn used_bytes(&self) -> u64 {
        let mut used = 0u64;
        for dir in self.dirs.values() {
            for e in dir.live.values() {
                if let Entry::File(inode) = e {
                    used += self.files.get(inode).map_or(0, |f| f.data.len() as u64);
                }
            }
        }
        used
    }

    /// How many of `wanted` bytes a write may put down, and the error to
    /// return after them (if any).
    fn admit_write(&mut self, wanted: usize) -> (usize, Option<io::Error>) {
        if self.rng.chance_per_million(self.faults.write_error_per_million) {
            self.counts.write_errors += 1;
            let written = self.rng.below(wanted as u64 + 1) as usize;
            return (written, Some(eio()));
        }
        if let Some(capacity) = self.faults.capacity_bytes {
            let free = capacity.saturating_sub(self.used_bytes());
            if wanted as u64 > free {
                self.counts.full_disk_errors += 1;
                return (free as usize, Some(enospc()));
            }
        }
        (wanted, None)
    }

    fn admit_fsync(&mut self) -> io::Result<()> {
        if self.rng.chance_per_million(self.faults.fsync_error_per_million) {
            self.counts.fsync_errors += 1;
            return Err(eio());
        }
        Ok(())
    }

    fn write_at_end(&mut self, inode: u64, bytes: &[u8]) -> io::Result<()> {
        let (written, error) = self.admit_write(bytes.len());
        if let Some(f) = self.files.get_mut(&inode) {
            f.data.extend_from_slice(&bytes[..written]);
        }
        error.map_or(Ok(()), Err)
    }

    fn sync_inode(&mut self, inode: u64) -> io::Result<()> {
        self.admit_fsync()?;
        if let Some(f) = self.files.get_mut(&inode) {
            f.synced.clone_from(&f.data);
        }
        Ok(())
    }

    fn power_loss(&mut self) {
        self.counts.power_losses += 1;
        let mut rng = self.rng.clone();
        for dir in self.dirs.values_mut() {
            let kept = rng.below(dir.pending.len() as u64 + 1) as usize;
            self.counts.entries_lost += dir.pending.len() - kept;
            for op in &dir.pending[..kept] {
                op.apply(&mut dir.durable);
            }
            dir.pending.clear();
            dir.live.clone_from(&dir.durable);
        }
        // A directory whose own entry was lost is gone with its contents;
        // parents sort before their children, so one pass settles it.
        let paths: Vec<PathBuf> = self.dirs.keys().cloned().collect();
        for path in paths {
            if path == self.root || !path.starts_with(&self.root) {
                continue;
            }
            let linked = split(&path).ok().is_some_and(|(parent, name)| {
                self.dirs.get(&parent).is_some_and(|d| d.live.get(&name) == Some(&Entry::Dir))
            });
            if !linked {
                self.dirs.remove(&path);
            }
        }
        let mut reachable: Vec<u64> = Vec::new();
        for dir in self.dirs.values() {
            for e in dir.live.values() {
                if let Entry::File(inode) = e {
                    reachable.push(*inode);
                }
            }
        }
        self.files.retain(|inode, _| reachable.contains(inode));
        for f in self.files.values_mut() {
            let before = f.data.len();
            if f.data.len() >= f.synced.len() && f.data.starts_with(&f.synced) {
                let tail = f.data.len() - f.synced.len();
                let kept = rng.below(tail as u64 + 1) as usize;
                f.data.truncate(f.synced.len() + kept);
                if kept > 0 && rng.below(4) == 0 {
                    let garbage = kept.min(16);
                    let end = f.data.len();
                    for b in &mut f.data[end - garbage..] {
                        *b = rng.below(256) as u8;
                    }
                }
            } else {
                f.data.clone_from(&f.synced);
            }
            self.counts.bytes_lost += before.saturating_sub(f.data.len());
            f.synced.clone_from(&f.data);
        }
        self.rng = rng;
    }
}

/// A stalled disk, answering again once dropped (see [`SimDisk::stall`]).
#[must_use = "the disk answers again as soon as this is dropped"]
pub struct Stalled<'a> {
    _held: MutexGuard<'a, DiskState>,
}

/// A simulated disk. Clones share it: the disk outlives the process that
/// wrote to it.
#[derive(Clone, Debug)]
pub struct SimDisk {
    state: Arc<Mutex<DiskState>>,
}

impl SimDisk {
    /// An empty disk holding `root` (and its ancestors), durable.
    pub fn new(root: &Path, seed: u64) -> SimDisk {
        let mut dirs = BTreeMap::new();
        for ancestor in root.ancestors() {
            dirs.insert(ancestor.to_path_buf(), Dir::default());
        }
        for ancestor in root.ancestors() {
            if let Ok((parent, name)) = split(ancestor) {
                if let Some(d) = dirs.get_mut(&parent) {
                    d.live.insert(name.clone(), Entry::Dir);
                    d.durable.insert(name, Entry::Dir);
                }
            }
        }
        SimDisk {
            state: Arc::new(Mutex::new(DiskState {
                root: root.to_path_buf(),
                dirs,
                files: BTreeMap::new(),
                next_inode: 1,
                faults: DiskFaults::default(),
                rng: SimRng::new(seed),
                counts: DiskCounts::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, DiskState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Switches faults on (or off with the default).
    pub fn set_faults(&self, faults: DiskFaults) {
        self.lock().faults = faults;
    }

    pub fn counts(&self) -> DiskCounts {
        self.lock().counts
    }

    /// A disk that stops answering: every operation on it waits until the
    /// returned guard is dropped.
    pub fn stall(&self) -> Stalled<'_> {
        Stalled { _held: self.lock() }
    }

    /// The machine loses power: see the module doc for what survives.
    pub fn power_loss(&self) {
        self.lock().power_loss();
    }

    /// Bytes the disk holds (files with an entry).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }
}

struct SimAppend {
    disk: SimDisk,
    inode: u64,
}

impl AppendFile for SimAppend {
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.disk.lock().write_at_end(self.inode, bytes)
    }

    fn syncer(&self) -> io::Result<std::sync::Arc<dyn crate::storage::fs::FileSyncer>> {
        Ok(std::sync::Arc::new(SimAppend { disk: self.disk.clone(), inode: self.inode }))
    }
}

impl crate::storage::fs::FileSyncer for SimAppend {
    fn sync_data(&self) -> io::Result<()> {
        self.disk.lock().sync_inode(self.inode)
    }
}

impl FileSystem for SimDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut st = self.lock();
        let missing: Vec<PathBuf> =
            dir.ancestors().take_while(|a| !st.dirs.contains_key(*a)).map(Path::to_path_buf).collect();
        for path in missing.into_iter().rev() {
            let (parent, name) = split(&path)?;
            st.change_dir(&parent, DirOp::Link(name, Entry::Dir))?;
            st.dirs.insert(path, Dir::default());
        }
        Ok(())
    }

    fn is_dir(&self, path: &Path) -> bool {
        self.lock().dirs.contains_key(path)
    }

    fn is_file(&self, path: &Path) -> bool {
        matches!(self.lock().entry(path), Some(Entry::File(_)))
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let st = self.lock();
        let d = st.dirs.get(dir).ok_or_else(|| not_found(dir))?;
        Ok(d.live.keys().map(|name| dir.join(name)).collect())
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        let st = self.lock();
        let inode = st.inode(path)?;
        Ok(st.files.get(&inode).map_or(0, |f| f.data.len() as u64))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let st = self.lock();
        let inode = st.inode(path)?;
        Ok(st.files.get(&inode).map(|f| f.data.clone()).unwrap_or_default())
    }

    fn write_file(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut st = self.lock();
        let inode = match st.inode(path) {
            Ok(inode) => inode,
            Err(_) => {
                let (parent, name) = split(path)?;
                let inode = st.next_inode;
                st.next_inode += 1;
                st.change_dir(&parent, DirOp::Link(name, Entry::File(inode)))?;
                st.files.insert(inode, FileData::default());
                inode
            }
        };
        if let Some(f) = st.files.get_mut(&inode) {
            f.data.clear();
        }
        st.write_at_end(inode, bytes)
    }

    fn write_file_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.write_file(path, bytes)?;
        self.sync_file(path)
    }

    fn create_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>> {
        let mut st = self.lock();
        if st.entry(path).is_some() {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} exists", path.display())));
        }
        let (parent, name) = split(path)?;
        let inode = st.next_inode;
        st.next_inode += 1;
        st.change_dir(&parent, DirOp::Link(name, Entry::File(inode)))?;
        st.files.insert(inode, FileData::default());
        Ok(Box::new(SimAppend { disk: self.clone(), inode }))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut st = self.lock();
        let inode = st.inode(path)?;
        if let Some(f) = st.files.get_mut(&inode) {
            f.data.resize(usize::try_from(len).unwrap_or(usize::MAX).min(f.data.len()), 0);
        }
        Ok(())
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        let inode = st.inode(path)?;
        st.sync_inode(inode)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.admit_fsync()?;
        let d = st.dirs.get_mut(dir).ok_or_else(|| not_found(dir))?;
        d.durable.clone_from(&d.live);
        d.pending.clear();
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.lock();
        let entry = st.entry(from).ok_or_else(|| not_found(from))?;
        let (from_dir, from_name) = split(from)?;
        let (to_dir, to_name) = split(to)?;
        if from_dir != to_dir {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the simulated disk renames within a directory"));
        }
        st.change_dir(&from_dir, DirOp::Rename { from: from_name, to: to_name, entry })
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.inode(path)?;
        let (parent, name) = split(path)?;
        st.change_dir(&parent, DirOp::Unlink(name))
    }
}

// ------------------------------------------------------------- key store

#[derive(Clone, Debug)]
enum KeyWrite {
    Batch { partition: i32, keys: Vec<SeenKey>, checkpoint: i64 },
    DropPartition(i32),
}

#[derive(Clone, Debug, Default)]
struct KeyTables {
    keys: BTreeMap<(i32, IdHash), SeenKey>,
    checkpoints: BTreeMap<i32, i64>,
}

impl KeyTables {
    fn apply(&mut self, write: &KeyWrite) {
        match write {
            KeyWrite::Batch { partition, keys, checkpoint } => {
                for k in keys {
                    self.keys.insert((*partition, k.id_hash), *k);
                }
                self.checkpoints.insert(*partition, *checkpoint);
            }
            KeyWrite::DropPartition(partition) => {
                self.keys.retain(|(p, _), _| p != partition);
                self.checkpoints.remove(partition);
            }
        }
    }
}

#[derive(Debug)]
struct KeyModel {
    live: KeyTables,
    durable: KeyTables,
    /// Write batches since the last flush, in order.
    unflushed: Vec<KeyWrite>,
    floor_ms: i64,
    horizon_ms: i64,
    rng: SimRng,
}

/// The key store's model: see the module doc. Clones share it.
#[derive(Clone, Debug)]
pub struct SimKeyStore {
    model: Arc<Mutex<KeyModel>>,
}

impl SimKeyStore {
    pub fn new(horizon_ms: i64, seed: u64) -> SimKeyStore {
        SimKeyStore {
            model: Arc::new(Mutex::new(KeyModel {
                live: KeyTables::default(),
                durable: KeyTables::default(),
                unflushed: Vec::new(),
                floor_ms: i64::MIN,
                horizon_ms,
                rng: SimRng::new(seed),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, KeyModel> {
        self.model.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Power loss: a prefix of the unflushed write batches survives.
    pub fn power_loss(&self) {
        let mut m = self.lock();
        let writes = std::mem::take(&mut m.unflushed);
        let kept = m.rng.below(writes.len() as u64 + 1) as usize;
        for w in &writes[..kept] {
            m.durable.apply(w);
        }
        m.live = m.durable.clone();
    }
}

impl LongHorizon for SimKeyStore {
    fn lookup_many(&self, partition: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError> {
        let m = self.lock();
        out.clear();
        out.extend(
            ids.iter().map(|id| m.live.keys.get(&(partition, *id)).copied().filter(|k| k.first_seen_ms > m.floor_ms)),
        );
        Ok(())
    }
}

impl KeyTier for SimKeyStore {
    fn checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError> {
        Ok(self.lock().live.checkpoints.get(&partition).copied())
    }

    fn apply_batch(&self, partition: i32, keys: &[SeenKey], checkpoint: i64) -> Result<(), KeystoreError> {
        let mut m = self.lock();
        let stored = m.live.checkpoints.get(&partition).copied();
        if stored.is_some_and(|c| c >= checkpoint) {
            return Ok(());
        }
        let floor = m.floor_ms;
        let mut fresh: Vec<SeenKey> = Vec::new();
        for k in keys {
            if stored.is_some_and(|c| k.output.offset <= c) || k.first_seen_ms <= floor {
                continue;
            }
            // A repeat in the batch replaces the held copy only once the
            // held one's lifetime was over when it was first seen.
            if let Some(held) = fresh.iter_mut().find(|f| f.id_hash == k.id_hash) {
                if held.first_seen_ms.saturating_add(m.horizon_ms) <= k.first_seen_ms {
                    *held = *k;
                }
                continue;
            }
            // Past its lifetime (the model's horizon) when this key was
            // first seen, the old key is replaced, as the store does.
            let remembered = m.live.keys.get(&(partition, k.id_hash)).is_some_and(|old| {
                old.first_seen_ms > floor && old.first_seen_ms.saturating_add(m.horizon_ms) > k.first_seen_ms
            });
            if !remembered {
                fresh.push(*k);
            }
        }
        let write = KeyWrite::Batch { partition, keys: fresh, checkpoint };
        m.live.apply(&write);
        m.unflushed.push(write);
        Ok(())
    }

    fn age_out(&self, now_ms: i64) -> Result<(), KeystoreError> {
        let mut m = self.lock();
        m.floor_ms = m.floor_ms.max(now_ms.saturating_sub(m.horizon_ms));
        Ok(())
    }

    fn drop_partition(&self, partition: i32) -> Result<(), KeystoreError> {
        let mut m = self.lock();
        let write = KeyWrite::DropPartition(partition);
        m.live.apply(&write);
        m.unflushed.push(write);
        Ok(())
    }

    fn oldest_first_seen_ms(&self) -> Result<Option<i64>, KeystoreError> {
        let m = self.lock();
        Ok(m.live.keys.values().map(|k| k.first_seen_ms).filter(|t| *t > m.floor_ms).min())
    }

    fn window_below_floor(&self, _now_ms: i64) -> Result<bool, KeystoreError> {
        Ok(false)
    }

    fn disk_bytes(&self) -> u64 {
        self.lock().live.keys.len() as u64 * 64
    }

    fn flush(&self) -> Result<(), KeystoreError> {
        let mut m = self.lock();
        let writes = std::mem::take(&mut m.unflushed);
        for w in &writes {
            m.durable.apply(w);
        }
        Ok(())
    }
}
