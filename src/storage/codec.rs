//! Byte-level building blocks shared by the on-disk formats: LEB128 varints,
//! zigzag, a bounds-checked reader, and the row encoding of one
//! [`StoredEvent`] used inside WAL frames.
//!
//! ```text
//! StoredEvent record (all integers little-endian; varint = unsigned LEB128;
//! str = varint length + UTF-8 bytes; opt str = varint (len + 1), 0 = absent)
//!   id_hash          [16]
//!   payload_hash     [16]
//!   first_seen_ms    i64
//!   source           i32 partition, i64 offset
//!   output           i32 partition, i64 offset
//!   timestamp_ms     i64
//!   quantity         [16]  rust_decimal::Decimal::serialize
//!   kind             u8    EventKind::code
//!   flags            u8    bit 0 = event_id_derived
//!   event_id, tenant_id, customer_id, meter          str
//!   resource_id, unit, source, corr_original_id, corr_reason   opt str
//!   dimension count  varint, then (key str, value str) * count
//! ```

use rust_decimal::Decimal;

use crate::classify::SeenKey;
use crate::event::{CorrectionRef, EventKind, IdHash, PayloadHash, Position, UsageEvent};

use super::StoredEvent;

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

pub(crate) fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn put_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => put_varint(out, 0),
        Some(s) => {
            put_varint(out, s.len() as u64 + 1);
            out.extend_from_slice(s.as_bytes());
        }
    }
}

/// Why bytes did not decode; the caller adds the file and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub String);

/// A bounds-checked cursor over a byte slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    // `bytes` and `varint` run once per value of every column, WAL record
    // and sidecar entry a reader passes over (a conflict's original walks
    // half a group's rows in each column): inlined, with the error built
    // out of line, they cost a few instructions a byte.
    #[inline]
    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        match self.buf.get(self.pos..).and_then(|rest| rest.get(..n)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.short(n)),
        }
    }

    #[cold]
    #[inline(never)]
    fn short(&self, n: usize) -> DecodeError {
        DecodeError(format!("needs {n} bytes at {}, only {} left", self.pos, self.buf.len().saturating_sub(self.pos)))
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(crate) fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    pub(crate) fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    #[inline]
    pub(crate) fn varint(&mut self) -> Result<u64, DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let mut v: u64 = 0;
        for (i, &b) in rest.iter().take(10).enumerate() {
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                self.pos += i + 1;
                return Ok(v);
            }
        }
        Err(self.bad_varint(rest.len()))
    }

    /// Why the varint at `pos` (with `left` bytes after it) did not end:
    /// the buffer ran out, or ten bytes all said "more".
    #[cold]
    #[inline(never)]
    fn bad_varint(&mut self, left: usize) -> DecodeError {
        if left < 10 {
            self.pos += left;
            self.short(1)
        } else {
            self.pos += 10;
            DecodeError(format!("varint longer than 10 bytes before {}", self.pos))
        }
    }

    pub(crate) fn str(&mut self) -> Result<String, DecodeError> {
        let len = usize::try_from(self.varint()?).map_err(|_| DecodeError("string length overflow".into()))?;
        self.utf8(len)
    }

    /// Passes over one [`str`](Self::str) entry without building it.
    pub(crate) fn skip_str(&mut self) -> Result<(), DecodeError> {
        let len = usize::try_from(self.varint()?).map_err(|_| DecodeError("string length overflow".into()))?;
        self.bytes(len).map(|_| ())
    }

    /// Passes over one [`opt_str`](Self::opt_str) entry without building it.
    pub(crate) fn skip_opt_str(&mut self) -> Result<(), DecodeError> {
        match self.varint()? {
            0 => Ok(()),
            n => {
                let len = usize::try_from(n - 1).map_err(|_| DecodeError("string length overflow".into()))?;
                self.bytes(len).map(|_| ())
            }
        }
    }

    pub(crate) fn opt_str(&mut self) -> Result<Option<String>, DecodeError> {
        match self.varint()? {
            0 => Ok(None),
            n => {
                let len = usize::try_from(n - 1).map_err(|_| DecodeError("string length overflow".into()))?;
                self.utf8(len).map(Some)
            }
        }
    }

    fn utf8(&mut self, len: usize) -> Result<String, DecodeError> {
        let at = self.pos;
        let b = self.bytes(len)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("invalid UTF-8 at {at}")))
    }
}

pub(crate) fn put_position(out: &mut Vec<u8>, p: Position) {
    out.extend_from_slice(&p.partition.to_le_bytes());
    out.extend_from_slice(&p.offset.to_le_bytes());
}

pub(crate) fn read_position(r: &mut Reader<'_>) -> Result<Position, DecodeError> {
    Ok(Position { partition: r.i32()?, offset: r.i64()? })
}

