//! Wire decoding: JSON bytes to a loosely typed [`WireEvent`].
//!
//! Decoding is deliberately separate from validation: this layer only knows
//! JSON and the field names of schema v1, and records per field whether it was
//! absent, null, a string, or something else. Validation then applies the
//! rules in a fixed order so every record gets exactly one reason.
//!
//! Duplicate keys are malformed: with two `quantity` keys, which one a
//! downstream JSON reader keeps is implementation-defined, so the record has no
//! single meaning.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

mod flat;

/// A field as it appeared on the wire.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum WireField<T> {
    #[default]
    Absent,
    Null,
    Value(T),
    /// Present with the wrong JSON type; holds the type's name.
    WrongType(&'static str),
}

impl<T> WireField<T> {
    pub fn is_absent_or_null(&self) -> bool {
        matches!(self, WireField::Absent | WireField::Null)
    }
}

/// A JSON string's decoded content, borrowed from the record when it has
/// no escapes (nearly always), so decoding allocates nothing for it: the
/// validated event makes the one owned copy it keeps.
pub type Text<'a> = Cow<'a, str>;

/// Raw text of a JSON scalar whose spelling matters (numbers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scalar<'a> {
    /// A JSON string's decoded content.
    Str(Text<'a>),
    /// A JSON number's literal text, exactly as sent.
    Number(&'a str),
}

/// The `correction_ref` object as sent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WireCorrectionRef<'a> {
    pub original_event_id: WireField<Text<'a>>,
    pub reason: WireField<Text<'a>>,
    pub unknown_field: Option<String>,
}

/// A top-level event as sent: schema v1 field names, values not yet
/// checked, strings borrowed from the record's bytes where they can be.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WireEvent<'a> {
    pub event_id: WireField<Text<'a>>,
    pub tenant_id: WireField<Text<'a>>,
    pub customer_id: WireField<Text<'a>>,
    pub meter: WireField<Text<'a>>,
    pub quantity: WireField<Scalar<'a>>,
    pub timestamp: WireField<Scalar<'a>>,
    pub kind: WireField<Text<'a>>,
    pub correction_ref: WireField<WireCorrectionRef<'a>>,
    pub resource_id: WireField<Text<'a>>,
    pub unit: WireField<Text<'a>>,
    pub source: WireField<Text<'a>>,
    /// In wire order; duplicates are a decode error.
    pub dimensions: WireField<Vec<(Text<'a>, WireField<Text<'a>>)>>,
    /// Server-side stamp accepted only when decoding dedupd's own output.
    pub event_id_derived: WireField<bool>,
    /// The first field name that is not part of the schema.
    pub unknown_field: Option<String>,
}

/// Why the bytes are not a JSON object of the right shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MalformedJson(pub String);

/// Decodes one record. `accept_server_stamps` admits the fields dedupd itself
/// adds to its output (`event_id_derived`), for reading the output back.
pub fn decode(bytes: &[u8], accept_server_stamps: bool) -> Result<WireEvent<'_>, MalformedJson> {
    // serde_json checks UTF-8 only in the strings it decodes, not in values
    // it skips (an unknown field's): check the whole record first, so no
    // invalid byte is ever passed through to a side topic as "JSON".
    let text = std::str::from_utf8(bytes)
        .map_err(|e| MalformedJson(format!("not valid UTF-8: invalid byte at offset {}", e.valid_up_to())))?;
    // A flat record nests one level, so only what the flat reader leaves
    // needs the depth check.
    match flat::decode(text, accept_server_stamps) {
        Some(ev) => Ok(ev),
        None => {
            check_depth(bytes)?;
            decode_full(text, accept_server_stamps)
        }
    }
}

/// Any record, through serde_json: what the flat reader leaves, and every
/// error message.
fn decode_full(text: &str, accept_server_stamps: bool) -> Result<WireEvent<'_>, MalformedJson> {
    let mut de = serde_json::Deserializer::from_str(text);
    let ev = de.deserialize_map(EventVisitor { accept_server_stamps }).map_err(|e| MalformedJson(describe(&e)))?;
    de.end().map_err(|e| MalformedJson(describe(&e)))?;
    Ok(ev)
}

/// Deepest nesting accepted. An event needs 2 (`correction_ref`,
/// `dimensions`); the margin admits unknown fields so they are reported as
/// `unknown_field` rather than as a depth error.
pub const MAX_DEPTH: usize = 32;

