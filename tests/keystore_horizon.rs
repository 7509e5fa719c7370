//! Ageing out by horizon and by size cap, the window it leaves, and a
//! property test of the store against a `HashMap` model.

use std::collections::HashMap;

use dedupd::classify::SeenKey;
use dedupd::event::{IdHash, PayloadHash, Position};
use dedupd::keystore::{KeyStore, KeyStoreOptions};
use proptest::prelude::*;

const HOUR: i64 = 3_600_000;
const HORIZON: i64 = 100 * HOUR;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn opts() -> KeyStoreOptions {
    KeyStoreOptions {
        horizon_ms: HORIZON,
        histogram_bucket_ms: HOUR,
        window_floor_ms: 8 * HOUR,
        block_cache_bytes: 4 << 20,
        write_buffer_bytes: 4 << 20,
        ..KeyStoreOptions::default()
    }
}

fn key(n: u64, first_seen_ms: i64) -> SeenKey {
    let h = blake3::hash(&n.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.as_bytes()[..16]);
    let mut payload = [0u8; 16];
    payload.copy_from_slice(&h.as_bytes()[16..32]);
    SeenKey {
        id_hash: IdHash(id),
        payload_hash: PayloadHash(payload),
        first_seen_ms,
        source: Position::new(0, n as i64),
        output: Position::new(0, n as i64),
    }
}

/// `hours` hours of `per_hour` keys each, hour h first seen at `h * HOUR + 1`.
fn fill(ks: &KeyStore, hours: u64, per_hour: u64) -> Result<(), Box<dyn std::error::Error>> {
    for h in 0..hours {
        let keys: Vec<SeenKey> = (0..per_hour).map(|i| key(h * per_hour + i, h as i64 * HOUR + 1 + i as i64)).collect();
        let last = keys.last().map_or(0, |k| k.output.offset);
        ks.apply_batch(0, &keys, last)?;
    }
    Ok(())
}

fn present(ks: &KeyStore, hour: u64, per_hour: u64) -> Result<usize, Box<dyn std::error::Error>> {
    let mut n = 0;
    for i in 0..per_hour {
        if ks.get(0, &key(hour * per_hour + i, 0).id_hash)?.is_some() {
            n += 1;
        }
    }
    Ok(n)
}

#[test]
fn the_window_moves_forward_as_keys_age_out_by_the_horizon() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ks = KeyStore::open(dir.path(), opts())?;
    fill(&ks, 10, 50)?;
    assert_eq!(ks.oldest_first_seen_ms()?, Some(1));

    let r = ks.age_out(HORIZON + 5 * HOUR)?;
    assert_eq!(r.floor_ms, 5 * HOUR);
    assert_eq!(r.keys_aged_out, 250);
    assert_eq!(r.oldest_first_seen_ms, Some(5 * HOUR + 1));
    assert_eq!(r.window_ms, Some(HORIZON - 1));
    assert!(!r.below_window_floor, "the horizon, not the size cap, moved the window");
    assert_eq!(ks.oldest_first_seen_ms()?, Some(5 * HOUR + 1));
    assert_eq!(present(&ks, 4, 50)?, 0);
    assert_eq!(present(&ks, 5, 50)?, 50);
    assert_eq!(ks.partition_key_count(0)?, 250);

    let r = ks.age_out(HORIZON + 9 * HOUR)?;
    assert_eq!(r.oldest_first_seen_ms, Some(9 * HOUR + 1));
    let r = ks.age_out(HORIZON + 20 * HOUR)?;
    assert_eq!((r.oldest_first_seen_ms, r.window_ms), (None, None));
    assert_eq!(ks.key_count(), 0);
    Ok(())
}

