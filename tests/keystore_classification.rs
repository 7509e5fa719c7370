//! The key store behind the hot cache: classification order batch → hot
//! cache → key store, driven by a manual clock.

use dedupd::classify::{
    Candidate, ClassifierSettings, Clock, ManualClock, PartitionClassifier, SeenKey, Tier, Verdict,
};
use dedupd::event::{id_hash, IdHash, PayloadHash, Position};
use dedupd::keystore::{KeyStore, KeyStoreOptions};

const SECOND: i64 = 1000;
const HOT_TTL: i64 = 10 * SECOND;
const HORIZON: i64 = 100 * SECOND;
const P: i32 = 2;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn settings() -> ClassifierSettings {
    ClassifierSettings { hot_ttl_ms: HOT_TTL, hot_capacity: 1000, horizon_ms: HORIZON, detect_replays: true }
}

fn store(dir: &std::path::Path) -> Result<KeyStore, Box<dyn std::error::Error>> {
    let opts = KeyStoreOptions {
        horizon_ms: HORIZON,
        histogram_bucket_ms: SECOND,
        block_cache_bytes: 4 << 20,
        write_buffer_bytes: 4 << 20,
        ..KeyStoreOptions::default()
    };
    Ok(KeyStore::open(dir, opts)?)
}

fn candidate(event_id: &str, payload: u8, offset: i64) -> Candidate {
    Candidate {
        id_hash: id_hash("acme", event_id),
        payload_hash: PayloadHash([payload; 16]),
        source: Position::new(P, offset),
    }
}

/// Classifies `batch`, then publishes the accepted ones (output offsets from
/// `next_output`) into the hot cache and the key store, as the pipeline does.
fn run_batch(
    c: &mut PartitionClassifier,
    ks: &KeyStore,
    clock: &ManualClock,
    batch: &[Candidate],
    next_output: &mut i64,
) -> Result<Vec<Verdict>, Box<dyn std::error::Error>> {
    let now = clock.now_ms();
    let verdicts = c.classify(batch, ks, now)?;
    let mut published: Vec<SeenKey> = Vec::new();
    for (cand, v) in batch.iter().zip(&verdicts) {
        if matches!(v, Verdict::Accepted) {
            published.push(SeenKey {
                id_hash: cand.id_hash,
                payload_hash: cand.payload_hash,
                first_seen_ms: now,
                source: cand.source,
                output: Position::new(P, *next_output),
            });
            *next_output += 1;
        }
    }
    if let Some(last) = published.last() {
        ks.apply_batch(P, &published, last.output.offset)?;
    }
    c.commit(&published, now);
    Ok(verdicts)
}

#[test]
fn a_retry_past_the_hot_ttl_is_caught_by_the_key_store_as_duplicate_conflict_or_replay() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ks = store(dir.path())?;
    let clock = ManualClock::new(1_000_000);
    let mut c = PartitionClassifier::new(P, settings());
    let mut out = 0;
    let first = run_batch(&mut c, &ks, &clock, &[candidate("a", 1, 10), candidate("b", 2, 11)], &mut out)?;
    assert!(first.iter().all(|v| matches!(v, Verdict::Accepted)));

    clock.advance_ms(HOT_TTL + SECOND);
    c.evict_expired(clock.now_ms());
    assert!(c.hot_cache().is_empty(), "the hot cache must have forgotten both keys");

    let retry = [candidate("a", 1, 50), candidate("b", 9, 51), candidate("a", 1, 10), candidate("new", 3, 52)];
    let v = run_batch(&mut c, &ks, &clock, &retry, &mut out)?;
    assert!(
        matches!(v[0], Verdict::Duplicate { tier: Tier::KeyStore, first } if first.output == Some(Position::new(P, 0)))
    );
    assert!(
        matches!(v[1], Verdict::Conflict { tier: Tier::KeyStore, first } if first.payload_hash == PayloadHash([2; 16]))
    );
    assert!(matches!(v[2], Verdict::Replayed { tier: Tier::KeyStore, .. }));
    assert!(matches!(v[3], Verdict::Accepted));
    Ok(())
}

#[test]
fn a_retry_inside_the_hot_ttl_is_answered_by_the_hot_cache_first() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ks = store(dir.path())?;
    let clock = ManualClock::new(1_000_000);
    let mut c = PartitionClassifier::new(P, settings());
    let mut out = 0;
    run_batch(&mut c, &ks, &clock, &[candidate("a", 1, 10)], &mut out)?;
    clock.advance_ms(SECOND);
    let v = run_batch(&mut c, &ks, &clock, &[candidate("a", 1, 11)], &mut out)?;
    assert!(matches!(v[0], Verdict::Duplicate { tier: Tier::HotCache, .. }));
    Ok(())
}

#[test]
fn a_retry_past_the_horizon_is_accepted_as_new_and_remembered_again() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ks = store(dir.path())?;
    let clock = ManualClock::new(1_000_000);
    let mut c = PartitionClassifier::new(P, settings());
    let mut out = 0;
    run_batch(&mut c, &ks, &clock, &[candidate("a", 1, 10)], &mut out)?;

    // Past the horizon, before the store aged anything out: the classifier's
    // own horizon check already treats the key as forgotten.
    clock.advance_ms(HORIZON + SECOND);
    c.evict_expired(clock.now_ms());
    let v = c.classify(&[candidate("a", 1, 60)], &ks, clock.now_ms())?;
    assert!(matches!(v[0], Verdict::Accepted));

    // After age_out the store hides it too, and the new delivery becomes the
    // remembered one.
    let report = ks.age_out(clock.now_ms())?;
    assert!(report.floor_ms >= 1_000_000);
    assert!(ks.get(P, &id_hash("acme", "a"))?.is_none());
    let v = run_batch(&mut c, &ks, &clock, &[candidate("a", 7, 60)], &mut out)?;
    assert!(matches!(v[0], Verdict::Accepted));
    clock.advance_ms(HOT_TTL + SECOND);
    c.evict_expired(clock.now_ms());
    let v = c.classify(&[candidate("a", 7, 61)], &ks, clock.now_ms())?;
    assert!(
        matches!(v[0], Verdict::Duplicate { tier: Tier::KeyStore, first } if first.payload_hash == PayloadHash([7; 16]))
    );
    Ok(())
}

#[test]
fn lookups_answer_every_id_in_order_including_unknown_and_other_partitions() -> TestResult {
    use dedupd::classify::LongHorizon;
    let dir = tempfile::tempdir()?;
    let ks = store(dir.path())?;
    let k = SeenKey {
        id_hash: IdHash([1; 16]),
        payload_hash: PayloadHash([2; 16]),
        first_seen_ms: 5_000,
        source: Position::new(P, 1),
        output: Position::new(P, 1),
    };
    ks.apply_batch(P, &[k], 1)?;
    let mut out = Vec::new();
    ks.lookup_many(P, &[IdHash([3; 16]), IdHash([1; 16]), IdHash([3; 16])], &mut out)?;
    assert_eq!(out, vec![None, Some(k), None]);
    ks.lookup_many(P + 1, &[IdHash([1; 16])], &mut out)?;
    assert_eq!(out, vec![None]);
    ks.lookup_many(P, &[], &mut out)?;
    assert!(out.is_empty());
    Ok(())
}
