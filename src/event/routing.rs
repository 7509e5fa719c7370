//! Which input partition an event belongs on (issue #13).
//!
//! dedupd is exact only when every delivery of one event reaches the
//! partition whose state saw the first. That holds when the partition is a
//! function of the event's identity alone. The *identity key* is the output
//! record's key, `tenant_id \0 event_id` (for an event sent without an id,
//! the `drv_…` id dedupd derives), and three functions of it are supported:
//!
//! - [`Partitioner::Dedupd`], what `dedupd route` uses: the identity hash's
//!   first 8 bytes as a little-endian u64, modulo the partition count. It
//!   needs no key bytes at all, so it cannot be defeated by a key encoding.
//! - [`Partitioner::Murmur2`], the Java client's default partitioner over
//!   the identity key: `(murmur2(key) & 0x7fffffff) % partitions`.
//! - [`Partitioner::Crc32`], librdkafka's default (`consistent_random`) for a
//!   keyed record: `crc32(key) % partitions`, IEEE CRC-32.
//!
//! A producer that keys records by the identity key and uses its client's
//! default partitioner therefore places them where dedupd expects. An event
//! without `event_id` can be placed only by `dedupd route`: its id is derived
//! with a salt producers do not have.

use crate::event::IdHash;

/// A function from an event's identity to its input partition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Partitioner {
    /// The identity hash modulo the partition count (`dedupd route`).
    #[default]
    Dedupd,
    /// The Java client's default: murmur2 of the identity key.
    Murmur2,
    /// librdkafka's default: CRC-32 of the identity key.
    Crc32,
}

impl Partitioner {
    /// The flag spelling (`--partitioner`).
    pub fn as_str(self) -> &'static str {
        match self {
            Partitioner::Dedupd => "dedupd",
            Partitioner::Murmur2 => "murmur2",
            Partitioner::Crc32 => "crc32",
        }
    }

    pub fn parse(s: &str) -> Option<Partitioner> {
        match s {
            "dedupd" => Some(Partitioner::Dedupd),
            "murmur2" => Some(Partitioner::Murmur2),
            "crc32" => Some(Partitioner::Crc32),
            _ => None,
        }
    }

    /// The partition, out of `partitions` (at least 1), that the event with
    /// identity hash `id` and identity key `tenant_id \0 event_id` belongs on.
    pub fn partition_of(self, id: &IdHash, tenant_id: &str, event_id: &str, partitions: u32) -> i32 {
        let n = partitions.max(1);
        let p = match self {
            Partitioner::Dedupd => (id.low_u64() % u64::from(n)) as u32,
            Partitioner::Murmur2 => (murmur2(&identity_key(tenant_id, event_id)) & 0x7fff_ffff) % n,
            Partitioner::Crc32 => crc32(&identity_key(tenant_id, event_id)) % n,
        };
        // `p < n <= u32::MAX`, and Kafka partition counts fit an i32.
        i32::try_from(p).unwrap_or(i32::MAX)
    }
}

impl std::fmt::Display for Partitioner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `tenant_id \0 event_id`: the key of every record dedupd writes for an
/// event, and the key `dedupd route` gives the input record. Two identities
/// whose ids hold escaped NULs could share a key; that only places them on
/// one partition, which is harmless (identity itself is the hash of both
/// ids, length-prefixed).
pub fn identity_key(tenant_id: &str, event_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant_id.len() + 1 + event_id.len());
    k.extend_from_slice(tenant_id.as_bytes());
    k.push(0);
    k.extend_from_slice(event_id.as_bytes());
    k
}

/// MurmurHash2 (32-bit) with the seed and tail handling of Kafka's Java
/// client (`org.apache.kafka.common.utils.Utils.murmur2`), which librdkafka's
/// `murmur2` partitioner reproduces.
pub fn murmur2(data: &[u8]) -> u32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    // The Java code mixes the length as an `int`; keys are far below 2^31.
    let mut h = SEED ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        if tail.len() >= 3 {
            h ^= u32::from(tail[2]) << 16;
        }
        if tail.len() >= 2 {
            h ^= u32::from(tail[1]) << 8;
        }
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The IEEE CRC-32 (reflected, polynomial 0xEDB88320), as zlib and
/// librdkafka's `rd_crc32` compute it.
pub fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut bit = 0;
            while bit < 8 {
                c = if c & 1 == 1 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
                bit += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::id_hash;

    #[test]
    fn murmur2_matches_the_java_clients_published_values() {
        // Kafka's UtilsTest#testMurmur2 pins these (as signed Java ints).
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58_897_971),
            ("abc", 479_470_107),
        ];
        for (text, want) in cases {
            assert_eq!(murmur2(text.as_bytes()) as i32, want, "{text}");
        }
    }

    #[test]
    fn crc32_is_the_ieee_checksum() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"The quick brown fox jumps over the lazy dog"), 0x414f_a339);
    }

    #[test]
    fn the_dedupd_partitioner_depends_on_the_identity_only() {
        let id = id_hash("acme", "evt-1");
        let p = Partitioner::Dedupd.partition_of(&id, "acme", "evt-1", 12);
        assert_eq!(p as u64, id.low_u64() % 12);
        // The same identity spelled with another key would still land on p:
        // only the hash counts.
        assert_eq!(Partitioner::Dedupd.partition_of(&id, "", "", 12), p);
        assert_eq!(Partitioner::Dedupd.partition_of(&id, "acme", "evt-1", 1), 0);
    }

    #[test]
    fn every_partitioner_spreads_identities_over_every_partition() {
        for partitioner in [Partitioner::Dedupd, Partitioner::Murmur2, Partitioner::Crc32] {
            let mut counts = [0u32; 8];
            for i in 0..8000 {
                let e = format!("evt-{i}");
                let p = partitioner.partition_of(&id_hash("acme", &e), "acme", &e, 8);
                counts[p as usize] += 1;
            }
            // A fair spread puts ~1000 on each; a broken one piles them up.
            assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{partitioner}: {counts:?}");
        }
    }

    #[test]
    fn flag_spellings_round_trip() {
        for p in [Partitioner::Dedupd, Partitioner::Murmur2, Partitioner::Crc32] {
            assert_eq!(Partitioner::parse(p.as_str()), Some(p));
        }
        assert_eq!(Partitioner::parse("murmur2_random"), None);
    }
}