/// Refuses nesting deeper than [`MAX_DEPTH`] before parsing. serde_json
/// limits the depth of what it decodes, but skips an unknown field's value
/// without that limit; a scan first keeps the stack bounded for any input.
fn check_depth(bytes: &[u8]) -> Result<(), MalformedJson> {
    // Nesting cannot go deeper than the number of opening brackets (those
    // inside strings included): counting them is branch-free and settles
    // nearly every record without the walk below.
    if bytes.iter().filter(|&&b| b == b'{' || b == b'[').count() <= MAX_DEPTH {
        return Ok(());
    }
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(MalformedJson(format!("nested deeper than {MAX_DEPTH} levels")));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

fn describe(e: &serde_json::Error) -> String {
    e.to_string()
}

struct EventVisitor {
    accept_server_stamps: bool,
}

fn json_type_name(raw: &RawValue) -> &'static str {
    match raw.get().as_bytes().first() {
        Some(b'{') => "object",
        Some(b'[') => "array",
        Some(b'"') => "string",
        Some(b't') | Some(b'f') => "boolean",
        Some(b'n') => "null",
        _ => "number",
    }
}

fn set_once<T, E: de::Error>(slot: &mut WireField<T>, name: &str, value: WireField<T>) -> Result<(), E> {
    if !matches!(slot, WireField::Absent) {
        return Err(E::custom(format_args!("duplicate field `{name}`")));
    }
    *slot = value;
    Ok(())
}

/// The content of a JSON string literal `text` (quotes included, already
/// checked by the parser: no raw control character, escapes well formed;
/// `decode` parses from a `&str`, so the text is also valid UTF-8).
/// Without a backslash the content is the bytes between the quotes,
/// borrowed; only a string with escapes is decoded again, into a copy.
fn string_content(text: &str) -> Result<Text<'_>, serde_json::Error> {
    match text.get(1..text.len().saturating_sub(1)) {
        Some(inner) if text.len() >= 2 && !inner.as_bytes().contains(&b'\\') => Ok(Cow::Borrowed(inner)),
        _ => serde_json::from_str::<String>(text).map(Cow::Owned),
    }
}

/// Reads a value that should be a string.
fn string_field<'de, A: MapAccess<'de>>(map: &mut A) -> Result<WireField<Text<'de>>, A::Error> {
    let raw: &'de RawValue = map.next_value()?;
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'"') => string_content(text).map(WireField::Value).map_err(de::Error::custom),
        Some(b'n') => Ok(WireField::Null),
        _ => Ok(WireField::WrongType(json_type_name(raw))),
    }
}

/// Reads a value that should be a string or a number, keeping the number's text.
fn scalar_field<'de, A: MapAccess<'de>>(map: &mut A) -> Result<WireField<Scalar<'de>>, A::Error> {
    let raw: &'de RawValue = map.next_value()?;
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'"') => string_content(text).map(|s| WireField::Value(Scalar::Str(s))).map_err(de::Error::custom),
        Some(b'n') => Ok(WireField::Null),
        Some(c) if *c == b'-' || c.is_ascii_digit() => Ok(WireField::Value(Scalar::Number(text))),
        _ => Ok(WireField::WrongType(json_type_name(raw))),
    }
}

