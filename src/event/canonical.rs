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
    if s.bytes().any(|b| MAY_ESCAPE[b as usize]) {
        push_escaped(out, s);
    } else {
        out.push_str(s);
    }
    out.push('"');
}

/// The bytes that may start a character the canonical form escapes (0xE2
/// leads both line separators' UTF-8 encodings).
const MAY_ESCAPE: [bool; 256] = super::json_string_stops(&[0xE2]);

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

/// Epoch milliseconds of 0000-01-01T00:00:00Z and of 10000-01-01T00:00:00Z:
/// the years [`push_timestamp_ms`] writes digit by digit.
const FOUR_DIGIT_YEARS_MS: std::ops::Range<i64> = -62_167_219_200_000..253_402_300_800_000;

/// The civil date (year, month, day) of a day counted from 1970-01-01, in
/// the proleptic Gregorian calendar: days are shifted to an era of 400
/// years starting on a 1 March, where every month length but February's
/// follows one formula.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Writes `value` into `slot` as decimal digits, zero-padded to the slot's
/// length.
fn put_digits(slot: &mut [u8], mut value: u32) {
    debug_assert!(u64::from(value) < 10u64.pow(slot.len() as u32), "{value} has more than {} digits", slot.len());
    for b in slot.iter_mut().rev() {
        *b = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

/// Appends ASCII bytes the writer has just built.
///
/// # Panics
///
/// On bytes that are not UTF-8, which no caller passes: each writes only
/// ASCII digits and punctuation.
fn push_ascii(out: &mut String, bytes: &[u8]) {
    #[allow(clippy::expect_used)]
    out.push_str(std::str::from_utf8(bytes).expect("the writer builds only ASCII"));
}

/// Appends what [`format_timestamp_ms`] returns, without building a
/// string: the output line's and the payload's hot path. The text is laid
/// out in one buffer and appended once (a push per character was 3% of the
/// offline path's instructions).
pub fn push_timestamp_ms(out: &mut String, ms: i64) {
    if !FOUR_DIGIT_YEARS_MS.contains(&ms) {
        out.push_str(&format_timestamp_ms(ms));
        return;
    }
    let secs = ms.div_euclid(1000);
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let second_of_day = secs.rem_euclid(86_400) as u32;
    let mut text = *b"0000-00-00T00:00:00.000Z";
    put_digits(&mut text[0..4], year as u32);
    put_digits(&mut text[5..7], month);
    put_digits(&mut text[8..10], day);
    put_digits(&mut text[11..13], second_of_day / 3_600);
    put_digits(&mut text[14..16], second_of_day / 60 % 60);
    put_digits(&mut text[17..19], second_of_day % 60);
    put_digits(&mut text[20..23], ms.rem_euclid(1000) as u32);
    push_ascii(out, &text);
}

/// Appends `d` as `Decimal`'s `Display` writes it once normalised: a
/// minus sign for a negative value, the integer digits, and the fraction
/// only when the scale is not zero. Written from the mantissa (the
/// formatting machinery was 3% of the offline path's instructions); a
/// mantissa beyond `u64`, rare for a usage quantity, takes `Display`.
pub fn push_decimal(out: &mut String, d: rust_decimal::Decimal) {
    let d = d.normalize();
    let mantissa = d.mantissa();
    let Ok(magnitude) = u64::try_from(mantissa.unsigned_abs()) else {
        let _ = write!(out, "{d}");
        return;
    };
    // The mantissa's digits: u64::MAX has 20. A leading "0." and the zeros
    // of a scale longer than the digits are written straight to `out`.
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut v = magnitude;
    loop {
        start -= 1;
        digits[start] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let digits = &digits[start..];
    if mantissa < 0 {
        out.push('-');
    }
    let scale = d.scale() as usize;
    if scale == 0 {
        push_ascii(out, digits);
    } else if digits.len() > scale {
        let (whole, fraction) = digits.split_at(digits.len() - scale);
        push_ascii(out, whole);
        out.push('.');
        push_ascii(out, fraction);
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', scale - digits.len()));
        push_ascii(out, digits);
    }
}

/// Formats epoch milliseconds as RFC 3339 UTC with exactly three fractional digits.
pub fn format_timestamp_ms(ms: i64) -> String {
    if FOUR_DIGIT_YEARS_MS.contains(&ms) {
        let mut out = String::with_capacity(24);
        push_timestamp_ms(&mut out, ms);
        return out;
    }
    // Outside the representable calendar: fall back to the number, which
    // still reads back as epoch milliseconds.
    by_the_calendar(ms).unwrap_or_else(|| ms.to_string())
}

/// `ms` as the `time` crate's calendar writes it (years -9999 to 9999),
/// `None` outside it. What the digit-by-digit path is checked against.
fn by_the_calendar(ms: i64) -> Option<String> {
    let t = time::OffsetDateTime::from_unix_timestamp(ms.div_euclid(1000)).ok()?;
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        ms.rem_euclid(1000)
    ))
}

/// Appends `,"name":` and `value` as a JSON string. The name is a literal
/// the schema fixes, needing no escape, so it is written as one piece.
macro_rules! push_field {
    ($out:expr, $name:literal, $value:expr) => {{
        $out.push_str(concat!(",\"", $name, "\":"));
        push_json_str($out, $value);
    }};
}

/// Renders `e` as one line of canonical JSON (no trailing newline).
pub fn to_canonical_json(e: &UsageEvent) -> String {
    let mut out = String::with_capacity(256);
    write_canonical_json(e, &mut out);
    out
}

/// Appends the canonical JSON of `e` to `out`.
pub fn write_canonical_json(e: &UsageEvent, out: &mut String) {
    out.push_str("{\"event_id\":");
    push_json_str(out, &e.event_id);
    push_field!(out, "tenant_id", &e.tenant_id);
    push_field!(out, "customer_id", &e.customer_id);
    push_field!(out, "meter", &e.meter);
    // A decimal's digits, sign and point need no escaping.
    out.push_str(",\"quantity\":\"");
    push_decimal(out, e.quantity);
    out.push('"');
    if FOUR_DIGIT_YEARS_MS.contains(&e.timestamp_ms) {
        out.push_str(",\"timestamp\":\"");
        push_timestamp_ms(out, e.timestamp_ms);
        out.push('"');
    } else {
        let ts = format_timestamp_ms(e.timestamp_ms);
        if ts.starts_with(|c: char| c.is_ascii_digit() || c == '-') && !ts.contains('T') {
            out.push_str(",\"timestamp\":");
            out.push_str(&ts);
        } else {
            push_field!(out, "timestamp", &ts);
        }
    }
    push_field!(out, "kind", e.kind.as_str());
    if let Some(c) = &e.correction_ref {
        out.push_str(",\"correction_ref\":{");
        out.push_str("\"original_event_id\":");
        push_json_str(out, &c.original_event_id);
        if let Some(r) = &c.reason {
            push_field!(out, "reason", r);
        }
        out.push('}');
    }
    if let Some(v) = &e.resource_id {
        push_field!(out, "resource_id", v);
    }
    if let Some(v) = &e.unit {
        push_field!(out, "unit", v);
    }
    if let Some(v) = &e.source {
        push_field!(out, "source", v);
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

    use super::{
        format_timestamp_ms, push_decimal, push_escaped, push_json_str, push_timestamp_ms, FOUR_DIGIT_YEARS_MS,
    };

    fn pushed(s: &str) -> String {
        let mut out = String::new();
        push_json_str(&mut out, s);
        out
    }

    fn by_the_calendar_crate(ms: i64) -> String {
        super::by_the_calendar(ms).expect("in range")
    }

    fn pushed_timestamp(ms: i64) -> String {
        let mut out = String::new();
        push_timestamp_ms(&mut out, ms);
        out
    }

    proptest! {
        /// Timestamps written digit by digit are the calendar's, for every
        /// instant of years 0000 to 9999 (leap years, centuries, the
        /// epoch's either side). Outside them see the pinned edges below.
        #[test]
        fn timestamps_are_written_as_the_calendar_writes_them(
            ms in prop_oneof![FOUR_DIGIT_YEARS_MS, 1_600_000_000_000i64..1_900_000_000_000]
        ) {
            prop_assert_eq!(pushed_timestamp(ms), by_the_calendar_crate(ms));
        }

        /// Quantities written from the mantissa are what `Decimal`'s
        /// `Display` writes for the normalised value: small and large
        /// mantissas (beyond `u64` too), every scale, both signs of zero.
        #[test]
        fn quantities_are_written_as_display_writes_them(
            // u32::MAX pins the edge of the u64 path (lo = mid = MAX, hi 0
            // or 1); hi is mostly 0, where the usual quantities are.
            lo in prop_oneof![Just(0u32), Just(u32::MAX), 0..1000u32, any::<u32>()],
            mid in prop_oneof![Just(0u32), Just(u32::MAX), 0..4u32, any::<u32>()],
            hi in prop_oneof![2 => Just(0u32), 1 => Just(1u32), 1 => any::<u32>()],
            negative in any::<bool>(),
            scale in 0..=28u32,
        ) {
            let d = rust_decimal::Decimal::from_parts(lo, mid, hi, negative, scale);
            let mut out = String::new();
            push_decimal(&mut out, d);
            prop_assert_eq!(out, d.normalize().to_string());
        }

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
    fn edges_of_the_calendar_are_written_as_pinned() {
        for (ms, text) in [
            (0, "1970-01-01T00:00:00.000Z"),
            (-1, "1969-12-31T23:59:59.999Z"),
            (951_782_400_000, "2000-02-29T00:00:00.000Z"),
            (4_107_542_399_999, "2100-02-28T23:59:59.999Z"),
            (FOUR_DIGIT_YEARS_MS.start, "0000-01-01T00:00:00.000Z"),
            (FOUR_DIGIT_YEARS_MS.end - 1, "9999-12-31T23:59:59.999Z"),
        ] {
            assert_eq!(pushed_timestamp(ms), text);
            assert_eq!(by_the_calendar_crate(ms), text);
        }
        // Outside four-digit years, as before the digit-by-digit path: the
        // calendar's negative years, then the bare number where the
        // calendar ends; the canonical form quotes only the former.
        let outside = [
            (FOUR_DIGIT_YEARS_MS.start - 1, "-001-12-31T23:59:59.999Z", r#""timestamp":"-001-12-31T23:59:59.999Z""#),
            (FOUR_DIGIT_YEARS_MS.end, "253402300800000", r#""timestamp":253402300800000,"#),
            (i64::MIN, "-9223372036854775808", r#""timestamp":-9223372036854775808,"#),
        ];
        for (ms, text, in_json) in outside {
            assert_eq!(format_timestamp_ms(ms), text);
            assert_eq!(pushed_timestamp(ms), text);
            let event = crate::event::UsageEvent { timestamp_ms: ms, ..sample_usage_event() };
            let json = super::to_canonical_json(&event);
            assert!(json.contains(in_json), "{json}");
        }
    }

    fn sample_usage_event() -> crate::event::UsageEvent {
        crate::event::UsageEvent {
            event_id: "e".into(),
            tenant_id: "t".into(),
            customer_id: "c".into(),
            meter: "m".into(),
            quantity: rust_decimal::Decimal::ONE,
            ..crate::event::UsageEvent::blank()
        }
    }

    #[test]
    fn plain_and_escaped_strings_are_written_as_pinned() {
        assert_eq!(pushed("cust-42"), r#""cust-42""#);
        assert_eq!(pushed("a\"b\\c\n\u{1}\u{2028}\u{2013}"), "\"a\\\"b\\\\c\\n\\u0001\\u2028\u{2013}\"");
    }
}
