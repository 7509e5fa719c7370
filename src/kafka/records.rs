//! The records dedupd writes, and reading output records back (repair).
//!
//! ```text
//! output topic (partition p = input partition p)
//!   key        tenant_id \0 event_id          deterministic: retries and replays key alike
//!   value      canonical JSON of the event    (crate::event::to_canonical_json)
//!   timestamp  ingest time (first_seen_ms)    retention never drops a back-dated event early
//!   headers    dedupd.source.partition  decimal   input position of the accepted record
//!              dedupd.source.offset     decimal
//!              dedupd.ingest.ms         decimal   = first_seen_ms
//!              dedupd.id.hash           32 hex    identity (tenant-scoped)
//!              dedupd.payload.hash      32 hex    canonical payload
//!
//! conflicts topic (partition p mod its partition count)
//!   key        tenant_id \0 event_id
//!   value      JSON: tenant_id, event_id, id_hash, tier, first {payload_hash, source,
//!              output, first_seen_ms}, conflict {payload_hash, source, ingest_ms},
//!              differing_fields (null when the original is no longer held), event
//!   headers    dedupd.source.*, dedupd.ingest.ms, dedupd.id.hash, dedupd.payload.hash
//!
//! rejected topic (partition p mod its partition count)
//!   key        the input record's key, truncated to 1 KiB (MAX_SIDE_KEY_BYTES)
//!   value      the raw input bytes, as is (null for a tombstone), truncated to
//!              max_rejected_raw_bytes
//!   headers    dedupd.reason            reason code (DESIGN §4)
//!              dedupd.detail            human-readable detail (≤ 1 KiB)
//!              dedupd.source.partition / dedupd.source.offset / dedupd.ingest.ms
//!              dedupd.raw.bytes         length of the raw input
//!              dedupd.raw.truncated     "true" when value holds a prefix only
//!              dedupd.raw.blake3        hex blake3 of the whole raw input, when truncated
//!              dedupd.key.bytes         length of the input key, when it was truncated
//! ```
//!
//! Every record dedupd writes is bounded in bytes, so none can exceed the
//! producer's `message.max.bytes` (checked at start against the settings):
//! output values by `max_output_bytes`, rejected values by
//! `max_rejected_raw_bytes`, side keys by [`MAX_SIDE_KEY_BYTES`], details by
//! 1 KiB, and conflicts by the canonical event plus a fixed envelope.

use rdkafka::message::{Header, Headers, OwnedHeaders};
use serde_json::value::RawValue;

use crate::classify::{FirstSeen, SeenKey, Tier};
use crate::event::{
    format_timestamp_ms, id_hash, payload_hash, push_timestamp_ms, to_canonical_json, IdHash, PayloadHash, Position,
    Rejection, UsageEvent, Validator,
};
use crate::kafka::engine::StoredEvent;
use crate::ledger::{Adjustment, HourKey, Rollup};

pub const H_SOURCE_PARTITION: &str = "dedupd.source.partition";
pub const H_SOURCE_OFFSET: &str = "dedupd.source.offset";
pub const H_INGEST_MS: &str = "dedupd.ingest.ms";
pub const H_ID_HASH: &str = "dedupd.id.hash";
pub const H_PAYLOAD_HASH: &str = "dedupd.payload.hash";
pub const H_REASON: &str = "dedupd.reason";
pub const H_DETAIL: &str = "dedupd.detail";
pub const H_RAW_BYTES: &str = "dedupd.raw.bytes";
pub const H_RAW_TRUNCATED: &str = "dedupd.raw.truncated";
pub const H_RAW_BLAKE3: &str = "dedupd.raw.blake3";
pub const H_KEY_BYTES: &str = "dedupd.key.bytes";

const MAX_DETAIL_BYTES: usize = 1024;

/// Longest input key copied into a rejected record. Keys are not bounded on
/// the way in (any producer may send any key), so the copy must be.
pub const MAX_SIDE_KEY_BYTES: usize = 1024;

/// What a side or output record may add to its value and key in headers and
/// framing: the headers above, Kafka's record overhead, and the conflict
/// record's JSON envelope around the canonical event.
pub const RECORD_OVERHEAD_BYTES: usize = 4096;

/// Which of the three topics a record goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Destination {
    Output,
    Conflicts,
    Rejected,
    /// The usage ledger's rollups and adjustments (`--rollups-topic`).
    Rollups,
}