impl<'de> Visitor<'de> for EventVisitor {
    type Value = WireEvent<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object (a usage event)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireEvent<'de>, A::Error> {
        let mut ev = WireEvent::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Schema(Field::EventId) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.event_id, "event_id", v)?
                }
                Key::Schema(Field::TenantId) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.tenant_id, "tenant_id", v)?
                }
                Key::Schema(Field::CustomerId) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.customer_id, "customer_id", v)?
                }
                Key::Schema(Field::Meter) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.meter, "meter", v)?
                }
                Key::Schema(Field::Quantity) => {
                    let v = scalar_field(&mut map)?;
                    set_once(&mut ev.quantity, "quantity", v)?
                }
                Key::Schema(Field::Timestamp) => {
                    let v = scalar_field(&mut map)?;
                    set_once(&mut ev.timestamp, "timestamp", v)?
                }
                Key::Schema(Field::Kind) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.kind, "kind", v)?
                }
                Key::Schema(Field::ResourceId) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.resource_id, "resource_id", v)?
                }
                Key::Schema(Field::Unit) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.unit, "unit", v)?
                }
                Key::Schema(Field::Source) => {
                    let v = string_field(&mut map)?;
                    set_once(&mut ev.source, "source", v)?
                }
                Key::Schema(Field::CorrectionRef) => {
                    let v = map.next_value::<Nullable<WireCorrectionRef<'de>>>()?.0;
                    set_once(&mut ev.correction_ref, "correction_ref", v)?
                }
                Key::Schema(Field::Dimensions) => {
                    let v = map.next_value::<Nullable<Dimensions<'de>>>()?.0;
                    let v = match v {
                        WireField::Value(d) => WireField::Value(d.0),
                        WireField::Absent => WireField::Absent,
                        WireField::Null => WireField::Null,
                        WireField::WrongType(t) => WireField::WrongType(t),
                    };
                    set_once(&mut ev.dimensions, "dimensions", v)?
                }
                Key::Schema(Field::EventIdDerived) if self.accept_server_stamps => {
                    let raw: &RawValue = map.next_value()?;
                    let v = match raw.get() {
                        "true" => WireField::Value(true),
                        "false" => WireField::Value(false),
                        "null" => WireField::Null,
                        _ => WireField::WrongType(json_type_name(raw)),
                    };
                    set_once(&mut ev.event_id_derived, "event_id_derived", v)?
                }
                other => {
                    map.next_value::<IgnoredAny>()?;
                    if ev.unknown_field.is_none() {
                        ev.unknown_field = Some(match other {
                            Key::Unknown(name) => name,
                            // A server stamp on a record from outside.
                            Key::Schema(_) => "event_id_derived".to_owned(),
                        });
                    }
                }
            }
        }
        Ok(ev)
    }
}

/// A field of schema v1's top level (and the server stamp `event_id_derived`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    EventId,
    TenantId,
    CustomerId,
    Meter,
    Quantity,
    Timestamp,
    Kind,
    ResourceId,
    Unit,
    Source,
    CorrectionRef,
    Dimensions,
    EventIdDerived,
}

/// A key of the event object. A schema field is matched where the parser
/// holds the name, so a record's keys cost no allocation (serde's
/// `Cow<str>` never borrows: it had allocated a `String` per key, 5% of the
/// offline path); only a name outside the schema is kept, for the reason.
#[derive(Debug, PartialEq, Eq)]
enum Key {
    Schema(Field),
    Unknown(String),
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        d.deserialize_identifier(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    /// Escaped names arrive here decoded, so `"event\u005fid"` is `event_id`
    /// as before.
    fn visit_str<E: de::Error>(self, name: &str) -> Result<Key, E> {
        Ok(field_named(name).map_or_else(|| Key::Unknown(name.to_owned()), Key::Schema))
    }
}

/// The field `name` (decoded) names, if any.
fn field_named(name: &str) -> Option<Field> {
    Some(match name {
        "event_id" => Field::EventId,
        "tenant_id" => Field::TenantId,
        "customer_id" => Field::CustomerId,
        "meter" => Field::Meter,
        "quantity" => Field::Quantity,
        "timestamp" => Field::Timestamp,
        "kind" => Field::Kind,
        "resource_id" => Field::ResourceId,
        "unit" => Field::Unit,
        "source" => Field::Source,
        "correction_ref" => Field::CorrectionRef,
        "dimensions" => Field::Dimensions,
        "event_id_derived" => Field::EventIdDerived,
        _ => return None,
    })
}

/// A value that may be an object of the expected shape, null, or another type.
struct Nullable<T>(WireField<T>);

impl<'de> Deserialize<'de> for Nullable<WireCorrectionRef<'de>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ObjectOrOther(CorrectionRefVisitor))
    }
}

/// Dimensions in wire order.
struct Dimensions<'a>(Vec<(Text<'a>, WireField<Text<'a>>)>);

impl<'de> Deserialize<'de> for Nullable<Dimensions<'de>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ObjectOrOther(DimensionsVisitor))
    }
}

/// Visits any JSON value: objects go to the inner visitor, null is `Null`,
/// everything else is consumed and reported as `WrongType`.
struct ObjectOrOther<V>(V);

impl<'de, V, T> Visitor<'de> for ObjectOrOther<V>
where
    V: Visitor<'de, Value = T>,
{
    type Value = Nullable<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or null")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.0.visit_map(map).map(|v| Nullable(WireField::Value(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::Null))
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::Null))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::WrongType("boolean")))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::WrongType("number")))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::WrongType("number")))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::WrongType("number")))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Nullable(WireField::WrongType("string")))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Nullable(WireField::WrongType("array")))
    }
}

struct CorrectionRefVisitor;