#[test]
fn the_floor_never_moves_back_and_survives_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let ks = KeyStore::open(dir.path(), opts())?;
        fill(&ks, 10, 20)?;
        ks.age_out(HORIZON + 5 * HOUR)?;
        // A clock stepping back must not resurrect anything.
        let r = ks.age_out(HORIZON)?;
        assert_eq!(r.floor_ms, 5 * HOUR);
    }
    let ks = KeyStore::open(dir.path(), opts())?;
    assert_eq!(ks.floor_ms(), 5 * HOUR);
    assert_eq!(present(&ks, 4, 20)?, 0);
    assert_eq!(present(&ks, 5, 20)?, 20);
    assert_eq!(ks.oldest_first_seen_ms()?, Some(5 * HOUR + 1));
    drop(ks);
    // A floor above the horizon's with no size cap (here a clock behind
    // it; a horizon grown since a restart, or a cap cut and removed, do
    // the same) leaves the window as short: under a longer window floor it
    // alerts, as a cut does, and stops once the horizon catches up.
    let ks = KeyStore::open(dir.path(), KeyStoreOptions { window_floor_ms: 96 * HOUR, ..opts() })?;
    let r = ks.age_out(HORIZON)?;
    assert!(r.floor_ms > r.horizon_floor_ms && r.below_window_floor, "{r:?}");
    let r = ks.age_out(HORIZON + 5 * HOUR)?;
    assert!(r.floor_ms == r.horizon_floor_ms && !r.below_window_floor, "{r:?}");
    Ok(())
}

#[test]
fn compaction_drops_aged_out_keys_from_disk_without_tombstones() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ks = KeyStore::open(dir.path(), opts())?;
    fill(&ks, 10, 2000)?;
    ks.compact()?;
    let before = ks.estimated_physical_keys()?;
    assert!(before >= 19_000, "estimate {before}");
    ks.age_out(HORIZON + 5 * HOUR)?;
    ks.compact()?;
    assert_eq!(ks.reclaimed_keys(), 10_000);
    let after = ks.estimated_physical_keys()?;
    assert!(after <= 10_500, "estimate {after}");
    assert_eq!(present(&ks, 9, 2000)?, 2000);
    Ok(())
}

/// Ten hours of `per_hour` keys written and compacted, then the store
/// opened again with a cap of `1 / fraction` of their bytes; and the bytes.
fn ten_hours_under_a_cap(
    dir: &std::path::Path,
    per_hour: u64,
    fraction: u64,
) -> Result<(KeyStore, u64), Box<dyn std::error::Error>> {
    let full_bytes = {
        let ks = KeyStore::open(dir, opts())?;
        fill(&ks, 10, per_hour)?;
        ks.compact()?;
        ks.disk_bytes()
    };
    let capped = KeyStoreOptions { max_bytes: Some(full_bytes / fraction), ..opts() };
    Ok((KeyStore::open(dir, capped)?, full_bytes))
}

#[test]
fn the_size_cap_keeps_the_newest_keys_and_raises_the_window_alert() -> TestResult {
    let dir = tempfile::tempdir()?;
    let per_hour = 3000;
    // Room for about half of the keys: the newest hours must stay.
    let (ks, full_bytes) = ten_hours_under_a_cap(dir.path(), per_hour, 2)?;
    let now = 10 * HOUR;
    let r = ks.age_out(now)?;
    let size_floor = r.size_floor_ms.ok_or("the size cap should bind")?;
    assert!(size_floor > r.horizon_floor_ms);
    assert_eq!(r.floor_ms, size_floor);
    assert!(r.keys_aged_out >= 4 * per_hour && r.keys_aged_out <= 8 * per_hour, "{r:?}");
    assert!(r.below_window_floor, "an 8h floor with a <6h window must alert: {r:?}");
    assert!(ks.window_below_floor(now)?);
    // A minute later the cut keys fit under the cap, and the window is as
    // short: the alert holds (it cleared once the round found no cut to
    // make).
    let later = ks.age_out(now + 60_000)?;
    assert!(later.below_window_floor && ks.window_below_floor(now + 60_000)?, "{later:?}");
    assert_eq!(present(&ks, 0, per_hour)?, 0, "the oldest hour must be gone");
    assert_eq!(present(&ks, 9, per_hour)?, per_hour as usize, "the newest hour must be kept");
    for h in 0..10 {
        let n = present(&ks, h, per_hour)?;
        let gone = (h as i64 + 1) * HOUR - 1 <= size_floor;
        assert_eq!(n, if gone { 0 } else { per_hour as usize }, "hour {h}");
    }
    ks.compact()?;
    assert!(ks.disk_bytes() < full_bytes * 3 / 4, "{} of {full_bytes}", ks.disk_bytes());
    Ok(())
}

