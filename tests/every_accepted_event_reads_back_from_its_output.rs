//! Whatever the validator accepts, its canonical output record reads back —
//! through repair's Kafka path and through the offline output file — to the
//! same identity and payload hash, whatever the limits are when it is read.
//!
//! The trap this guards: JSON escapes make the canonical form longer than
//! the input (`\b` is 2 bytes in, `\u0008` 6 bytes out), so an event near the
//! input limits has an output record past them. Repair must never apply the
//! input limits to output, or a lost state directory can never be rebuilt.

use std::fmt::Write as _;
use std::process::Command;

use dedupd::config::EngineSettings;
use dedupd::event::{id_hash, payload_hash, write_canonical_json, Limits, Position, RejectReason, Validator};
use dedupd::kafka::records::{accepted_record, parse_output};
use proptest::prelude::*;

const NOW: i64 = 1_790_000_000_000;

/// The tightest limits a configuration accepts: reading output must not care.
fn tightest_reader() -> Validator {
    let limits = Limits {
        max_record_bytes: 64,
        max_id_bytes: 1,
        max_field_bytes: 1,
        max_dimensions: 0,
        max_future_skew_ms: 0,
        max_event_age_ms: 1,
        max_output_bytes: 1024,
    };
    Validator::new(limits, vec![], "dedupd")
}

/// Writes `s` as a JSON string using the shortest escapes a producer may
/// choose (`\b`, `\f`, `\n`...), `\u` escapes for other control characters,
/// and raw UTF-8 for the rest.
fn json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Strings that grow the most when escaped, and some that do not.
fn adversarial(max_bytes: usize) -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => Just('\u{8}'),
        4 => Just('\u{c}'),
        2 => Just('\u{1}'),
        2 => Just('\u{1f}'),
        1 => Just('\n'),
        1 => Just('"'),
        1 => Just('\\'),
        1 => Just('\u{2028}'),
        1 => Just('\u{2029}'),
        1 => Just('é'),
        1 => Just('𝄞'),
        2 => proptest::char::range('a', 'z'),
    ];
    // Either short, or as long as the limit allows (where escaping hurts).
    prop_oneof![
        prop::collection::vec(piece.clone(), 1..8),
        prop::collection::vec(piece, max_bytes.saturating_sub(8)..=max_bytes),
    ]
    .prop_map(move |cs| {
        let mut s = String::new();
        for c in cs {
            if s.len() + c.len_utf8() > max_bytes {
                break;
            }
            s.push(c);
        }
        if s.is_empty() {
            s.push('x');
        }
        s
    })
}

#[derive(Debug, Clone)]
struct Input {
    event_id: Option<String>,
    customer: String,
    dims: Vec<(String, String)>,
    unit: Option<String>,
    epoch_ms_timestamp: bool,
    quantity: &'static str,
    /// A correction of this original (placed by it), or usage.
    corrects: Option<String>,
}

fn input() -> impl Strategy<Value = Input> {
    let l = Limits::default();
    (
        prop::option::of(adversarial(l.max_id_bytes)),
        adversarial(l.max_id_bytes),
        prop::collection::vec((adversarial(l.max_id_bytes), adversarial(l.max_field_bytes)), 0..=l.max_dimensions),
        prop::option::of(adversarial(l.max_field_bytes)),
        any::<bool>(),
        prop_oneof![Just("1e27"), Just("\"0.000001\""), Just("12.50"), Just("\"79228162514264337593543950335\"")],
        prop::option::of(adversarial(l.max_id_bytes)),
    )
        .prop_map(|(event_id, customer, dims, unit, epoch_ms_timestamp, quantity, corrects)| Input {
            event_id,
            customer,
            dims,
            unit,
            epoch_ms_timestamp,
            quantity,
            corrects,
        })
}

