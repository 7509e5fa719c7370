//! The four-bucket classifier of one partition (DESIGN §5).
//!
//! Classification is read-only: it consults, in order, the batch's own earlier
//! records, the hot cache and the long-horizon store, and returns a verdict per
//! record. State changes only through [`PartitionClassifier::commit`], which
//! the caller makes after the accepted events are durably published, so a
//! failed publish never leaves a key behind that would turn the producer's
//! retry into a false duplicate.

use hashbrown::HashMap;

use crate::classify::hot_cache::HotCache;
use crate::classify::seen::SeenKey;
use crate::event::{IdHash, PayloadHash, Position};

/// One record to classify: its identity, its payload and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id_hash: IdHash,
    pub payload_hash: PayloadHash,
    pub source: Position,
}

/// Which state tier recognised a known id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// An earlier record of the same batch.
    Batch,
    HotCache,
    KeyStore,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Batch => "batch",
            Tier::HotCache => "hot_cache",
            Tier::KeyStore => "keystore",
        }
    }
}

/// What the first accepted delivery of an id left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstSeen {
    pub payload_hash: PayloadHash,
    /// Ingest time of the first delivery; for [`Tier::Batch`] this is the
    /// batch's own time.
    pub first_seen_ms: i64,
    pub source: Position,
    /// Where it was published; `None` when it is in the same, unpublished batch.
    pub output: Option<Position>,
    /// For [`Tier::Batch`], the index of that earlier record in the batch:
    /// among the classifier's candidates in a [`Verdict`], among all the
    /// batch's records (rejects included) in an [`Outcome`](crate::classify::Outcome).
    pub batch_index: Option<usize>,
}

impl FirstSeen {
    fn from_seen(k: &SeenKey) -> FirstSeen {
        FirstSeen {
            payload_hash: k.payload_hash,
            first_seen_ms: k.first_seen_ms,
            source: k.source,
            output: Some(k.output),
            batch_index: None,
        }
    }
}

/// The classification of one valid record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// New id: publish it.
    Accepted,
    /// Known id, same payload: a retry; drop it.
    Duplicate { tier: Tier, first: FirstSeen },
    /// Known id, different payload: keep the first, report this one.
    Conflict { tier: Tier, first: FirstSeen },
    /// The very record that was accepted before (same source position), seen
    /// again after a crash or rebalance: not a customer duplicate.
    Replayed { tier: Tier, first: FirstSeen },
}

/// Failure of the long-horizon store, surfaced to the caller: a batch whose
/// lookups failed cannot be classified, and must not be guessed.
#[derive(Debug, thiserror::Error)]
#[error("long-horizon key lookup failed: {0}")]
pub struct HorizonError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// The long-horizon tier (the RocksDB key store), asked only about the hot
/// cache's misses, in one batched call per batch.
pub trait LongHorizon {
    /// For each id, the remembered key or `None`. `out` is cleared and filled
    /// with exactly `ids.len()` answers, in order.
    fn lookup_many(&self, partition: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError>;
}

/// No long-horizon tier: the hot cache is all there is (offline mode without a
/// state directory).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLongHorizon;

impl LongHorizon for NoLongHorizon {
    fn lookup_many(&self, _: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError> {
        out.clear();
        out.resize(ids.len(), None);
        Ok(())
    }
}

/// Settings of a partition classifier.
#[derive(Clone, Copy, Debug)]
pub struct ClassifierSettings {
    /// How long the hot cache remembers a key after first seen.
    pub hot_ttl_ms: i64,
    /// Most keys the hot cache holds for this partition.
    pub hot_capacity: usize,
    /// How long the long-horizon tier's answers count; an older key is
    /// treated as forgotten even if the store has not aged it out yet.
    pub horizon_ms: i64,
    /// Report re-deliveries of the accepted record itself as `Replayed`.
    /// Meaningful only where source positions identify a record (Kafka).
    pub detect_replays: bool,
}

/// Classifies the records of one partition.
#[derive(Debug)]
pub struct PartitionClassifier {
    settings: ClassifierSettings,
    hot: HotCache,
}

impl PartitionClassifier {
    pub fn new(partition: i32, settings: ClassifierSettings) -> PartitionClassifier {
        PartitionClassifier { settings, hot: HotCache::new(partition, settings.hot_ttl_ms, settings.hot_capacity) }
    }

    pub fn partition(&self) -> i32 {
        self.hot.partition()
    }

    pub fn hot_cache(&self) -> &HotCache {
        &self.hot
    }

    pub fn settings(&self) -> &ClassifierSettings {
        &self.settings
    }

