//! The [`KeyTier`] contract, checked against RocksDB's [`KeyStore`] and the
//! simulator's model alike, so the model the simulation trusts cannot drift
//! from the store `dedupd run` uses. Durability across a real crash is
//! `tests/keystore_durability.rs` (SIGKILL mid-write: every acknowledged
//! batch whole, none in part); the model's power loss is checked here.

use super::{KeyStore, KeyStoreOptions, KeyTier};
use crate::classify::SeenKey;
use crate::event::{IdHash, PayloadHash, Position};
use crate::sim::disk::SimKeyStore;

const HOUR: i64 = 3_600_000;
const HORIZON_MS: i64 = 10 * HOUR;
/// A key's lifetime: the RocksDB store keeps keys an hour past it (as
/// `dedupd` does, see `state::KEY_STORE_AGE_OUT_SLACK_MS`); the model's
/// horizon is the lifetime itself.
const LIFETIME_MS: i64 = 9 * HOUR;

fn key(n: u64, partition: i32, first_seen_ms: i64, offset: i64) -> SeenKey {
    let h = blake3::hash(&n.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.as_bytes()[..16]);
    SeenKey {
        id_hash: IdHash(id),
        payload_hash: PayloadHash([(n as u8) ^ (offset as u8); 16]),
        first_seen_ms,
        source: Position::new(partition, offset + 1_000),
        output: Position::new(partition, offset),
    }
}

fn get(store: &dyn KeyTier, partition: i32, k: &SeenKey) -> Option<SeenKey> {
    let mut out = Vec::new();
    store.lookup_many(partition, &[k.id_hash], &mut out).expect("lookup");
    out.pop().flatten()
}

/// One scripted life of a key store; every answer is what local state relies on.
fn holds_the_contract(store: &dyn KeyTier) {
    let t = 100 * HOUR;
    assert_eq!(store.checkpoint(0).expect("checkpoint"), None, "a new store has no checkpoint");

    // First delivery wins, within a batch and across batches.
    let a = key(1, 0, t, 1);
    let a_again = SeenKey { payload_hash: PayloadHash([9; 16]), output: Position::new(0, 2), ..a };
    store.apply_batch(0, &[a, a_again], 2).expect("apply");
    store.apply_batch(0, &[SeenKey { output: Position::new(0, 3), ..a_again }], 3).expect("apply");
    assert_eq!(get(store, 0, &a), Some(a));
    assert_eq!(store.checkpoint(0).expect("checkpoint"), Some(3));

    // A batch at or below the checkpoint changes nothing, keys or checkpoint.
    let old = key(2, 0, t, 3);
    store.apply_batch(0, &[old], 3).expect("replay");
    assert_eq!(get(store, 0, &old), None);
    assert_eq!(store.checkpoint(0).expect("checkpoint"), Some(3));
    // Keys at or below the checkpoint inside a newer batch are skipped.
    let b = key(3, 0, t, 4);
    store.apply_batch(0, &[old, b], 4).expect("apply");
    assert_eq!((get(store, 0, &old), get(store, 0, &b)), (None, Some(b)));

    // Partitions are apart.
    let c = key(4, 1, t, 7);
    store.apply_batch(1, &[c], 7).expect("apply");
    assert_eq!(get(store, 0, &c), None);
    assert_eq!(get(store, 1, &c), Some(c));
    assert_eq!(store.oldest_first_seen_ms().expect("oldest").map(|o| o <= t), Some(true));

    // Dropping a partition forgets its keys and checkpoint only.
    store.drop_partition(1).expect("drop");
    assert_eq!((get(store, 1, &c), store.checkpoint(1).expect("checkpoint")), (None, None));
    assert_eq!(get(store, 0, &a), Some(a));
    store.apply_batch(1, &[c], 7).expect("rebuild");
    assert_eq!(get(store, 1, &c), Some(c));

    // A key past its lifetime when the same id comes again (the store
    // keeps keys a while longer, but the classifier no longer counts it
    // and accepts the id as new) is replaced by the new key, not kept as
    // the first delivery: its retries must find the new one.
    let lives = key(5, 0, t, 9);
    store.apply_batch(0, &[lives], 9).expect("apply");
    let again =
        SeenKey { payload_hash: PayloadHash([7; 16]), output: Position::new(0, 10), ..key(5, 0, t + LIFETIME_MS, 10) };
    store.apply_batch(0, &[again], 10).expect("apply");
    assert_eq!(get(store, 0, &lives), Some(again), "a key past its lifetime was kept over the id's new acceptance");
    let within = SeenKey { output: Position::new(0, 11), ..key(5, 0, t + LIFETIME_MS + 1, 11) };
    store.apply_batch(0, &[within], 11).expect("apply");
    assert_eq!(get(store, 0, &lives), Some(again), "within its lifetime the first delivery wins");
    // The same within one batch (repair can read both into one).
    let first = key(6, 0, t, 12);
    let renewed_in_batch = SeenKey { payload_hash: PayloadHash([5; 16]), ..key(6, 0, t + LIFETIME_MS, 13) };
    let retry = SeenKey { output: Position::new(0, 14), ..key(6, 0, t + LIFETIME_MS + 1, 14) };
    store.apply_batch(0, &[first, renewed_in_batch, retry], 14).expect("apply");
    assert_eq!(get(store, 0, &first), Some(renewed_in_batch), "within one batch the later acceptance was dropped");

    // Ageing out hides keys first seen at or before now - horizon; an id
    // past the floor is remembered again with its new value.
    store.age_out(t + HORIZON_MS + 1).expect("age out");
    assert_eq!(get(store, 0, &a), None);
    let renewed = key(1, 0, t + HORIZON_MS + 5, 15);
    store.apply_batch(0, &[renewed], 15).expect("apply");
    assert_eq!(get(store, 0, &renewed), Some(renewed));
    assert!(!store.window_below_floor(t + HORIZON_MS + 1).expect("window"), "no size cap here");
    store.flush().expect("flush");
    assert_eq!(store.checkpoint(0).expect("checkpoint"), Some(15));
}

