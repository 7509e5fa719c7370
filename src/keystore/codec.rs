//! On-disk encoding of the key store's records.
//!
//! ```text
//! keys CF   key   (20 bytes)  partition u32 BE (sign bit flipped, so -1 < 0 < 1) | id_hash 16
//!           value (~31 bytes) tag u8 | payload_hash 16 | first_seen_ms zigzag varint
//!                             | source.offset zigzag varint | output.offset zigzag varint
//!                             | [source.partition zigzag varint  if tag & SOURCE_PARTITION]
//!                             | [output.partition zigzag varint  if tag & OUTPUT_PARTITION]
//! meta CF   "c" partition(4)            -> checkpoint: output offset, i64 BE          (put)
//!           "h" bucket(8) partition(4)  -> BucketStats: count i64 | min_ms | max_ms LE (merge: sum/min/max)
//!           "f"                         -> floor: first_seen_ms at or below which keys are gone, i64 BE
//!           "v"                         -> format version u32 BE
//!           "l"                         -> newest layer log written into the keys CF, u64 BE
//! ```
//!
//! Why this shape: fixed-width big-endian keys sort by partition, so one
//! partition is one contiguous key range (a single range tombstone drops it,
//! and SST files rarely straddle two partitions, so whole files can be
//! deleted). Ids are blake3 output and do not compress; everything else is a
//! varint. Input and output are co-partitioned (DESIGN §6), so both positions'
//! partitions normally equal the key's partition and are omitted: a typical
//! value is 1 + 16 + 6 + 4 + 4 = 31 bytes, which with the 20-byte key and
//! block prefix compression (blocks are not compressed: the hashes do not
//! shrink) lands at about 58 disk bytes per key (see the benchmark figures
//! in `docs/keystore.md`).
//!
//! The tag's low nibble is the value format version (1); a reader meeting an
//! unknown version reports corruption rather than guessing.

use crate::classify::SeenKey;
use crate::event::{IdHash, PayloadHash, Position};

use super::error::{hex, KeystoreError};

pub(crate) const KEY_LEN: usize = 20;
const VALUE_VERSION: u8 = 1;
const SOURCE_PARTITION: u8 = 0x10;
const OUTPUT_PARTITION: u8 = 0x20;
/// Longest value: tag, hash, three 10-byte varints, two 5-byte varints.
pub(crate) const MAX_VALUE_LEN: usize = 1 + 16 + 3 * 10 + 2 * 5;

pub(crate) const META_CHECKPOINT: u8 = b'c';
pub(crate) const META_HISTOGRAM: u8 = b'h';
pub(crate) const META_FLOOR: &[u8] = b"f";
pub(crate) const META_VERSION: &[u8] = b"v";
/// The newest layer log written into RocksDB (`recent.rs`): logs numbered
/// at or below it are not replayed.
pub(crate) const META_LOGS_WRITTEN: &[u8] = b"l";
pub(crate) const FORMAT_VERSION: u32 = 1;

pub(crate) fn partition_bytes(partition: i32) -> [u8; 4] {
    ((partition as u32) ^ 0x8000_0000).to_be_bytes()
}

pub(crate) fn partition_from_bytes(b: [u8; 4]) -> i32 {
    (u32::from_be_bytes(b) ^ 0x8000_0000) as i32
}

/// Key of `id` in `partition`.
pub(crate) fn encode_key(partition: i32, id: &IdHash) -> [u8; KEY_LEN] {
    let mut k = [0u8; KEY_LEN];
    k[..4].copy_from_slice(&partition_bytes(partition));
    k[4..].copy_from_slice(&id.0);
    k
}

/// The key range `[start, end)` holding every key of `partition`.
pub(crate) fn partition_range(partition: i32) -> ([u8; 4], Vec<u8>) {
    let start = partition_bytes(partition);
    let end = match u32::from_be_bytes(start).checked_add(1) {
        Some(next) => next.to_be_bytes().to_vec(),
        // The last partition: every key starts with 0xff_ff_ff_ff, and is
        // shorter than or equal to this 21-byte bound.
        None => vec![0xff; KEY_LEN + 1],
    };
    (start, end)
}

