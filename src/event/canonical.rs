//! The canonical JSON form of an accepted event: what dedupd publishes.
//!
//! One line, fields in schema order, quantity as a normalised decimal string,
//! timestamp as RFC 3339 UTC with milliseconds, dimensions sorted by key,
//! optional fields omitted when absent. The same event always renders to the
//! same bytes, so re-running an input produces byte-identical output, and the
//! form reads back through [`crate::event::Validator::read_output`] to the same
//! payload hash.

use std::fmt::Write as _;

use super::model::UsageEvent;

/// Appends `s` as a JSON string literal.
pub fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    // Almost every id, meter and dimension needs no escape: copy those
    // whole. 0xE2 leads both line separators' UTF-8 encodings (and other
    // characters, which `push_escaped` copies unchanged).
    if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\' || b == 0xE2) {
        push_escaped(out, s);
    } else {
        out.push_str(s);
    }
    out.push('"');
}

/// The characters of `s`, escaped as the canonical form escapes them.
fn push_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// Formats epoch milliseconds as RFC 3339 UTC with exactly three fractional digits.
pub fn format_timestamp_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    match time::OffsetDateTime::from_unix_timestamp(secs) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            millis
        ),
        // Outside the representable calendar: fall back to the number, which
        // still reads back as epoch milliseconds.
        Err(_) => ms.to_string(),
    }
}

fn push_field(out: &mut String, name: &str, value: &str) {
    out.push(',');
    push_json_str(out, name);
    out.push(':');
    push_json_str(out, value);
}

/// Renders `e` as one line of canonical JSON (no trailing newline).
pub fn to_canonical_json(e: &UsageEvent) -> String {
    let mut out = String::with_capacity(256);
    write_canonical_json(e, &mut out);
    out
}

/// Appends the canonical JSON of `e` to `out`.
pub fn write_canonical_json(e: &UsageEvent, out: &mut String) {
    out.push('{');
    push_json_str(out, "event_id");
    out.push(':');
    push_json_str(out, &e.event_id);
    push_field(out, "tenant_id", &e.tenant_id);
    push_field(out, "customer_id", &e.customer_id);
    push_field(out, "meter", &e.meter);
    push_field(out, "quantity", &e.quantity.normalize().to_string());
    let ts = format_timestamp_ms(e.timestamp_ms);
    if ts.starts_with(|c: char| c.is_ascii_digit() || c == '-') && !ts.contains('T') {
        out.push_str(",\"timestamp\":");
        out.push_str(&ts);
    } else {
        push_field(out, "timestamp", &ts);
    }
    push_field(out, "kind", e.kind.as_str());
    if let Some(c) = &e.correction_ref {
        out.push_str(",\"correction_ref\":{");
        push_json_str(out, "original_event_id");
        out.push(':');
        push_json_str(out, &c.original_event_id);
        if let Some(r) = &c.reason {
            push_field(out, "reason", r);
        }
        out.push('}');
    }
    if let Some(v) = &e.resource_id {
        push_field(out, "resource_id", v);
    }
    if let Some(v) = &e.unit {
        push_field(out, "unit", v);
    }
    if let Some(v) = &e.source {
        push_field(out, "source", v);
    }
    if !e.dimensions.is_empty() {
        out.push_str(",\"dimensions\":{");
        for (i, (k, v)) in e.dimensions.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_json_str(out, k);
            out.push(':');
            push_json_str(out, v);
        }
        out.push('}');
    }
    if e.event_id_derived {
        out.push_str(",\"event_id_derived\":true");
    }
    out.push('}');
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{push_escaped, push_json_str};

    fn pushed(s: &str) -> String {
        let mut out = String::new();
        push_json_str(&mut out, s);
        out
    }

    proptest! {
        /// The copy-whole path writes exactly what escaping each character
        /// writes: the canonical form, and so every published payload,
        /// does not depend on which path a string took.
        #[test]
        fn strings_are_written_as_escaping_each_character_writes_them(
            s in prop_oneof![any::<String>(), "[a-z0-9_\\-\"\\\\\n\u{2028}\u{2029}\u{2013}\u{1}]{0,12}"]
        ) {
            let mut each = String::from('"');
            push_escaped(&mut each, &s);
            each.push('"');
            prop_assert_eq!(pushed(&s), each);
        }
    }

    #[test]
    fn plain_and_escaped_strings_are_written_as_pinned() {
        assert_eq!(pushed("cust-42"), r#""cust-42""#);
        assert_eq!(pushed("a\"b\\c\n\u{1}\u{2028}\u{2013}"), "\"a\\\"b\\\\c\\n\\u0001\\u2028\u{2013}\"");
    }
}