/// Appends the record encoding of `e` (see the module doc).
pub(crate) fn encode_event(e: &StoredEvent, out: &mut Vec<u8>) {
    let k = &e.key;
    let ev = &e.event;
    out.extend_from_slice(&k.id_hash.0);
    out.extend_from_slice(&k.payload_hash.0);
    out.extend_from_slice(&k.first_seen_ms.to_le_bytes());
    put_position(out, k.source);
    put_position(out, k.output);
    out.extend_from_slice(&ev.timestamp_ms.to_le_bytes());
    out.extend_from_slice(&ev.quantity.serialize());
    out.push(ev.kind.code());
    out.push(u8::from(ev.event_id_derived));
    put_str(out, &ev.event_id);
    put_str(out, &ev.tenant_id);
    put_str(out, &ev.customer_id);
    put_str(out, &ev.meter);
    put_opt_str(out, ev.resource_id.as_deref());
    put_opt_str(out, ev.unit.as_deref());
    put_opt_str(out, ev.source.as_deref());
    put_opt_str(out, ev.correction_ref.as_ref().map(|c| c.original_event_id.as_str()));
    put_opt_str(out, ev.correction_ref.as_ref().and_then(|c| c.reason.as_deref()));
    put_varint(out, ev.dimensions.len() as u64);
    for (key, value) in &ev.dimensions {
        put_str(out, key);
        put_str(out, value);
    }
}

pub(crate) fn kind_from_code(code: u8) -> Result<EventKind, DecodeError> {
    EventKind::from_code(code).ok_or_else(|| DecodeError(format!("unknown event kind code {code}")))
}

pub(crate) fn correction_ref(original: Option<String>, reason: Option<String>) -> Option<CorrectionRef> {
    original.map(|original_event_id| CorrectionRef { original_event_id, reason })
}

/// Decodes one record written by [`encode_event`].
pub(crate) fn decode_event(r: &mut Reader<'_>) -> Result<StoredEvent, DecodeError> {
    let key = SeenKey {
        id_hash: IdHash(r.array()?),
        payload_hash: PayloadHash(r.array()?),
        first_seen_ms: r.i64()?,
        source: read_position(r)?,
        output: read_position(r)?,
    };
    let timestamp_ms = r.i64()?;
    let quantity = Decimal::deserialize(r.array()?);
    let kind = kind_from_code(r.u8()?)?;
    let flags = r.u8()?;
    let event_id = r.str()?;
    let tenant_id = r.str()?;
    let customer_id = r.str()?;
    let meter = r.str()?;
    let resource_id = r.opt_str()?;
    let unit = r.opt_str()?;
    let source = r.opt_str()?;
    let corr_original = r.opt_str()?;
    let corr_reason = r.opt_str()?;
    let n = r.varint()?;
    let mut dimensions = Vec::with_capacity(n.min(64) as usize);
    for _ in 0..n {
        dimensions.push((r.str()?, r.str()?));
    }
    Ok(StoredEvent {
        key,
        event: UsageEvent {
            event_id,
            event_id_derived: flags & 1 != 0,
            tenant_id,
            customer_id,
            meter,
            quantity,
            timestamp_ms,
            kind,
            correction_ref: correction_ref(corr_original, corr_reason),
            resource_id,
            unit,
            source,
            dimensions,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_zigzag_round_trip_at_the_edges() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            assert_eq!(Reader::new(&b).varint(), Ok(v));
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX, -300] {
            assert_eq!(unzigzag(zigzag(v)), v);
        }
    }

    /// Varints one after another leave the cursor after each; a varint the
    /// buffer cuts short and one longer than ten bytes are errors that say
    /// where, and a read past the end is one too.
    #[test]
    fn varints_read_in_sequence_and_bad_ones_say_where() {
        let values = [5u64, 300, 0, u64::MAX, 127, 128];
        let mut b = Vec::new();
        for v in values {
            put_varint(&mut b, v);
        }
        let mut r = Reader::new(&b);
        for v in values {
            assert_eq!(r.varint(), Ok(v));
        }
        assert!(r.is_empty());
        assert_eq!(r.varint(), Err(DecodeError(format!("needs 1 bytes at {}, only 0 left", b.len()))));
        let mut r = Reader::new(&[0x80, 0x80, 0x80]);
        assert_eq!(r.varint(), Err(DecodeError("needs 1 bytes at 3, only 0 left".into())));
        let mut r = Reader::new(&[0xff; 12]);
        assert_eq!(r.varint(), Err(DecodeError("varint longer than 10 bytes before 10".into())));
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.bytes(2), Ok(&[1u8, 2][..]));
        assert_eq!(r.bytes(2), Err(DecodeError("needs 2 bytes at 2, only 1 left".into())));
        assert_eq!(r.bytes(usize::MAX), Err(DecodeError(format!("needs {} bytes at 2, only 1 left", usize::MAX))));
        assert_eq!(r.bytes(1), Ok(&[3u8][..]));
    }

    #[test]
    fn a_truncated_record_is_a_decode_error_not_a_panic() {
        let e = super::super::testutil::sample_event(7, 0, 42);
        let mut b = Vec::new();
        encode_event(&e, &mut b);
        assert_eq!(decode_event(&mut Reader::new(&b)), Ok(e));
        for cut in [0, 10, b.len() - 1] {
            assert!(decode_event(&mut Reader::new(&b[..cut])).is_err());
        }
    }
}