pub(crate) fn decode_key(key: &[u8]) -> Result<(i32, IdHash), KeystoreError> {
    if key.len() != KEY_LEN {
        return Err(KeystoreError::Corrupt { what: "key", key_hex: hex(key), detail: "length is not 20" });
    }
    let mut p = [0u8; 4];
    p.copy_from_slice(&key[..4]);
    let mut id = [0u8; 16];
    id.copy_from_slice(&key[4..]);
    Ok((partition_from_bytes(p), IdHash(id)))
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Appends the value of `k` (stored under `partition`) to `out`.
pub(crate) fn encode_value(partition: i32, k: &SeenKey, out: &mut Vec<u8>) {
    let mut tag = VALUE_VERSION;
    if k.source.partition != partition {
        tag |= SOURCE_PARTITION;
    }
    if k.output.partition != partition {
        tag |= OUTPUT_PARTITION;
    }
    out.push(tag);
    out.extend_from_slice(&k.payload_hash.0);
    put_varint(out, zigzag(k.first_seen_ms));
    put_varint(out, zigzag(k.source.offset));
    put_varint(out, zigzag(k.output.offset));
    if tag & SOURCE_PARTITION != 0 {
        put_varint(out, zigzag(i64::from(k.source.partition)));
    }
    if tag & OUTPUT_PARTITION != 0 {
        put_varint(out, zigzag(i64::from(k.output.partition)));
    }
}

/// The `first_seen_ms` of an encoded value, without decoding the rest (the
/// compaction filter's hot path).
pub(crate) fn value_first_seen_ms(value: &[u8]) -> Option<i64> {
    if value.len() < 18 || value[0] & 0x0f != VALUE_VERSION {
        return None;
    }
    let mut pos = 17;
    get_varint(value, &mut pos).map(unzigzag)
}

pub(crate) fn decode_value(partition: i32, id: IdHash, value: &[u8]) -> Result<SeenKey, KeystoreError> {
    let corrupt = |detail| KeystoreError::Corrupt { what: "value", key_hex: hex(&encode_key(partition, &id)), detail };
    let tag = *value.first().ok_or_else(|| corrupt("empty"))?;
    if tag & 0x0f != VALUE_VERSION || tag & !(0x0f | SOURCE_PARTITION | OUTPUT_PARTITION) != 0 {
        return Err(corrupt("unknown value version or flags"));
    }
    if value.len() < 17 {
        return Err(corrupt("shorter than its payload hash"));
    }
    let mut payload = [0u8; 16];
    payload.copy_from_slice(&value[1..17]);
    let mut pos = 17;
    let mut next = |what| get_varint(value, &mut pos).map(unzigzag).ok_or_else(|| corrupt(what));
    let first_seen_ms = next("truncated first_seen_ms")?;
    let source_offset = next("truncated source offset")?;
    let output_offset = next("truncated output offset")?;
    let mut part = |flag, what| -> Result<i32, KeystoreError> {
        if tag & flag == 0 {
            return Ok(partition);
        }
        i32::try_from(next(what)?).map_err(|_| corrupt("partition out of range"))
    };
    let source_partition = part(SOURCE_PARTITION, "truncated source partition")?;
    let output_partition = part(OUTPUT_PARTITION, "truncated output partition")?;
    if pos != value.len() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(SeenKey {
        id_hash: id,
        payload_hash: PayloadHash(payload),
        first_seen_ms,
        source: Position::new(source_partition, source_offset),
        output: Position::new(output_partition, output_offset),
    })
}

pub(crate) fn checkpoint_key(partition: i32) -> [u8; 5] {
    let mut k = [0u8; 5];
    k[0] = META_CHECKPOINT;
    k[1..].copy_from_slice(&partition_bytes(partition));
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seen(id: u8, first_seen_ms: i64, source: Position, output: Position) -> SeenKey {
        SeenKey { id_hash: IdHash([id; 16]), payload_hash: PayloadHash([id ^ 0x5a; 16]), first_seen_ms, source, output }
    }

    #[test]
    fn a_co_partitioned_key_encodes_in_about_31_bytes() {
        let k = seen(1, 1_763_700_000_000, Position::new(3, 12_345_678), Position::new(3, 9_876_543));
        let mut v = Vec::new();
        encode_value(3, &k, &mut v);
        assert_eq!(v.len(), 1 + 16 + 6 + 4 + 4);
        assert_eq!(decode_value(3, k.id_hash, &v).ok(), Some(k));
        assert_eq!(value_first_seen_ms(&v), Some(k.first_seen_ms));
    }

    #[test]
    fn keys_sort_by_partition_then_id_with_negative_partitions_first() {
        let a = encode_key(-1, &IdHash([0xff; 16]));
        let b = encode_key(0, &IdHash([0; 16]));
        let c = encode_key(0, &IdHash([1; 16]));
        let d = encode_key(i32::MAX, &IdHash([0; 16]));
        assert!(a < b && b < c && c < d);
        let (start, end) = partition_range(i32::MAX);
        assert!(d.as_slice() >= start.as_slice() && d.as_slice() < end.as_slice());
        assert!(encode_key(i32::MAX, &IdHash([0xff; 16])).as_slice() < end.as_slice());
    }

    #[test]
    fn a_value_of_an_unknown_version_is_reported_as_corrupt() {
        let mut v = Vec::new();
        encode_value(0, &seen(1, 5, Position::new(0, 1), Position::new(0, 2)), &mut v);
        v[0] = 2;
        assert!(matches!(decode_value(0, IdHash([1; 16]), &v), Err(KeystoreError::Corrupt { .. })));
        assert!(value_first_seen_ms(&v).is_none());
        v[0] = 1;
        v.push(0);
        assert!(matches!(decode_value(0, IdHash([1; 16]), &v), Err(KeystoreError::Corrupt { .. })));
    }

    proptest! {
        #[test]
        fn every_key_and_value_round_trips(
            partition in any::<i32>(), id in any::<[u8; 16]>(), payload in any::<[u8; 16]>(),
            first_seen_ms in any::<i64>(), sp in any::<i32>(), so in any::<i64>(), op in any::<i32>(), oo in any::<i64>(),
            same_partitions in any::<bool>(),
        ) {
            let (sp, op) = if same_partitions { (partition, partition) } else { (sp, op) };
            let k = SeenKey {
                id_hash: IdHash(id), payload_hash: PayloadHash(payload), first_seen_ms,
                source: Position::new(sp, so), output: Position::new(op, oo),
            };
            let key = encode_key(partition, &k.id_hash);
            let (p2, id2) = decode_key(&key).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!((p2, id2), (partition, k.id_hash));
            let mut v = Vec::new();
            encode_value(partition, &k, &mut v);
            prop_assert!(v.len() <= MAX_VALUE_LEN);
            prop_assert_eq!(decode_value(partition, k.id_hash, &v).ok(), Some(k));
            prop_assert_eq!(value_first_seen_ms(&v), Some(first_seen_ms));
        }
    }
}
