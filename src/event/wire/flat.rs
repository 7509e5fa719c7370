//! The common record read without serde: one flat object whose values are
//! strings without escapes, numbers, booleans or null.
//!
//! Nearly every usage event has that shape, and serde's generic walk (a
//! visitor per key, a raw value per field, the string scanned twice) was
//! most of the offline path's decoding. This reader takes the shape and
//! nothing else: at an escape, a nested value, a control character in a
//! string, a duplicate schema field, a number where an object belongs
//! (serde reads it as an `f64` and may refuse it) or anything outside
//! JSON's grammar it gives up (`None`) and the full parser decides, with its own error
//! message. So it never accepts a record the full parser refuses, and what
//! it accepts it reads the same (the differential property test in
//! `wire.rs` holds it to that).

use std::borrow::Cow;

use super::{Field, Scalar, WireEvent, WireField};

/// A value of the flat shape.
#[derive(Clone, Copy)]
enum Value<'a> {
    /// A string's content (no escapes, so the bytes between the quotes).
    Str(&'a str),
    /// A number's text, as sent.
    Number(&'a str),
    Bool(bool),
    Null,
}

impl Value<'_> {
    fn type_name(&self) -> &'static str {
        match self {
            Value::Str(_) => "string",
            Value::Number(_) => "number",
            Value::Bool(_) => "boolean",
            Value::Null => "null",
        }
    }
}

/// The bytes that end a string's plain content: its closing quote, an
/// escape, a control character (which JSON refuses inside strings).
const STRING_STOPS: [bool; 256] = crate::event::json_string_stops(&[]);

struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    /// JSON's whitespace: space, tab, line feed, carriage return.
    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.at += 1)
    }

    /// A string without escapes or control characters; its content. The
    /// text is valid UTF-8 and the quotes are ASCII, so the slice is on
    /// character boundaries.
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.at;
        // Strings are short (ids, names), where a SIMD search's setup costs
        // more than it saves (measured); a word at a time does not.
        let end = start + crate::event::plain_run_len(&self.text.as_bytes()[start..], &STRING_STOPS);
        (self.text.as_bytes().get(end) == Some(&b'"')).then_some(())?;
        self.at = end + 1;
        Some(&self.text[start..end])
    }

    fn digits(&mut self) -> usize {
        let start = self.at;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
        self.at - start
    }

    /// JSON's number grammar exactly: `-? (0 | [1-9][0-9]*) (. [0-9]+)?
    /// ([eE] [+-]? [0-9]+)?`; its text as sent.
    fn number(&mut self) -> Option<&'a str> {
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            (self.digits() > 0).then_some(())?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            (self.digits() > 0).then_some(())?;
        }
        Some(&self.text[start..self.at])
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> Option<Value<'a>> {
        self.text.as_bytes()[self.at..].starts_with(word.as_bytes()).then(|| {
            self.at += word.len();
            value
        })
    }

    fn value(&mut self) -> Option<Value<'a>> {
        match self.peek()? {
            b'"' => self.string().map(Value::Str),
            b'-' | b'0'..=b'9' => self.number().map(Value::Number),
            b't' => self.literal("true", Value::Bool(true)),
            b'f' => self.literal("false", Value::Bool(false)),
            b'n' => self.literal("null", Value::Null),
            // Objects, arrays, anything else: the full parser's.
            _ => None,
        }
    }
}

/// The record `text` (valid UTF-8) if it has the flat shape; `None` when
/// the full parser must read it.
pub(super) fn decode(text: &str, accept_server_stamps: bool) -> Option<WireEvent<'_>> {
    let mut c = Cursor { text, at: 0 };
    let mut ev = WireEvent::default();
    c.skip_ws();
    c.eat(b'{')?;
    c.skip_ws();
    if c.eat(b'}').is_none() {
        loop {
            let key = c.string()?;
            c.skip_ws();
            c.eat(b':')?;
            c.skip_ws();
            let value = c.value()?;
            set(&mut ev, key, value, accept_server_stamps)?;
            c.skip_ws();
            match c.peek()? {
                b',' => {
                    c.at += 1;
                    c.skip_ws();
                }
                b'}' => {
                    c.at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    c.skip_ws();
    (c.at == text.len()).then_some(ev)
}

/// Fills the slot `key` names, as the full parser's visitor does; `None`
/// for a schema field given twice (the full parser words that error).
fn set<'a>(ev: &mut WireEvent<'a>, key: &'a str, value: Value<'a>, accept_server_stamps: bool) -> Option<()> {
    let text = |slot: &mut WireField<Cow<'a, str>>| {
        fill(
            slot,
            match value {
                Value::Str(s) => WireField::Value(Cow::Borrowed(s)),
                Value::Null => WireField::Null,
                other => WireField::WrongType(other.type_name()),
            },
        )
    };
    let scalar = |slot: &mut WireField<Scalar<'a>>| {
        fill(
            slot,
            match value {
                Value::Str(s) => WireField::Value(Scalar::Str(Cow::Borrowed(s))),
                Value::Number(n) => WireField::Value(Scalar::Number(n)),
                Value::Null => WireField::Null,
                other => WireField::WrongType(other.type_name()),
            },
        )
    };
    match super::field_named(key) {
        Some(Field::EventId) => text(&mut ev.event_id),
        Some(Field::TenantId) => text(&mut ev.tenant_id),
        Some(Field::CustomerId) => text(&mut ev.customer_id),
        Some(Field::Meter) => text(&mut ev.meter),
        Some(Field::Kind) => text(&mut ev.kind),
        Some(Field::ResourceId) => text(&mut ev.resource_id),
        Some(Field::Unit) => text(&mut ev.unit),
        Some(Field::Source) => text(&mut ev.source),
        Some(Field::Quantity) => scalar(&mut ev.quantity),
        Some(Field::Timestamp) => scalar(&mut ev.timestamp),
        Some(Field::CorrectionRef) => fill(&mut ev.correction_ref, not_an_object(value)?),
        Some(Field::Dimensions) => fill(&mut ev.dimensions, not_an_object(value)?),
        Some(Field::EventIdDerived) if accept_server_stamps => fill(
            &mut ev.event_id_derived,
            match value {
                Value::Bool(b) => WireField::Value(b),
                Value::Null => WireField::Null,
                other => WireField::WrongType(other.type_name()),
            },
        ),
        _ => {
            if ev.unknown_field.is_none() {
                ev.unknown_field = Some(key.to_owned());
            }
            Some(())
        }
    }
}

/// `correction_ref` and `dimensions` are objects: here, only a value of
/// another type (an object went to the full parser). Not a number: serde
/// reads a number there as an `f64` and refuses one out of its range
/// (`1e400`), where a field read as text takes any number; the full parser
/// words that.
fn not_an_object<T>(value: Value<'_>) -> Option<WireField<T>> {
    match value {
        Value::Null => Some(WireField::Null),
        Value::Number(_) => None,
        other => Some(WireField::WrongType(other.type_name())),
    }
}

fn fill<T>(slot: &mut WireField<T>, value: WireField<T>) -> Option<()> {
    matches!(slot, WireField::Absent).then(|| *slot = value)
}