/// A cap too small for even the current hour's keys: the floor stays
/// below that hour (it never lies ahead of now, hiding every key applied
/// until then), so a key applied after the cut is remembered; and the
/// alert holds in every later round while the cut keeps the window short
/// (it cleared in the next round, once the histogram fit again).
#[test]
fn a_cap_below_one_hour_of_keys_keeps_remembering_and_keeps_alerting() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (ks, _) = ten_hours_under_a_cap(dir.path(), 3000, 50)?;
    // Half past the newest hour (9), whose keys alone are over the cap.
    let now = 9 * HOUR + HOUR / 2;
    let r = ks.age_out(now)?;
    assert!(r.floor_ms < 9 * HOUR, "the floor lies in the current hour or ahead of now: {r:?}");
    assert!(r.below_window_floor, "{r:?}");
    let late = key(1_000_000, now + 1);
    ks.apply_batch(0, &[late], 1_000_000)?;
    assert_eq!(ks.get(0, &late.id_hash)?, Some(late), "a key applied after the cut was not remembered");
    for minute in 1..4 {
        let r = ks.age_out(now + minute * 60_000)?;
        assert!(r.below_window_floor && ks.window_below_floor(now + minute * 60_000)?, "round {minute}: {r:?}");
    }
    assert_eq!(ks.get(0, &late.id_hash)?, Some(late));
    Ok(())
}

#[derive(Clone, Debug)]
enum Op {
    /// Apply keys `ids` first seen at the current time.
    Apply(Vec<u8>),
    /// Advance the clock by this many hours and age out.
    Advance(u8),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => proptest::collection::vec(0u8..40, 1..12).prop_map(Op::Apply),
        2 => (0u8..40).prop_map(Op::Advance),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Model: id -> (first value) while `first_seen > now - horizon`.
    #[test]
    fn the_store_agrees_with_a_hashmap_and_a_window(ops in proptest::collection::vec(op(), 1..30)) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let o = KeyStoreOptions { horizon_ms: 30 * HOUR, ..opts() };
        let mut ks = Some(KeyStore::open(dir.path(), o.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?);
        let mut model: HashMap<u8, SeenKey> = HashMap::new();
        let mut now = 1000 * HOUR;
        let mut offset = 0i64;
        for op in ops {
            let store = ks.as_ref().ok_or_else(|| TestCaseError::fail("store closed"))?;
            match op {
                Op::Apply(ids) => {
                    let keys: Vec<SeenKey> = ids.iter().map(|&i| {
                        offset += 1;
                        SeenKey { first_seen_ms: now, output: Position::new(0, offset), ..key(u64::from(i), now) }
                    }).collect();
                    store.apply_batch(0, &keys, offset).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    for (i, k) in ids.iter().zip(&keys) {
                        let live = model.get(i).is_some_and(|m| m.first_seen_ms > now - o.horizon_ms);
                        if !live {
                            model.insert(*i, *k);
                        }
                    }
                }
                Op::Advance(h) => {
                    now += i64::from(h) * HOUR;
                    store.age_out(now).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    model.retain(|_, k| k.first_seen_ms > now - o.horizon_ms);
                }
                Op::Reopen => {
                    drop(ks.take());
                    ks = Some(KeyStore::open(dir.path(), o.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?);
                }
            }
            let store = ks.as_ref().ok_or_else(|| TestCaseError::fail("store closed"))?;
            for i in 0..40u8 {
                let got = store.get(0, &key(u64::from(i), 0).id_hash).map_err(|e| TestCaseError::fail(e.to_string()))?;
                // Between age_outs the store may still hold keys the model
                // (which ages on the same schedule) also holds: exact match.
                prop_assert_eq!(got, model.get(&i).copied(), "id {}", i);
            }
            prop_assert_eq!(store.checkpoint(0).map_err(|e| TestCaseError::fail(e.to_string()))?, (offset > 0).then_some(offset));
        }
    }
}
