//! Named crash points, so tests can stop the engine between two steps of a
//! multi-step change (segment written / manifest swapped / old files deleted).
//!
//! Two triggers, both always compiled in:
//! - the environment variable `DEDUPD_FAILPOINT=<name>` aborts the *process*
//!   (`std::process::abort`, no destructors, no flush) when the named step is
//!   reached: for crash tests on the real binary. Read once; a disabled check
//!   costs one atomic load and a compare.
//! - [`StoreOptions::crash_at`](super::StoreOptions::crash_at) makes the store
//!   return [`StorageError::Failpoint`] at the named step and poison itself:
//!   for in-process tests, which then drop the store without closing it.
//!
//! Names (stable, tests depend on them):
//! `wal_after_write` (frame written, not fsynced), `wal_after_fsync`,
//! `flush_after_segment`, `flush_after_sidecar`, `flush_after_manifest`,
//! `compact_after_segment`, `compact_after_manifest`, `manifest_after_temp`,
//! `manifest_after_rename`, `gc_mid_delete`.

use std::sync::OnceLock;

use super::StorageError;

/// Every failpoint name, for tests that iterate over all of them.
pub const ALL: &[&str] = &[
    "wal_after_write",
    "wal_after_fsync",
    "flush_after_segment",
    "flush_after_sidecar",
    "flush_after_manifest",
    "compact_after_segment",
    "compact_after_manifest",
    "manifest_after_temp",
    "manifest_after_rename",
    "gc_mid_delete",
];

fn env_failpoint() -> Option<&'static str> {
    static ENV: OnceLock<Option<String>> = OnceLock::new();
    ENV.get_or_init(|| std::env::var("DEDUPD_FAILPOINT").ok().filter(|s| !s.is_empty())).as_deref()
}

/// Checks the named failpoint: aborts the process when the environment names
/// it, returns an error when the in-process option names it.
pub(crate) fn check(name: &'static str, in_process: Option<&str>) -> Result<(), StorageError> {
    if env_failpoint() == Some(name) {
        eprintln!("dedupd: failpoint {name} reached, aborting");
        std::process::abort();
    }
    if in_process == Some(name) {
        return Err(StorageError::Failpoint { name });
    }
    Ok(())
}
