//! The filesystem seam: every byte the usage store reads or writes goes
//! through [`FileSystem`], so the durability rules can be tested against a
//! disk that loses what was not synced.
//!
//! [`RealFs`] is `std::fs` and what `dedupd` runs on. The simulator's disk
//! (`sim::disk`, test builds only) implements the same trait with a model of
//! what a crash keeps: file bytes up to their last fsync (plus a possibly torn
//! prefix of the rest), directory entries up to their directory's last fsync
//! (plus a prefix of later changes, in order), and injected write errors,
//! fsync errors and a full disk.
//!
//! The operations are the few the store needs, named for what they promise.
//! Nothing here retries: a failed fsync must poison the caller (see
//! `storage`'s failure rules), and only the caller knows that.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A file opened for appending (the active WAL file).
pub trait AppendFile: Send + Sync {
    /// Appends all of `bytes`. On error some prefix may have been written.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// A second handle on the same open file that makes its appended bytes
    /// durable (`fdatasync`), from any thread: the WAL fsyncs only through
    /// it, the group commit without the store's lock while other batches
    /// append.
    fn syncer(&self) -> io::Result<Arc<dyn FileSyncer>>;
}

/// See [`AppendFile::syncer`].
pub trait FileSyncer: Send + Sync {
    /// Makes every byte appended so far durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
}

/// One file opened for several positioned reads (see
/// [`FileSystem::open_ranges`]).
pub trait RangeReader {
    /// `len` bytes from `offset`, as [`FileSystem::read_range`] reads them.
    fn read_range(&self, offset: u64, len: usize) -> io::Result<Vec<u8>>;
}

/// The default [`RangeReader`]: each read goes through the filesystem by
/// path, as a single [`FileSystem::read_range`] would.
struct RangesByPath<'a, F: ?Sized> {
    fs: &'a F,
    path: PathBuf,
}

impl<F: FileSystem + ?Sized> RangeReader for RangesByPath<'_, F> {
    fn read_range(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.fs.read_range(&self.path, offset, len)
    }
}

/// The filesystem operations of the usage store.
pub trait FileSystem: Send + Sync + std::fmt::Debug {
    /// Creates `dir` and missing parents. Not durable until the parent's
    /// [`sync_dir`](FileSystem::sync_dir).
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    fn is_dir(&self, path: &Path) -> bool;
    fn is_file(&self, path: &Path) -> bool;
    /// The entries of `dir` (full paths), in no particular order.
    fn list_dir(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    fn file_len(&self, path: &Path) -> io::Result<u64>;
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// `len` bytes of `path` from `offset`: a point lookup reads one block
    /// of a segment, not the file. An implementation without positioned
    /// reads may read the file and slice it (the default).
    fn read_range(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let bytes = self.read(path)?;
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match start.checked_add(len) {
            Some(end) if end <= bytes.len() => Ok(bytes[start..end].to_vec()),
            _ => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "range beyond the end of the file")),
        }
    }
    /// `path` for several [`read_range`](FileSystem::read_range)s, as a
    /// lookup reads a few groups of one segment. The default reads by path
    /// each time; [`RealFs`] opens the file once (an open and a close cost
    /// as much as copying a group out of the page cache).
    fn open_ranges(&self, path: &Path) -> io::Result<Box<dyn RangeReader + '_>> {
        Ok(Box::new(RangesByPath { fs: self, path: path.to_path_buf() }))
    }
    /// Creates or truncates `path` and writes `bytes`; not synced.
    fn write_file(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// [`write_file`](FileSystem::write_file), then fsync, on one open
    /// file: a writeback error between the two is reported to this fsync
    /// (a second handle opened later may not see it on older kernels).
    fn write_file_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Creates `path`, which must not exist, for appending.
    fn create_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>>;
    /// Cuts `path` to `len` bytes; not synced.
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// fsyncs the file at `path` (data and size).
    fn sync_file(&self, path: &Path) -> io::Result<()>;
    /// fsyncs `dir`, so entries created, renamed or removed in it survive a crash.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Renames within one directory, replacing `to`. Atomic; durable after `sync_dir`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
}

/// The operating system's filesystem.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

struct RealAppend(File);

impl AppendFile for RealAppend {
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.write_all(bytes)
    }

    fn syncer(&self) -> io::Result<Arc<dyn FileSyncer>> {
        // A duplicated descriptor shares the open file description, so an
        // fsync through it covers every byte appended through the other,
        // and a writeback error is reported to it as to the original.
        Ok(Arc::new(RealSyncer(self.0.try_clone()?)))
    }
}

struct RealSyncer(File);

impl FileSyncer for RealSyncer {
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

/// A file of [`RealFs`] open for positioned reads.
struct OpenFile(File);

impl RangeReader for OpenFile {
    fn read_range(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; len];
        self.0.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }
}

impl FileSystem for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn is_file(&self, path: &Path) -> bool {
        path.is_file()
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        std::fs::read_dir(dir)?.map(|entry| entry.map(|e| e.path())).collect()
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.len())
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn read_range(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        OpenFile(File::open(path)?).read_range(offset, len)
    }

    fn open_ranges(&self, path: &Path) -> io::Result<Box<dyn RangeReader + '_>> {
        Ok(Box::new(OpenFile(File::open(path)?)))
    }

    fn write_file(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        OpenOptions::new().write(true).create(true).truncate(true).open(path)?.write_all(bytes)
    }

    fn write_file_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(path)?;
        f.write_all(bytes)?;
        f.sync_all()
    }

    fn create_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>> {
        Ok(Box::new(RealAppend(OpenOptions::new().append(true).create_new(true).open(path)?)))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        OpenOptions::new().write(true).open(path)?.set_len(len)
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        OpenOptions::new().write(true).open(path)?.sync_all()
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}
