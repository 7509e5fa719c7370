//! The first-seen histogram: how many keys each partition holds per time
//! bucket of `first_seen_ms`.
//!
//! It is what lets the store age out oldest-first without scanning keys:
//! the size cap turns into a first-seen floor by walking buckets from the
//! newest, the window metric reads the oldest live bucket, and per-partition
//! key counts are sums of a few hundred cells. It lives in memory (a few
//! hundred cells per partition at the default one-hour bucket) and is
//! persisted in the meta column family through a merge operator, in the same
//! write batch as the keys it counts, so it is exactly as durable as they are.
//!
//! Counts are an estimate at the edges: a bucket that straddles the floor is
//! counted whole until all of it is below the floor, and a key replaced after
//! it expired (same id accepted again past the horizon) is counted in both
//! buckets until the old one is dropped.

use std::collections::BTreeMap;

use super::codec::{partition_bytes, partition_from_bytes, META_HISTOGRAM};

/// Keys of one partition in one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketStats {
    pub count: i64,
    pub min_ms: i64,
    pub max_ms: i64,
}

impl BucketStats {
    pub(crate) const ENCODED_LEN: usize = 24;

    pub(crate) fn one(first_seen_ms: i64) -> BucketStats {
        BucketStats { count: 1, min_ms: first_seen_ms, max_ms: first_seen_ms }
    }

    pub(crate) fn absorb(&mut self, o: &BucketStats) {
        self.count += o.count;
        self.min_ms = self.min_ms.min(o.min_ms);
        self.max_ms = self.max_ms.max(o.max_ms);
    }

    pub(crate) fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..16].copy_from_slice(&self.min_ms.to_le_bytes());
        b[16..].copy_from_slice(&self.max_ms.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<BucketStats> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..i * 8 + 8]);
            i64::from_le_bytes(w)
        };
        Some(BucketStats { count: word(0), min_ms: word(1), max_ms: word(2) })
    }
}

/// Meta key of a histogram cell: `"h" | bucket (i64, sign-flipped BE) | partition`.
pub(crate) fn cell_key(bucket: i64, partition: i32) -> [u8; 13] {
    let mut k = [0u8; 13];
    k[0] = META_HISTOGRAM;
    k[1..9].copy_from_slice(&((bucket as u64) ^ (1 << 63)).to_be_bytes());
    k[9..].copy_from_slice(&partition_bytes(partition));
    k
}

pub(crate) fn parse_cell_key(k: &[u8]) -> Option<(i64, i32)> {
    if k.len() != 13 || k[0] != META_HISTOGRAM {
        return None;
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&k[1..9]);
    let mut p = [0u8; 4];
    p.copy_from_slice(&k[9..]);
    Some(((u64::from_be_bytes(b) ^ (1 << 63)) as i64, partition_from_bytes(p)))
}

/// The meta column family's merge operator: histogram cells add counts and
/// widen their time range; any other key keeps its newest operand (no other
/// key is written by merge, this only makes the operator total).
pub(crate) fn merge_meta(key: &[u8], existing: Option<&[u8]>, operands: &rocksdb::MergeOperands) -> Option<Vec<u8>> {
    if key.first() != Some(&META_HISTOGRAM) {
        return operands.iter().last().or(existing).map(<[u8]>::to_vec);
    }
    let mut acc: Option<BucketStats> = None;
    // An undecodable operand fails the merge; RocksDB then reports
    // corruption on read instead of silently losing counts.
    for v in existing.into_iter().chain(operands.iter()) {
        let s = BucketStats::decode(v)?;
        match &mut acc {
            Some(a) => a.absorb(&s),
            None => acc = Some(s),
        }
    }
    acc.map(|a| a.encode().to_vec())
}

/// In-memory copy of the histogram, ordered by (bucket, partition), which is
/// first-seen order.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    bucket_ms: i64,
    cells: BTreeMap<(i64, i32), BucketStats>,
}

impl Histogram {
    pub(crate) fn new(bucket_ms: i64) -> Histogram {
        Histogram { bucket_ms: bucket_ms.max(1), cells: BTreeMap::new() }
    }

    pub(crate) fn bucket_of(&self, first_seen_ms: i64) -> i64 {
        Self::bucket_of_ms(self.bucket_ms, first_seen_ms)
    }

    /// [`bucket_of`](Self::bucket_of) for buckets of `bucket_ms`, without
    /// the histogram (and its lock) at hand.
    pub(crate) fn bucket_of_ms(bucket_ms: i64, first_seen_ms: i64) -> i64 {
        first_seen_ms.div_euclid(bucket_ms)
    }