impl<'de> Visitor<'de> for CorrectionRefVisitor {
    type Value = WireCorrectionRef<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a correction_ref object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireCorrectionRef<'de>, A::Error> {
        let mut r = WireCorrectionRef::default();
        while let Some(BorrowedKey(key)) = map.next_key()? {
            match key.as_ref() {
                "original_event_id" => {
                    let v = string_field(&mut map)?;
                    set_once(&mut r.original_event_id, "correction_ref.original_event_id", v)?
                }
                "reason" => {
                    let v = string_field(&mut map)?;
                    set_once(&mut r.reason, "correction_ref.reason", v)?
                }
                other => {
                    map.next_value::<IgnoredAny>()?;
                    if r.unknown_field.is_none() {
                        r.unknown_field = Some(format!("correction_ref.{other}"));
                    }
                }
            }
        }
        Ok(r)
    }
}

/// An object key borrowed from the record when it has no escapes (serde's
/// `Cow<str>` would always copy it).
struct BorrowedKey<'a>(Text<'a>);

impl<'de> Deserialize<'de> for BorrowedKey<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(BorrowedKeyVisitor)
    }
}

struct BorrowedKeyVisitor;

impl<'de> Visitor<'de> for BorrowedKeyVisitor {
    type Value = BorrowedKey<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Self::Value, E> {
        Ok(BorrowedKey(Cow::Borrowed(key)))
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok(BorrowedKey(Cow::Owned(key.to_owned())))
    }
}

struct DimensionsVisitor;

impl<'de> Visitor<'de> for DimensionsVisitor {
    type Value = Dimensions<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a dimensions object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Dimensions<'de>, A::Error> {
        let mut dims: Vec<(Text<'de>, WireField<Text<'de>>)> = Vec::new();
        while let Some(BorrowedKey(key)) = map.next_key()? {
            if dims.iter().any(|(k, _)| *k == key) {
                return Err(de::Error::custom(format_args!("duplicate dimension `{key}`")));
            }
            let v = string_field(&mut map)?;
            dims.push((key, v));
        }
        Ok(Dimensions(dims))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `event_id` of an event whose id is the JSON literal `id_literal`,
    /// and whether decoding borrowed it from the record.
    fn decoded_id(id_literal: &str) -> Result<(Option<String>, bool), MalformedJson> {
        let json = format!(
            r#"{{"event_id":{id_literal},"tenant_id":"t","customer_id":"c","meter":"m","quantity":"1","timestamp":1}}"#
        );
        decode(json.as_bytes(), false).map(|e| match e.event_id {
            WireField::Value(id) => (Some(id.to_string()), matches!(id, Cow::Borrowed(_))),
            _ => (None, false),
        })
    }