#[test]
fn rocksdb_key_store_holds_the_contract() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = KeyStoreOptions {
        horizon_ms: HORIZON_MS,
        lifetime_ms: LIFETIME_MS,
        histogram_bucket_ms: HOUR,
        block_cache_bytes: 4 << 20,
        write_buffer_bytes: 4 << 20,
        ..KeyStoreOptions::default()
    };
    holds_the_contract(&KeyStore::open(dir.path(), opts).expect("open"));
}

#[test]
fn the_simulators_key_store_model_holds_the_contract() {
    holds_the_contract(&SimKeyStore::new(LIFETIME_MS, 7));
}

/// A power loss keeps a prefix of the batches since the last flush, each
/// whole: keys and checkpoint together, as RocksDB's WAL recovery does.
#[test]
fn the_models_power_loss_keeps_whole_batches_in_order() {
    let mut kept_counts = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let store = SimKeyStore::new(HORIZON_MS, seed);
        let keys: Vec<SeenKey> = (0..6).map(|n| key(n, 0, HOUR, n as i64)).collect();
        store.apply_batch(0, &keys[..2], 1).expect("apply");
        store.flush().expect("flush");
        for n in 2..6 {
            store.apply_batch(0, &keys[n..=n], n as i64).expect("apply");
        }
        store.power_loss();
        let checkpoint = store.checkpoint(0).expect("checkpoint").expect("the flushed batch survives");
        for (n, k) in keys.iter().enumerate() {
            assert_eq!(
                get(&store, 0, k).is_some(),
                n as i64 <= checkpoint,
                "seed {seed}: key {n} vs checkpoint {checkpoint}"
            );
        }
        kept_counts.insert(checkpoint);
    }
    assert!(kept_counts.len() > 2, "power losses should keep different prefixes: {kept_counts:?}");
}