fn render(i: &Input) -> String {
    let mut s = String::from("{");
    if let Some(id) = &i.event_id {
        s.push_str("\"event_id\":");
        json_str(id, &mut s);
        s.push(',');
    }
    s.push_str("\"tenant_id\":\"acme\",\"customer_id\":");
    json_str(&i.customer, &mut s);
    let _ = write!(s, ",\"meter\":\"m\",\"quantity\":{}", i.quantity);
    if i.epoch_ms_timestamp {
        let _ = write!(s, ",\"timestamp\":{NOW}");
    } else {
        s.push_str(",\"timestamp\":\"2026-09-21T13:46:40.000000001+02:00\"");
    }
    if let Some(u) = &i.unit {
        s.push_str(",\"unit\":");
        json_str(u, &mut s);
    }
    if let Some(original) = &i.corrects {
        s.push_str(",\"kind\":\"correction\",\"correction_ref\":{\"original_event_id\":");
        json_str(original, &mut s);
        s.push('}');
    }
    if !i.dims.is_empty() {
        s.push_str(",\"dimensions\":{");
        let mut seen = std::collections::HashSet::new();
        let mut first = true;
        for (k, v) in &i.dims {
            if !seen.insert(k.clone()) {
                continue;
            }
            if !first {
                s.push(',');
            }
            first = false;
            json_str(k, &mut s);
            s.push(':');
            json_str(v, &mut s);
        }
        s.push('}');
    }
    s.push('}');
    s
}

/// Reads `raw` back through both output paths, checking identity and hashes.
fn assert_reads_back(raw: &str, now: i64) -> Result<(), TestCaseError> {
    let validator = EngineSettings::default().validator();
    let event = match validator.validate(raw.as_bytes(), now) {
        Ok(e) => e,
        // Only the canonical size bound may turn an event of this shape away.
        Err(r) => {
            prop_assert_eq!(r.reason, RejectReason::RecordTooLarge, "{}", r.detail);
            return Ok(());
        }
    };
    let id = id_hash(&event.tenant_id, &event.event_id);
    let ph = payload_hash(&event);
    let reader = tightest_reader();

    // The router places a record by the identity it reads without judging
    // the rest; it must be the identity the dedupe stage then checks.
    let routed = validator.identity_of(raw.as_bytes()).map_err(|r| TestCaseError::fail(r.to_string()))?;
    prop_assert_eq!(routed, (event.tenant_id.clone(), event.event_id.clone()));
    // And it places it where the dedupe stage looks for it: by its own id,
    // or a correction by its original's.
    let placed = validator.placement_of(raw.as_bytes()).map_err(|r| TestCaseError::fail(r.to_string()))?;
    prop_assert_eq!(placed, (event.tenant_id.clone(), event.placement_id().to_owned()));

    // Repair's path: the Kafka output record and its headers.
    let record = accepted_record(&event, id, ph, Position::new(3, 17), now);
    prop_assert!(record.value.as_ref().map_or(0, Vec::len) <= Limits::default().max_output_bytes);
    let back = parse_output(&reader, Position::new(3, 0), Some(&record.owned_headers()), record.value.as_deref());
    let back = match back {
        Ok(b) => b,
        Err(e) => return Err(TestCaseError::fail(format!("output record does not read back: {e}"))),
    };
    prop_assert_eq!(back.key.id_hash, id);
    prop_assert_eq!(back.key.payload_hash, ph);
    prop_assert_eq!(&back.event, &event);

    // The offline output file's path: one canonical line.
    let mut line = String::new();
    write_canonical_json(&event, &mut line);
    let again = reader.read_output(line.as_bytes()).map_err(|r| TestCaseError::fail(r.to_string()))?;
    prop_assert_eq!(payload_hash(&again), ph);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn accepted_events_with_adversarial_strings_read_back_to_the_same_identity_and_payload(i in input()) {
        assert_reads_back(&render(&i), NOW)?;
    }
}