    /// Strings without a backslash are borrowed from between their quotes;
    /// strings with escapes are decoded into a copy; what the parser
    /// refuses stays refused either way.
    #[test]
    fn strings_read_the_same_with_or_without_escapes() {
        let id = decoded_id;
        assert_eq!(id(r#""plain-id é""#), Ok((Some("plain-id é".to_owned()), true)));
        assert_eq!(id(r#""a\"b\\c\n\u00e9""#), Ok((Some("a\"b\\c\né".to_owned()), false)));
        assert_eq!(id(r#""""#), Ok((Some(String::new()), true)));
        assert!(id("\"raw\u{1}control\"").is_err(), "a raw control character is not JSON");
        assert!(id(r#""bad \q escape""#).is_err());
        assert!(id(r#""unpaired \ud800""#).is_err());
    }

    /// Brackets inside strings do not count as nesting; real nesting past
    /// the limit is refused, however the count of brackets comes out.
    #[test]
    fn depth_is_nesting_not_the_number_of_brackets() {
        let many = format!(r#""{}""#, "{[".repeat(40));
        assert!(decoded_id(&many).is_ok());
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(
            decode(deep.as_bytes(), false),
            Err(MalformedJson(format!("nested deeper than {MAX_DEPTH} levels")))
        );
        let wide = format!(r#"{{"x":[{}]}}"#, vec!["[]"; 40].join(","));
        assert!(decode(wide.as_bytes(), false).is_ok(), "forty siblings are two levels deep");
    }

    #[test]
    fn reads_every_field() {
        let ev = decode(
            br#"{"event_id":"e","tenant_id":"t","customer_id":"c","meter":"m","quantity":1.50,
                 "timestamp":"2026-11-21T10:00:00Z","kind":"correction",
                 "correction_ref":{"original_event_id":"o","reason":"r"},
                 "resource_id":"res","unit":"u","source":"s","dimensions":{"b":"2","a":"1"}}"#,
            false,
        )
        .expect("decodes");
        assert_eq!(ev.quantity, WireField::Value(Scalar::Number("1.50")));
        assert_eq!(ev.timestamp, WireField::Value(Scalar::Str("2026-11-21T10:00:00Z".into())));
        assert!(
            matches!(ev.correction_ref, WireField::Value(ref c) if c.original_event_id == WireField::Value("o".into()))
        );
        assert!(matches!(ev.dimensions, WireField::Value(ref d) if d.len() == 2 && d[0].0 == "b"));
        assert_eq!(ev.unknown_field, None);
    }

    #[test]
    fn unknown_and_wrong_types_are_recorded_not_fatal() {
        let ev = decode(br#"{"tenant_id":5,"zzz":{"deep":[1,2]},"meter":null}"#, false).expect("decodes");
        assert_eq!(ev.tenant_id, WireField::WrongType("number"));
        assert_eq!(ev.meter, WireField::Null);
        assert_eq!(ev.unknown_field.as_deref(), Some("zzz"));
    }

    /// Keys are matched after their escapes are decoded, as a JSON reader
    /// downstream reads them: an escaped schema name is that field (and
    /// counts as a duplicate of its plain spelling), an escaped unknown
    /// name is reported decoded.
    #[test]
    fn escaped_keys_are_the_fields_they_spell() {
        let ev = decode(br#"{"event\u005fid":"e","t\u0065nant_id":"t","z\u007az":1}"#, false).expect("decodes");
        assert_eq!(ev.event_id, WireField::Value("e".into()));
        assert_eq!(ev.tenant_id, WireField::Value("t".into()));
        assert_eq!(ev.unknown_field.as_deref(), Some("zzz"));
        let twice = decode(br#"{"meter":"a","m\u0065ter":"b"}"#, false);
        assert!(matches!(twice, Err(MalformedJson(m)) if m.contains("duplicate field `meter`")));
        let stamp = br#"{"event_id_d\u0065rived":false}"#;
        assert_eq!(decode(stamp, false).expect("decodes").unknown_field.as_deref(), Some("event_id_derived"));
        assert_eq!(decode(stamp, true).expect("decodes").event_id_derived, WireField::Value(false));
    }

    #[test]
    fn duplicate_keys_are_malformed() {
        assert!(decode(br#"{"quantity":1,"quantity":2}"#, false).is_err());
        assert!(decode(br#"{"dimensions":{"a":"1","a":"2"}}"#, false).is_err());
    }

    #[test]
    fn non_objects_and_trailing_bytes_are_malformed() {
        for bad in [&b"[]"[..], b"1", b"\"x\"", b"null", b"{} {}", b"{", b"", b"\xff\xfe", b"{\"a\":\"\xff\"}"] {
            assert!(decode(bad, false).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn nesting_is_bounded_even_inside_unknown_fields() {
        let deep = format!("{{\"zzz\":{}1{}}}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        assert!(matches!(decode(deep.as_bytes(), false), Err(MalformedJson(m)) if m.contains("nested")));
        let ok = format!("{{\"zzz\":{}1{}}}", "[".repeat(MAX_DEPTH - 1), "]".repeat(MAX_DEPTH - 1));
        assert_eq!(decode(ok.as_bytes(), false).map(|e| e.unknown_field), Ok(Some("zzz".to_owned())));
        // Brackets inside strings do not count.
        let quoted = format!("{{\"zzz\":\"{}\\\"\"}}", "[".repeat(100));
        assert!(decode(quoted.as_bytes(), false).is_ok());
    }

    #[test]
    fn server_stamps_only_when_asked() {
        let line = br#"{"event_id_derived":true}"#;
        assert_eq!(decode(line, false).expect("decodes").unknown_field.as_deref(), Some("event_id_derived"));
        assert_eq!(decode(line, true).expect("decodes").event_id_derived, WireField::Value(true));
    }

    /// The usual record takes the flat reader; one it cannot read exactly
    /// goes to serde.
    #[test]
    fn the_usual_record_is_read_flat() {
        let usual = br#"{"event_id":"e-1","tenant_id":"acme","customer_id":"c","meter":"api_calls","quantity":"3","timestamp":1700000000000,"kind":"usage"}"#;
        let text = std::str::from_utf8(usual).expect("utf-8");
        assert!(flat::decode(text, false).is_some());
        assert_eq!(flat::decode(text, false).map(Ok), Some(decode_full(text, false)));
        for other in [
            r#"{"event_id":"e\u002d1"}"#,
            r#"{"dimensions":{"region":"eu"}}"#,
            r#"{"quantity":01}"#,
            r#"{"meter":"a","meter":"b"}"#,
        ] {
            assert!(flat::decode(other, false).is_none(), "{other}");
        }
    }

    /// Each list starts with what the flat reader takes (the first
    /// `*_FLAT` entries), then what it must leave to serde.
    const KEYS: &[&str] = &[
        "\"event_id\"",
        "\"tenant_id\"",
        "\"customer_id\"",
        "\"meter\"",
        "\"quantity\"",
        "\"timestamp\"",
        "\"kind\"",
        "\"resource_id\"",
        "\"unit\"",
        "\"source\"",
        "\"correction_ref\"",
        "\"dimensions\"",
        "\"event_id_derived\"",
        "\"zzz\"",
        "\"\"",
        "\"é\"",
        "\"m\\u0065ter\"",
        "\"tab\there\"",
        "meter",
    ];
    const KEYS_FLAT: usize = 16;

    const VALUES: &[&str] = &[
        "\"abc\"",
        "\"\"",
        "\"é ü\"",
        "\"del\u{7f}\"",
        "0",
        "-0",
        "12",
        "1.5",
        "1e5",
        "1E+5",
        "-1.5e-3",
        "1e400",
        "-1e400",
        "true",
        "false",
        "null",
        "\"a\\\"b\"",
        "\"tab\there\"",
        "\"open",
        "01",
        "00",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "1e-",
        "1.5x",
        "nul",
        "truex",
        "True",
        "{}",
        "{\"original_event_id\":\"o\"}",
        "{\"a\":\"1\"}",
        "[]",
        "[1]",
    ];
    const VALUES_FLAT: usize = 16;

    const SPACES: &[&str] = &["", " ", "\n", "\t", "\r", "  \r\n", "\u{a0}", "\u{b}"];
    const SPACES_FLAT: usize = 6;
    const SEPARATORS: &[&str] = &[",", ",,", "", ";"];
    const SEPARATORS_FLAT: usize = 1;
    const ENDS: &[&str] = &["}", "} ", "}\n", "}x", "}}", ",}", ""];
    const ENDS_FLAT: usize = 3;

    /// An index into a list whose first `flat` entries the flat reader
    /// takes: one of those nine times in ten, any entry otherwise.
    fn pick(len: usize, flat: usize) -> impl proptest::strategy::Strategy<Value = usize> {
        proptest::strategy::Strategy::prop_map((proptest::bool::weighted(0.9), 0..len), move |(usual, i)| {
            if usual {
                i % flat
            } else {
                i
            }
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]
        /// The flat reader against serde on records built from JSON's
        /// corners (escapes, control characters, numbers inside and outside
        /// the grammar, literals, nesting, odd whitespace and separators,
        /// duplicates): whenever it reads a record, serde reads the very
        /// same event; whatever serde refuses, it leaves to serde.
        #[test]
        fn the_flat_reader_reads_what_serde_reads(
            entries in proptest::collection::vec(
                (pick(KEYS.len(), KEYS_FLAT), pick(VALUES.len(), VALUES_FLAT),
                 pick(SPACES.len(), SPACES_FLAT), pick(SEPARATORS.len(), SEPARATORS_FLAT)), 0..6),
            lead in pick(SPACES.len(), SPACES_FLAT),
            end in pick(ENDS.len(), ENDS_FLAT),
            accept in proptest::bool::ANY,
        ) {
            let mut text = format!("{}{{", SPACES[lead]);
            for (i, (k, v, ws, sep)) in entries.iter().enumerate() {
                if i > 0 {
                    text.push_str(SEPARATORS[*sep]);
                }
                text.push_str(SPACES[*ws]);
                text.push_str(KEYS[*k]);
                text.push_str(SPACES[*ws]);
                text.push(':');
                text.push_str(VALUES[*v]);
                text.push_str(SPACES[*ws]);
            }
            text.push_str(ENDS[end]);
            if let Some(fast) = flat::decode(&text, accept) {
                proptest::prop_assert_eq!(Ok(fast), decode_full(&text, accept), "{}", text);
            }
        }
    }
}
