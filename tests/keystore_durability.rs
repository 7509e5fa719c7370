//! Keys and checkpoints survive a clean reopen and a SIGKILL mid-write.
//!
//! The SIGKILL test re-executes this test binary as a child (selected by an
//! environment variable) that applies batches as fast as it can and reports
//! each acknowledged batch on stdout; the parent kills it with SIGKILL at an
//! arbitrary point, reopens the store and checks that every acknowledged
//! batch is there, whole, and that no batch is there in part.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use dedupd::classify::SeenKey;
use dedupd::event::{IdHash, PayloadHash, Position};
use dedupd::keystore::{KeyStore, KeyStoreOptions};

const CHILD_DIR_ENV: &str = "DEDUPD_KEYSTORE_SIGKILL_CHILD_DIR";
const BATCH: i64 = 200;
const P: i32 = 4;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn opts() -> KeyStoreOptions {
    KeyStoreOptions {
        horizon_ms: 1_000_000_000,
        block_cache_bytes: 4 << 20,
        // Small memtables so the child also flushes SSTs while being killed.
        write_buffer_bytes: 1 << 20,
        ..KeyStoreOptions::default()
    }
}

/// Key number `n`: batch `n / BATCH`, output offset `n`.
fn key(n: i64) -> SeenKey {
    let h = blake3::hash(&n.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.as_bytes()[..16]);
    SeenKey {
        id_hash: IdHash(id),
        payload_hash: PayloadHash([n as u8; 16]),
        first_seen_ms: 1_800_000_000_000 + n,
        source: Position::new(P, 7 * n),
        output: Position::new(P, n),
    }
}

fn batch(b: i64) -> Vec<SeenKey> {
    (b * BATCH..(b + 1) * BATCH).map(key).collect()
}

#[test]
fn keys_and_checkpoints_survive_close_and_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let ks = KeyStore::open(dir.path(), opts())?;
        for b in 0..5 {
            ks.apply_batch(P, &batch(b), (b + 1) * BATCH - 1)?;
        }
        ks.apply_batch(P + 1, &[SeenKey { output: Position::new(P + 1, 3), ..key(-1) }], 3)?;
    }
    let ks = KeyStore::open(dir.path(), opts())?;
    assert_eq!(ks.checkpoint(P)?, Some(5 * BATCH - 1));
    assert_eq!(ks.checkpoint(P + 1)?, Some(3));
    assert_eq!(ks.checkpoint(P + 2)?, None);
    for n in 0..5 * BATCH {
        assert_eq!(ks.get(P, &key(n).id_hash)?, Some(key(n)), "key {n}");
    }
    assert_eq!(ks.partition_key_count(P)?, 5 * BATCH as u64);
    assert_eq!(ks.partition_key_count(P + 1)?, 1);
    Ok(())
}

/// The child's body: apply batches forever, acknowledging each on stdout.
fn run_child(dir: &str) -> TestResult {
    let ks = KeyStore::open(std::path::Path::new(dir), opts())?;
    let start = ks.checkpoint(P)?.map_or(0, |c| (c + 1) / BATCH);
    let mut out = std::io::stdout().lock();
    for b in start.. {
        ks.apply_batch(P, &batch(b), (b + 1) * BATCH - 1)?;
        writeln!(out, "acked {b}")?;
        out.flush()?;
    }
    Ok(())
}

#[test]
fn keys_and_checkpoints_survive_a_sigkill_mid_write() -> TestResult {
    if let Ok(dir) = std::env::var(CHILD_DIR_ENV) {
        return run_child(&dir);
    }
    let dir = tempfile::tempdir()?;
    let mut last_acked: Option<i64> = None;
    // Kill after a different number of acknowledgements each round, so the
    // kill lands at different points of the write path, including after a
    // restart that resumed from the recovered checkpoint.
    for (round, kill_after) in [30i64, 7, 55].into_iter().enumerate() {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--exact", "keys_and_checkpoints_survive_a_sigkill_mid_write", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let mut acked_this_round = 0;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(b) = line.strip_prefix("acked ") {
                last_acked = Some(b.trim().parse()?);
                acked_this_round += 1;
                if acked_this_round == kill_after {
                    break;
                }
            }
        }
        let pid = i32::try_from(child.id())?;
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill failed");
        let status = child.wait()?;
        assert!(!status.success(), "round {round}: the child must have died by the signal");

        let ks = KeyStore::open(dir.path(), opts())?;
        let acked = last_acked.ok_or("the child acknowledged nothing")?;
        let checkpoint = ks.checkpoint(P)?.ok_or("checkpoint lost")?;
        assert!(checkpoint >= (acked + 1) * BATCH - 1, "round {round}: acked batch {acked}, checkpoint {checkpoint}");
        assert_eq!((checkpoint + 1) % BATCH, 0, "a checkpoint is always a batch end");
        let batches = (checkpoint + 1) / BATCH;
        for n in 0..batches * BATCH {
            assert_eq!(ks.get(P, &key(n).id_hash)?, Some(key(n)), "round {round}: key {n} of a checkpointed batch");
        }
        // Nothing past the checkpoint: batches are atomic with it.
        for n in batches * BATCH..(batches + 2) * BATCH {
            assert!(ks.get(P, &key(n).id_hash)?.is_none(), "round {round}: key {n} past the checkpoint");
        }
        assert_eq!(ks.partition_key_count(P)?, (batches * BATCH) as u64, "round {round}");
    }
    Ok(())
}