    /// Last millisecond of `bucket`.
    fn bucket_last_ms(&self, bucket: i64) -> i64 {
        bucket.saturating_add(1).saturating_mul(self.bucket_ms).saturating_sub(1)
    }

    pub(crate) fn add(&mut self, bucket: i64, partition: i32, s: &BucketStats) {
        self.cells.entry((bucket, partition)).and_modify(|c| c.absorb(s)).or_insert(*s);
    }

    /// Removes the cells wholly at or below `floor_ms`; returns them.
    pub(crate) fn drop_at_or_below(&mut self, floor_ms: i64) -> Vec<((i64, i32), BucketStats)> {
        // Bucket b is wholly at or below the floor when its last ms is.
        let first_kept = floor_ms.saturating_add(1).div_euclid(self.bucket_ms);
        let kept = self.cells.split_off(&(first_kept, i32::MIN));
        let dropped = std::mem::replace(&mut self.cells, kept);
        dropped.into_iter().collect()
    }

    pub(crate) fn remove_partition(&mut self, partition: i32) -> Vec<(i64, i32)> {
        let gone: Vec<(i64, i32)> = self.cells.keys().filter(|(_, p)| *p == partition).copied().collect();
        for k in &gone {
            self.cells.remove(k);
        }
        gone
    }

    pub(crate) fn partition_count(&self, partition: i32) -> u64 {
        let n: i64 = self.cells.iter().filter(|((_, p), _)| *p == partition).map(|(_, s)| s.count).sum();
        u64::try_from(n).unwrap_or(0)
    }

    pub(crate) fn total_count(&self) -> u64 {
        u64::try_from(self.cells.values().map(|s| s.count).sum::<i64>()).unwrap_or(0)
    }

    /// First-seen time of the oldest key above `floor_ms`. Exact unless the
    /// oldest bucket straddles the floor, where it is `floor_ms + 1`, a lower
    /// bound (the window is then over-reported by less than one bucket).
    pub(crate) fn oldest_above(&self, floor_ms: i64) -> Option<i64> {
        self.cells
            .values()
            .filter(|s| s.count > 0 && s.max_ms > floor_ms)
            .map(|s| s.min_ms.max(floor_ms.saturating_add(1)))
            .min()
    }

    /// The lowest floor that leaves at most `allowed_keys` keys above it,
    /// dropping whole buckets oldest first. `None` when everything fits.
    pub(crate) fn floor_for_capacity(&self, allowed_keys: u64) -> Option<i64> {
        let mut per_bucket: BTreeMap<i64, i64> = BTreeMap::new();
        for ((b, _), s) in &self.cells {
            *per_bucket.entry(*b).or_default() += s.count;
        }
        let mut kept: u64 = 0;
        for (b, n) in per_bucket.iter().rev() {
            kept = kept.saturating_add(u64::try_from(*n).unwrap_or(0));
            if kept > allowed_keys {
                return Some(self.bucket_last_ms(*b));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_keys_round_trip_and_sort_by_time() {
        for (b, p) in [(-5i64, 3i32), (0, 0), (481_000, -1), (i64::MAX, i32::MAX)] {
            assert_eq!(parse_cell_key(&cell_key(b, p)), Some((b, p)));
        }
        assert!(cell_key(-1, 9) < cell_key(0, 0));
        assert!(cell_key(7, 9) < cell_key(8, 0));
    }

    #[test]
    fn the_capacity_floor_drops_whole_buckets_oldest_first() {
        let mut h = Histogram::new(100);
        for (t, n) in [(50, 10), (150, 10), (250, 10)] {
            h.add(h.bucket_of(t), 0, &BucketStats { count: n, min_ms: t, max_ms: t });
        }
        assert_eq!(h.floor_for_capacity(30), None);
        assert_eq!(h.floor_for_capacity(25), Some(99));
        assert_eq!(h.floor_for_capacity(10), Some(199));
        assert_eq!(h.floor_for_capacity(5), Some(299));
        let dropped = h.drop_at_or_below(199);
        assert_eq!(dropped.len(), 2);
        assert_eq!(h.total_count(), 10);
        assert_eq!(h.oldest_above(199), Some(250));
    }

    #[test]
    fn a_bucket_straddling_the_floor_is_kept_and_bounds_the_oldest_key() {
        let mut h = Histogram::new(100);
        h.add(1, 4, &BucketStats { count: 2, min_ms: 110, max_ms: 190 });
        assert!(h.drop_at_or_below(150).is_empty());
        assert_eq!(h.oldest_above(150), Some(151));
        assert_eq!(h.oldest_above(190), None);
        assert_eq!(h.partition_count(4), 2);
        assert_eq!(h.partition_count(5), 0);
    }
}