#[test]
fn a_record_without_an_identity_says_why_and_one_with_a_bad_quantity_still_has_one() {
    let v = EngineSettings::default().validator();
    let reason = |raw: &str| v.identity_of(raw.as_bytes()).map_err(|r| r.reason);
    assert_eq!(reason("not json"), Err(RejectReason::MalformedJson));
    assert_eq!(reason(r#"{"event_id":"e"}"#), Err(RejectReason::MissingField));
    assert_eq!(reason(r#"{"event_id":"e","tenant_id":""}"#), Err(RejectReason::EmptyField));
    assert_eq!(reason(r#"{"event_id":"e","tenant_id":7}"#), Err(RejectReason::MalformedJson));
    assert_eq!(reason(r#"{"tenant_id":"t","customer_id":"c","meter":"m"}"#), Err(RejectReason::MissingField));
    assert_eq!(
        reason(r#"{"tenant_id":"t","customer_id":"c","meter":"m","timestamp":"yesterday"}"#),
        Err(RejectReason::InvalidTimestamp)
    );
    // Placement needs the identity only: the dedupe stage judges the rest.
    let negative = r#"{"event_id":"e","tenant_id":"t","quantity":"-5","extra":1}"#;
    assert_eq!(v.identity_of(negative.as_bytes()), Ok(("t".to_owned(), "e".to_owned())));
}

/// The event of the report: sixteen dimensions of 1 KiB of `\b`. About 33 KB
/// in, about 98 KB of canonical output, past the 64 KiB input limit.
fn escape_heavy_event(id: &str) -> String {
    let mut s = format!(
        r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"c","meter":"m","quantity":1,"timestamp":{}"#,
        now_ms() - 60_000
    );
    s.push_str(",\"dimensions\":{");
    for d in 0..16 {
        if d > 0 {
            s.push(',');
        }
        let _ = write!(s, "\"d{d:02}\":\"{}\"", "\\b".repeat(1024));
    }
    s.push_str("}}");
    s
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as i64
}

#[test]
fn an_escape_heavy_event_past_the_input_limit_once_canonical_still_reads_back() {
    let raw = escape_heavy_event("evt_escapes");
    assert!(raw.len() < Limits::default().max_record_bytes, "input is within the limit: {}", raw.len());
    let validator = EngineSettings::default().validator();
    let event = validator.validate(raw.as_bytes(), now_ms()).expect("accepted");
    let record = accepted_record(
        &event,
        id_hash(&event.tenant_id, &event.event_id),
        payload_hash(&event),
        Position::new(0, 1),
        now_ms(),
    );
    let out_len = record.value.as_ref().map_or(0, Vec::len);
    assert!(out_len > Limits::default().max_record_bytes, "canonical output is past the input limit: {out_len}");
    let back = parse_output(&validator, Position::new(0, 0), Some(&record.owned_headers()), record.value.as_deref());
    assert!(back.is_ok(), "repair must read the worker's own output: {back:?}");
}

#[test]
fn an_event_whose_canonical_output_exceeds_max_output_bytes_is_rejected_with_its_reason() {
    let mut settings = EngineSettings::default();
    settings.limits.max_output_bytes = 64 << 10;
    let r = settings
        .validator()
        .validate(escape_heavy_event("evt_too_big_out").as_bytes(), now_ms())
        .expect_err("canonical form over the output limit");
    assert_eq!(r.reason, RejectReason::RecordTooLarge);
    assert!(r.detail.contains("canonical output") && r.detail.contains("max_output_bytes"), "{}", r.detail);
}

fn dedupd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupd"));
    c.env("DEDUPD_LOG", "warn");
    c
}

fn dedupe(args: &[&str]) -> serde_json::Value {
    let out = dedupd().arg("dedupe").args(args).output().expect("run dedupd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "dedupd dedupe {args:?} failed: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("summary {last:?}: {e}"))
}

#[test]
fn a_lost_state_dir_is_rebuilt_from_escape_heavy_output_even_after_the_limits_are_lowered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("in.ndjson");
    let output = dir.path().join("out.ndjson");
    let state = dir.path().join("state");
    std::fs::write(&input, format!("{}\n{}\n", escape_heavy_event("a"), escape_heavy_event("b"))).expect("write");
    let (i, o, s) = (input.to_str().expect("utf8"), output.to_str().expect("utf8"), state.to_str().expect("utf8"));

    let first = dedupe(&["--input", i, "--output", o, "--state-dir", s]);
    assert_eq!(first["accepted"], 2, "{first}");

    // The disk is replaced and the operator tightened the input limits: the
    // state is still rebuilt from the output file (no new input here).
    std::fs::remove_dir_all(&state).expect("lose the state dir");
    let empty = dir.path().join("empty.ndjson");
    std::fs::write(&empty, "").expect("write");
    let e = empty.to_str().expect("utf8");
    let rebuilt = dedupe(&[
        "--input",
        e,
        "--output",
        o,
        "--state-dir",
        s,
        "--max-field-bytes",
        "8",
        "--max-record-bytes",
        "4KiB",
    ]);
    assert_eq!(rebuilt["accepted"], 0, "{rebuilt}");

    // The rebuilt state knows both events: the same input again is all
    // duplicates, not billed a second time.
    let again = dedupe(&["--input", i, "--output", o, "--state-dir", s]);
    assert_eq!((again["accepted"].clone(), again["duplicates"].clone()), (0.into(), 2.into()), "{again}");
    assert_eq!(std::fs::read_to_string(&output).expect("read").lines().count(), 2);
}
