//! Errors of the key store.

use std::path::PathBuf;

/// Everything that can go wrong in the key store. RocksDB's own errors carry
/// only a message; the variant says which operation met it.
#[derive(Debug, thiserror::Error)]
pub enum KeystoreError {
    #[error("cannot open the key store at {dir}: {source}")]
    Open {
        dir: PathBuf,
        #[source]
        source: rocksdb::Error,
    },
    #[error("key store {op} failed: {source}")]
    Rocks {
        op: &'static str,
        #[source]
        source: rocksdb::Error,
    },
    #[error("key store column family {name} is missing")]
    MissingColumnFamily { name: &'static str },
    #[error("corrupt key store {what} under key {key_hex}: {detail}")]
    Corrupt { what: &'static str, key_hex: String, detail: &'static str },
    #[error("bulk load of partition {partition} needs an empty partition; it holds keys")]
    PartitionNotEmpty { partition: i32 },
    #[error("bulk load of partition {partition}: keys must be strictly ascending by id (at {id_hex})")]
    UnsortedBulkLoad { partition: i32, id_hex: String },
    #[error("key store I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("key store lookup answered {answered} of {asked} ids")]
    ShortLookup { asked: usize, answered: usize },
    #[error("key store lookup failed on a helper thread: {detail}")]
    LookupHelper { detail: String },
    #[error("the key store could not write its applied keys into RocksDB ({cause}); restart the process to recover")]
    LayerWrite { cause: String },
    #[error("invalid key store option {key}: {detail}")]
    InvalidOption { key: &'static str, detail: String },
    #[error(
        "the key store at {dir} holds {found} but no CURRENT file: opened, RocksDB would start an empty store and \
         delete every table as obsolete, forgetting every key; {advice}",
        advice = crate::storage::fsutil::LOST_CURRENT_ADVICE
    )]
    LostCurrent { dir: PathBuf, found: String },
}

impl KeystoreError {
    pub(crate) fn rocks(op: &'static str) -> impl FnOnce(rocksdb::Error) -> KeystoreError {
        move |source| KeystoreError::Rocks { op, source }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