/// One record to produce.
#[derive(Clone, Debug)]
pub struct OutRecord {
    pub destination: Destination,
    pub partition: i32,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(&'static str, Vec<u8>)>,
    /// Headers carried over from a raw record as they were (the router);
    /// sent after `headers`.
    pub passthrough_headers: Vec<(String, Option<Vec<u8>>)>,
    pub timestamp_ms: i64,
}

impl OutRecord {
    pub fn owned_headers(&self) -> OwnedHeaders {
        let mut h = OwnedHeaders::new_with_capacity(self.headers.len() + self.passthrough_headers.len());
        for (k, v) in &self.headers {
            h = h.insert(Header { key: k, value: Some(v) });
        }
        for (k, v) in &self.passthrough_headers {
            h = h.insert(Header { key: k, value: v.as_deref() });
        }
        h
    }
}

/// The output key of an event: `tenant_id \0 event_id`.
pub fn event_key(e: &UsageEvent) -> Vec<u8> {
    crate::event::identity_key(&e.tenant_id, &e.event_id)
}

fn position_headers(h: &mut Vec<(&'static str, Vec<u8>)>, source: Position, ingest_ms: i64) {
    h.push((H_SOURCE_PARTITION, source.partition.to_string().into_bytes()));
    h.push((H_SOURCE_OFFSET, source.offset.to_string().into_bytes()));
    h.push((H_INGEST_MS, ingest_ms.to_string().into_bytes()));
}

/// The output record of an accepted event.
pub fn accepted_record(e: &UsageEvent, id: IdHash, ph: PayloadHash, source: Position, ingest_ms: i64) -> OutRecord {
    let mut headers = Vec::with_capacity(5);
    position_headers(&mut headers, source, ingest_ms);
    headers.push((H_ID_HASH, id.to_hex().into_bytes()));
    headers.push((H_PAYLOAD_HASH, ph.to_hex().into_bytes()));
    OutRecord {
        destination: Destination::Output,
        partition: source.partition,
        key: Some(event_key(e)),
        value: Some(to_canonical_json(e).into_bytes()),
        headers,
        passthrough_headers: Vec::new(),
        timestamp_ms: ingest_ms,
    }
}

/// The rollups-topic key of a counter-hour of one partition:
/// `rollup \0 tenant \0 customer \0 meter \0 hour_ms \0 partition`. Compaction
/// keeps its latest total; a reader sums the partitions of an hour.
pub fn rollup_key(k: &HourKey, partition: i32) -> Vec<u8> {
    use std::io::Write as _;
    let c = &k.counter;
    let mut key = Vec::with_capacity(40 + c.tenant_id.len() + c.customer_id.len() + c.meter.len());
    for part in [b"rollup".as_slice(), c.tenant_id.as_bytes(), c.customer_id.as_bytes(), c.meter.as_bytes()] {
        key.extend_from_slice(part);
        key.push(0);
    }
    // Writing into a `Vec` cannot fail.
    let _ = write!(key, "{}\0{partition}", k.hour_ms);
    key
}

/// The rollups-topic record of a counter-hour's new total on `partition`.
pub fn rollup_record(k: &HourKey, r: &Rollup, partition: i32, rollups_partitions: usize, now_ms: i64) -> OutRecord {
    OutRecord {
        destination: Destination::Rollups,
        partition: side_partition(partition, rollups_partitions),
        key: Some(rollup_key(k, partition)),
        value: Some(rollup_value(k, r, partition).into_bytes()),
        headers: Vec::new(),
        passthrough_headers: Vec::new(),
        timestamp_ms: now_ms,
    }
}

/// A rollup record's value, written field by field into one string: a
/// worker publishes about one record for every five events, and building
/// it through serde (an owned string per timestamp and decimal, then the
/// text) was most of the cost of making it (perf, 2026-11-28). The bytes
/// are what `serde_json` wrote for the same fields in alphabetical order,
/// pinned by `a_rollup_record_is_pinned_byte_for_byte`.
fn rollup_value(k: &HourKey, r: &Rollup, partition: i32) -> String {
    use std::fmt::Write as _;
    // `write!` into a `String` cannot fail.
    let mut out = String::with_capacity(320);
    let _ = write!(out, r#"{{"corrections":{},"count":{},"customer_id":"#, r.corrections, r.count);
    push_json_string(&mut out, &k.counter.customer_id);
    out.push_str(r#","hour":""#);
    push_timestamp_ms(&mut out, k.hour_ms);
    out.push_str(r#"","last":"#);
    push_optional(&mut out, r.last.map(|(_, q)| q), push_decimal);
    out.push_str(r#","last_event_time":"#);
    push_optional(&mut out, r.last.map(|(t, _)| t), push_timestamp_ms);
    out.push_str(r#","latest_event_time":"#);
    push_optional(&mut out, (r.latest_event_ms != i64::MIN).then_some(r.latest_event_ms), push_timestamp_ms);
    out.push_str(r#","max":"#);
    push_optional(&mut out, r.max, push_decimal);
    out.push_str(r#","meter":"#);
    push_json_string(&mut out, &k.counter.meter);
    let _ = write!(out, r#","partition":{partition},"sum":""#);
    push_decimal(&mut out, r.sum);
    out.push_str(r#"","tenant_id":"#);
    push_json_string(&mut out, &k.counter.tenant_id);
    out.push_str(r#","type":"rollup"}"#);
    out
}

/// A decimal as the rollups topic writes it: normalised (`"12.5"`, never
/// `"12.50"`).
fn push_decimal(out: &mut String, d: rust_decimal::Decimal) {
    use std::fmt::Write as _;
    // `write!` into a `String` cannot fail.
    let _ = write!(out, "{}", d.normalize());
}

/// `null`, or the value written by `push` between quotes. Timestamps and
/// decimals need no escaping.
fn push_optional<T>(out: &mut String, value: Option<T>, push: impl FnOnce(&mut String, T)) {
    match value {
        Some(v) => {
            out.push('"');
            push(out, v);
            out.push('"');
        }
        None => out.push_str("null"),
    }
}

/// `s` as a JSON string, escaped exactly as `serde_json` escapes it (which
/// differs from the canonical form's escaping of a few characters): names
/// with nothing to escape, nearly all of them, are copied whole.
fn push_json_string(out: &mut String, s: &str) {
    if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(&serde_json::to_string(s).expect("a string always serialises"));
    } else {
        out.push('"');
        out.push_str(s);
        out.push('"');
    }
}

/// The rollups-topic record of an accepted event that became an adjustment
/// (keyed by its identity: one record per event, kept by compaction).
pub fn adjustment_record(a: &Adjustment, partition: i32, rollups_partitions: usize, now_ms: i64) -> OutRecord {
    let value = serde_json::json!({
        "type": "adjustment",
        "tenant_id": a.counter.tenant_id,
        "customer_id": a.counter.customer_id,
        "meter": a.counter.meter,
        "period": a.period.to_string(),
        "event_id": a.event_id,
        "kind": a.kind.as_str(),
        "amount": a.amount.normalize().to_string(),
        "timestamp": format_timestamp_ms(a.event_ms),
        "reason": a.reason.as_str(),
        "partition": partition,
    });
    let mut key = b"adjustment\0".to_vec();
    key.extend_from_slice(&crate::event::identity_key(&a.counter.tenant_id, &a.event_id));
    OutRecord {
        destination: Destination::Rollups,
        partition: side_partition(partition, rollups_partitions),
        key: Some(key),
        value: Some(value.to_string().into_bytes()),
        headers: Vec::new(),
        passthrough_headers: Vec::new(),
        timestamp_ms: now_ms,
    }
}

/// Names of the fields in which two events of the same id differ.
pub fn differing_fields(a: &UsageEvent, b: &UsageEvent) -> Vec<&'static str> {
    let mut d = Vec::new();
    let mut check = |name: &'static str, differs: bool| {
        if differs {
            d.push(name);
        }
    };
    check("customer_id", a.customer_id != b.customer_id);
    check("meter", a.meter != b.meter);
    check("quantity", a.quantity.normalize() != b.quantity.normalize());
    check("timestamp", a.timestamp_ms != b.timestamp_ms);
    check("kind", a.kind != b.kind);
    check("correction_ref", a.correction_ref != b.correction_ref);
    check("resource_id", a.resource_id != b.resource_id);
    check("unit", a.unit != b.unit);
    check("source", a.source != b.source);
    check("dimensions", a.dimensions != b.dimensions);
    d
}

fn position_json(p: Position) -> serde_json::Value {
    serde_json::json!({"partition": p.partition, "offset": p.offset})
}

/// The conflicts-topic record of a conflicting delivery. `original` is the
/// first accepted event when local state still holds it.
#[allow(clippy::too_many_arguments)]
pub fn conflict_record(
    e: &UsageEvent,
    id: IdHash,
    ph: PayloadHash,
    tier: Tier,
    first: &FirstSeen,
    original: Option<&UsageEvent>,
    source: Position,
    ingest_ms: i64,
    partitions: usize,
) -> OutRecord {
    let canonical = to_canonical_json(e);
    let event = RawValue::from_string(canonical).ok();
    let value = serde_json::json!({
        "tenant_id": e.tenant_id,
        "event_id": e.event_id,
        "id_hash": id.to_hex(),
        "tier": tier.as_str(),
        "first": {
            "payload_hash": first.payload_hash.to_hex(),
            "source": position_json(first.source),
            "output": first.output.map(position_json),
            "first_seen_ms": first.first_seen_ms,
        },
        "conflict": {
            "payload_hash": ph.to_hex(),
            "source": position_json(source),
            "ingest_ms": ingest_ms,
        },
        "differing_fields": original.map(|o| differing_fields(o, e)),
        "event": event,
    });
    let mut headers = Vec::with_capacity(5);
    position_headers(&mut headers, source, ingest_ms);
    headers.push((H_ID_HASH, id.to_hex().into_bytes()));
    headers.push((H_PAYLOAD_HASH, ph.to_hex().into_bytes()));
    OutRecord {
        destination: Destination::Conflicts,
        partition: side_partition(source.partition, partitions),
        key: Some(event_key(e)),
        value: Some(value.to_string().into_bytes()),
        headers,
        passthrough_headers: Vec::new(),
        timestamp_ms: ingest_ms,
    }
}

/// The rejected-topic record of an input record.
pub fn rejected_record(
    rejection: &Rejection,
    key: Option<&[u8]>,
    raw: Option<&[u8]>,
    source: Position,
    ingest_ms: i64,
    max_raw_bytes: usize,
    partitions: usize,
) -> OutRecord {
    let mut headers = Vec::with_capacity(8);
    headers.push((crate::kafka::records::H_REASON, rejection.reason.as_str().as_bytes().to_vec()));
    let mut detail = rejection.detail.as_str();
    if detail.len() > MAX_DETAIL_BYTES {
        let mut cut = MAX_DETAIL_BYTES;
        while !detail.is_char_boundary(cut) {
            cut -= 1;
        }
        detail = &detail[..cut];
    }
    headers.push((H_DETAIL, detail.as_bytes().to_vec()));
    position_headers(&mut headers, source, ingest_ms);
    let value = raw.map(|raw| {
        headers.push((H_RAW_BYTES, raw.len().to_string().into_bytes()));
        if raw.len() > max_raw_bytes {
            headers.push((H_RAW_TRUNCATED, b"true".to_vec()));
            headers.push((H_RAW_BLAKE3, blake3::hash(raw).to_hex().as_bytes().to_vec()));
            raw[..max_raw_bytes].to_vec()
        } else {
            headers.push((H_RAW_TRUNCATED, b"false".to_vec()));
            raw.to_vec()
        }
    });
    let key = key.map(|k| {
        if k.len() > MAX_SIDE_KEY_BYTES {
            headers.push((H_KEY_BYTES, k.len().to_string().into_bytes()));
            k[..MAX_SIDE_KEY_BYTES].to_vec()
        } else {
            k.to_vec()
        }
    });
    OutRecord {
        destination: Destination::Rejected,
        partition: side_partition(source.partition, partitions),
        key,
        value,
        headers,
        passthrough_headers: Vec::new(),
        timestamp_ms: ingest_ms,
    }
}

/// Side topics need not be co-partitioned; partition p goes to p mod n.
fn side_partition(p: i32, partitions: usize) -> i32 {
    let n = i32::try_from(partitions.max(1)).unwrap_or(i32::MAX);
    p.rem_euclid(n)
}

fn header<'a, H: Headers>(h: &'a H, name: &str) -> Option<&'a [u8]> {
    h.iter().find(|x| x.key == name).and_then(|x| x.value)
}

fn header_i64<H: Headers>(h: &H, name: &str) -> Result<i64, String> {
    let v = header(h, name).ok_or_else(|| format!("header {name} missing"))?;
    std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).ok_or_else(|| format!("header {name} is not a number"))
}

/// Reads one output record back into the event and key it stands for.
/// Checks the hashes in the headers against the event: a record that does
/// not hash to its own headers was not written by this dedupd.
pub fn parse_output<H: Headers>(
    validator: &Validator,
    position: Position,
    headers: Option<&H>,
    value: Option<&[u8]>,
) -> Result<StoredEvent, String> {
    let h = headers.ok_or("no headers")?;
    let value = value.ok_or("null value")?;
    let event = validator.read_output(value).map_err(|r| format!("value does not read back: {r}"))?;
    let id = id_hash(&event.tenant_id, &event.event_id);
    let ph = payload_hash(&event);
    let hex = |name| {
        header(h, name).and_then(|v| std::str::from_utf8(v).ok()).ok_or_else(|| format!("header {name} missing"))
    };
    if IdHash::from_hex(hex(H_ID_HASH)?) != Some(id) {
        return Err("id hash header does not match the event".into());
    }
    if PayloadHash::from_hex(hex(H_PAYLOAD_HASH)?) != Some(ph) {
        return Err("payload hash header does not match the event".into());
    }
    let source_partition = i32::try_from(header_i64(h, H_SOURCE_PARTITION)?).map_err(|e| e.to_string())?;
    let key = SeenKey {
        id_hash: id,
        payload_hash: ph,
        first_seen_ms: header_i64(h, H_INGEST_MS)?,
        source: Position::new(source_partition, header_i64(h, H_SOURCE_OFFSET)?),
        output: position,
    };
    Ok(StoredEvent { key, event })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Limits, RejectReason};

    /// Readers parse the rollups topic's JSON, but compaction, checks and
    /// any byte comparison downstream see its bytes: they are pinned, for a
    /// full rollup and an empty one (every optional field null), and so is
    /// the key.
    #[test]
    fn a_rollup_record_is_pinned_byte_for_byte() {
        use crate::ledger::{CounterKey, HourKey, Rollup};
        let counter = std::sync::Arc::new(CounterKey::new("acme".into(), "cus \"42\"".into(), "api_calls".into()));
        let key = HourKey { counter, hour_ms: 1_764_151_200_000 };
        let full = Rollup {
            sum: "12.50".parse().expect("sum"),
            count: 3,
            corrections: 1,
            max: Some("7.0".parse().expect("max")),
            last: Some((1_764_151_300_123, "2".parse().expect("last"))),
            latest_event_ms: 1_764_151_300_123,
        };
        assert_eq!(
            rollup_record(&key, &Rollup::default(), 3, 4, 0).key.expect("a key"),
            b"rollup\x00acme\x00cus \"42\"\x00api_calls\x001764151200000\x003",
            "the key compaction keeps the latest total of"
        );
        let value =
            |r: &Rollup| String::from_utf8(rollup_record(&key, r, 3, 4, 0).value.expect("a value")).expect("utf-8");
        assert_eq!(
            value(&full),
            r#"{"corrections":1,"count":3,"customer_id":"cus \"42\"","hour":"2025-11-26T10:00:00.000Z","last":"2","last_event_time":"2025-11-26T10:01:40.123Z","latest_event_time":"2025-11-26T10:01:40.123Z","max":"7","meter":"api_calls","partition":3,"sum":"12.5","tenant_id":"acme","type":"rollup"}"#
        );
        assert_eq!(
            value(&Rollup::default()),
            r#"{"corrections":0,"count":0,"customer_id":"cus \"42\"","hour":"2025-11-26T10:00:00.000Z","last":null,"last_event_time":null,"latest_event_time":null,"max":null,"meter":"api_calls","partition":3,"sum":"0","tenant_id":"acme","type":"rollup"}"#
        );
    }

    /// Names with characters JSON escapes (quotes, backslashes, control
    /// characters, the line separators `serde_json` leaves alone) come out
    /// as `serde_json` writes them, so the value stays valid JSON with the
    /// same bytes as before it was written by hand.
    #[test]
    fn a_rollup_record_escapes_names_as_serde_json_does() {
        use crate::ledger::{CounterKey, HourKey, Rollup};
        for name in ["plain", "q\"uote", "back\\slash", "tab\tnew\nline", "bell\u{7}", "sep\u{2028}ara\u{2029}", "é€😀"]
        {
            let counter = std::sync::Arc::new(CounterKey::new(name.into(), name.into(), name.into()));
            let key = HourKey { counter, hour_ms: 0 };
            let value = rollup_record(&key, &Rollup::default(), 0, 1, 0).value.expect("a value");
            let parsed: serde_json::Value = serde_json::from_slice(&value).expect("valid JSON");
            assert_eq!(parsed["customer_id"], name, "{name:?} reads back");
            let quoted = serde_json::to_string(name).expect("a string");
            let text = String::from_utf8(value).expect("utf-8");
            assert!(text.contains(&format!(r#""tenant_id":{quoted},"#)), "{name:?}: {text}");
        }
    }

    const NOW: i64 = 1_790_000_000_000;

    fn validator() -> Validator {
        Validator::new(Limits::default(), vec![], "salt")
    }

    fn event(qty: &str) -> UsageEvent {
        let raw = format!(
            r#"{{"event_id":"e1","tenant_id":"acme","customer_id":"c","meter":"m","quantity":"{qty}","timestamp":{NOW},"dimensions":{{"b":"2","a":"1"}}}}"#
        );
        validator().validate(raw.as_bytes(), NOW).expect("valid")
    }

    #[test]
    fn output_record_reads_back_to_the_same_key() {
        let e = event("1.50");
        let id = id_hash(&e.tenant_id, &e.event_id);
        let ph = payload_hash(&e);
        let r = accepted_record(&e, id, ph, Position::new(2, 41), NOW + 5);
        assert_eq!(r.key.as_deref(), Some(&b"acme\0e1"[..]));
        assert_eq!(r.timestamp_ms, NOW + 5);
        let back = parse_output(&validator(), Position::new(2, 7), Some(&r.owned_headers()), r.value.as_deref())
            .expect("reads back");
        assert_eq!(back.event, e);
        assert_eq!(
            back.key,
            SeenKey {
                id_hash: id,
                payload_hash: ph,
                first_seen_ms: NOW + 5,
                source: Position::new(2, 41),
                output: Position::new(2, 7)
            }
        );
    }

    #[test]
    fn output_record_with_a_tampered_hash_is_refused() {
        let e = event("1");
        let r = accepted_record(&e, id_hash("x", "y"), payload_hash(&e), Position::new(0, 1), NOW);
        let err = parse_output(&validator(), Position::new(0, 0), Some(&r.owned_headers()), r.value.as_deref());
        assert!(matches!(err, Err(m) if m.contains("id hash")));
    }

    #[test]
    fn conflict_record_names_the_fields_that_differ() {
        let a = event("1");
        let b = event("2");
        let id = id_hash(&a.tenant_id, &a.event_id);
        let first = FirstSeen {
            payload_hash: payload_hash(&a),
            first_seen_ms: NOW,
            source: Position::new(0, 1),
            output: Some(Position::new(0, 0)),
            batch_index: None,
        };
        let r =
            conflict_record(&b, id, payload_hash(&b), Tier::HotCache, &first, Some(&a), Position::new(0, 9), NOW, 1);
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().expect("value")).expect("json");
        assert_eq!(v["differing_fields"], serde_json::json!(["quantity"]));
        assert_eq!(v["first"]["payload_hash"], payload_hash(&a).to_hex());
        assert_eq!(v["conflict"]["payload_hash"], payload_hash(&b).to_hex());
        assert_eq!(v["event"]["quantity"], "2");
    }

    #[test]
    fn huge_rejected_raw_is_truncated_with_its_length_and_hash() {
        let raw = vec![0xffu8; 1 << 20];
        let rej = Rejection::new(RejectReason::RecordTooLarge, "x".repeat(5000));
        let r = rejected_record(&rej, None, Some(&raw), Position::new(3, 3), NOW, 1000, 2);
        assert_eq!(r.value.as_ref().map(Vec::len), Some(1000));
        assert_eq!(r.partition, 1);
        let get = |k| r.headers.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(H_RAW_BYTES), Some(b"1048576".to_vec()));
        assert_eq!(get(H_RAW_TRUNCATED), Some(b"true".to_vec()));
        assert_eq!(get(H_DETAIL).map(|d| d.len()), Some(MAX_DETAIL_BYTES));
        assert_eq!(get(H_REASON), Some(b"record_too_large".to_vec()));
        assert_eq!(get(H_KEY_BYTES), None);
    }

    #[test]
    fn a_huge_input_key_is_truncated_in_the_rejected_record_with_its_length() {
        let key = vec![b'k'; 3 * MAX_SIDE_KEY_BYTES];
        let rej = Rejection::new(RejectReason::MalformedJson, "x");
        let r = rejected_record(&rej, Some(&key), Some(b"{"), Position::new(0, 1), NOW, 1000, 1);
        assert_eq!(r.key.as_ref().map(Vec::len), Some(MAX_SIDE_KEY_BYTES));
        let got = r.headers.iter().find(|(n, _)| *n == H_KEY_BYTES).map(|(_, v)| v.clone());
        assert_eq!(got, Some(b"3072".to_vec()));
    }
}