    /// Classifies `batch` in order. Read-only: nothing is remembered until
    /// [`commit`](Self::commit).
    pub fn classify(
        &self,
        batch: &[Candidate],
        long: &dyn LongHorizon,
        now_ms: i64,
    ) -> Result<Vec<Verdict>, HorizonError> {
        // Pass 1: the hot cache, in a loop of lookups alone: each is a cache
        // miss into a table of millions of keys, and with nothing else in
        // the loop the CPU has several of them in flight at once.
        let hot_hits: Vec<Option<SeenKey>> = batch.iter().map(|c| self.hot.get(&c.id_hash, now_ms)).collect();
        // Misses are collected (once per id) for a single batched
        // long-horizon lookup. Tables sized for the batch up front: grown
        // from empty, their rehashing was 5% of classifying new traffic.
        let misses = hot_hits.iter().filter(|h| h.is_none()).count();
        let mut miss_ids: Vec<IdHash> = Vec::with_capacity(misses);
        let mut miss_index: HashMap<IdHash, usize, IdBuildHasher> =
            HashMap::with_capacity_and_hasher(misses, IdBuildHasher);
        for (c, hit) in batch.iter().zip(&hot_hits) {
            if hit.is_none() {
                miss_index.entry(c.id_hash).or_insert_with(|| {
                    miss_ids.push(c.id_hash);
                    miss_ids.len() - 1
                });
            }
        }
        let mut long_hits: Vec<Option<SeenKey>> = Vec::new();
        if !miss_ids.is_empty() {
            long.lookup_many(self.partition(), &miss_ids, &mut long_hits)?;
            if long_hits.len() != miss_ids.len() {
                return Err(HorizonError(
                    format!("asked about {} keys, got {} answers", miss_ids.len(), long_hits.len()).into(),
                ));
            }
        }

        // Pass 2: in order, the batch's own accepted records first.
        let mut accepted_in_batch: HashMap<IdHash, usize, IdBuildHasher> =
            HashMap::with_capacity_and_hasher(miss_ids.len(), IdBuildHasher);
        let mut verdicts = Vec::with_capacity(batch.len());
        for (i, c) in batch.iter().enumerate() {
            let verdict = if let Some(&j) = accepted_in_batch.get(&c.id_hash) {
                let first = FirstSeen {
                    payload_hash: batch[j].payload_hash,
                    first_seen_ms: now_ms,
                    source: batch[j].source,
                    output: None,
                    batch_index: Some(j),
                };
                self.known(c, Tier::Batch, first)
            } else if let Some(k) = &hot_hits[i] {
                self.known(c, Tier::HotCache, FirstSeen::from_seen(k))
            } else {
                let remembered = miss_index
                    .get(&c.id_hash)
                    .and_then(|&m| long_hits.get(m).copied().flatten())
                    .filter(|k| k.first_seen_ms.saturating_add(self.settings.horizon_ms) > now_ms);
                match remembered {
                    Some(k) => self.known(c, Tier::KeyStore, FirstSeen::from_seen(&k)),
                    None => {
                        accepted_in_batch.insert(c.id_hash, i);
                        Verdict::Accepted
                    }
                }
            };
            verdicts.push(verdict);
        }
        Ok(verdicts)
    }

    fn known(&self, c: &Candidate, tier: Tier, first: FirstSeen) -> Verdict {
        if first.payload_hash != c.payload_hash {
            Verdict::Conflict { tier, first }
        } else if self.settings.detect_replays && first.source == c.source {
            Verdict::Replayed { tier, first }
        } else {
            Verdict::Duplicate { tier, first }
        }
    }

    /// Remembers keys whose events are now durably published. Idempotent:
    /// committing a key already remembered changes nothing.
    pub fn commit<'a>(&mut self, keys: impl IntoIterator<Item = &'a SeenKey>, now_ms: i64) {
        let keys = keys.into_iter();
        self.hot.reserve(keys.size_hint().0);
        for k in keys {
            self.hot.insert(k, now_ms);
        }
    }

    /// Drops keys past the hot TTL.
    pub fn evict_expired(&mut self, now_ms: i64) -> usize {
        self.hot.evict_expired(now_ms)
    }
}

/// Ids are blake3 output: their low 64 bits are already a good hash.
#[derive(Clone, Copy, Default)]
pub struct IdBuildHasher;

/// Hasher for [`IdBuildHasher`]; takes the first 8 bytes written.
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::BuildHasher for IdBuildHasher {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // `[u8; 16]`'s Hash writes a length first, then the bytes; fold
        // everything so any call pattern still mixes all of it.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(b);
        }
    }
}
