//! Process-wide settings the binary makes at start, shared with the benches
//! that measure it so they measure what ships.

/// Turns transparent huge pages off for this process (`prctl
/// PR_SET_THP_DISABLE`; Linux, no-op elsewhere). Returns whether they are
/// off.
///
/// Why: mimalloc asks for huge pages on its arenas (`madvise`), and hands
/// freed memory back to the OS after a second. A worker allocates and frees
/// a batch's worth of records every few milliseconds, so regions went back
/// and forth, and each time one was touched again the kernel zeroed a whole
/// 2 MiB page for it: perf put 15–18% of the worker's CPU in
/// `clear_page_erms` under `do_huge_pmd_anonymous_page`, and the end-to-end
/// bench spent 0.4–0.6 CPU-s less per 200,000 events without them (README,
/// issue #14). The flag is checked at every fault, so it also covers memory
/// mapped before it was set, and glibc's heap (librdkafka, RocksDB) on
/// systems whose THP setting is `always`.
pub fn disable_transparent_huge_pages() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with PR_SET_THP_DISABLE takes plain integers and
        // touches no memory of ours.
        let r = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn huge_pages_are_off_for_the_process_once_asked() {
        assert!(super::disable_transparent_huge_pages());
        // SAFETY: as above.
        let state = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(state, 1, "PR_GET_THP_DISABLE reads the flag back");
    }
}
