//! The storage layer's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the usage store. Fields name the file and
/// offset so an operator can find the damage without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checksum mismatch in {file} at offset {offset}: expected {expected:#010x}, got {got:#010x}")]
    ChecksumMismatch { file: PathBuf, offset: u64, expected: u32, got: u32 },
    #[error("corrupt {file} at offset {offset}: {detail}")]
    Corrupt { file: PathBuf, offset: u64, detail: String },
    #[error(
        "WAL {file} is corrupt at offset {offset} ({detail}) with valid-looking data after it; refusing to skip it. \
         Inspect with `dedupd verify`; the output topic can rebuild this state"
    )]
    WalMidLogCorruption { file: PathBuf, offset: u64, detail: String },
    #[error("unsupported {what} version {found} in {file} (this build reads version {supported})")]
    UnsupportedVersion { file: PathBuf, what: &'static str, found: u16, supported: u16 },
    #[error(
        "no readable manifest in {dir} although it holds data ({tried} manifest file(s) failed their checksum or \
         are missing); refusing to start empty. Run `dedupd verify`, or move the directory away to rebuild from the \
         output topic"
    )]
    NoValidManifest { dir: PathBuf, tried: usize },
    #[error("segment {file} named by manifest generation {generation} is missing")]
    MissingSegment { file: PathBuf, generation: u64 },
    #[error("WAL file {file} is missing: live WAL files must be contiguous from {expected_first}")]
    MissingWal { file: PathBuf, expected_first: u64 },
    #[error("state directory {dir} is locked by another process{holder}; one process per state directory")]
    Locked { dir: PathBuf, holder: String },
    #[error("usage store is poisoned after an earlier failure ({cause}); restart the process to recover")]
    Poisoned { cause: String },
    #[error("failpoint {name} hit")]
    Failpoint { name: &'static str },
    #[error("invalid storage option {key}: {detail}")]
    InvalidOption { key: &'static str, detail: String },
}

impl StorageError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> StorageError {
        StorageError::Io { path: path.into(), source }
    }

    pub(crate) fn corrupt(file: impl Into<PathBuf>, offset: u64, detail: impl Into<String>) -> StorageError {
        StorageError::Corrupt { file: file.into(), offset, detail: detail.into() }
    }
}

/// Attaches a path to an `io::Result`.
pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T, StorageError>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T, StorageError> {
        self.map_err(|e| StorageError::io(path, e))
    }
}
