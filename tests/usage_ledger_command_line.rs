//! The usage ledger as a billing engineer uses it: `dedupd dedupe` fills a
//! state directory, `dedupd usage` answers from it, `dedupd usage verify`
//! compares it with the accepted events, and bad questions get clear errors.

use std::process::Command;

use rust_decimal::Decimal;

const HOUR_MS: i64 = 3_600_000;

fn dedupd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupd"));
    c.env("DEDUPD_LOG", "warn");
    c
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as i64
}

fn line(id: &str, customer: &str, meter: &str, qty: &str, ts: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"{customer}","meter":"{meter}","quantity":"{qty}","timestamp":{ts}}}"#
    )
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run dedupd");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Input with on-time usage, a retry, a conflicting resend, a reject and one
/// event three days behind its counter; returns the state directory's parent.
fn ledger_with_traffic() -> (tempfile::TempDir, i64) {
    let dir = tempfile::tempdir().expect("tempdir");
    // Mid-hour, so the events of "an hour ago" stay in one hour.
    let now = now_ms();
    let base = now - now.rem_euclid(HOUR_MS) - HOUR_MS + HOUR_MS / 2;
    let lines = [
        line("a1", "cus_1", "api_calls", "10", base),
        line("a2", "cus_1", "api_calls", "2.5", base + 1000),
        line("a3", "cus_2", "api_calls", "7", base),
        line("a4", "cus_1", "storage_gb", "1", base),
        line("a1", "cus_1", "api_calls", "10", base), // a retry: duplicate
        line("a2", "cus_1", "api_calls", "99", base + 1000), // a conflict: not billed
        r#"{"event_id":"bad","tenant_id":"acme"}"#.to_owned(), // rejected
        line("late", "cus_1", "api_calls", "5", base - 72 * HOUR_MS),
    ];
    let input = dir.path().join("in.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").expect("write input");
    run_ok(
        dedupd()
            .args(["dedupe", "--output"])
            .arg(dir.path().join("out.ndjson"))
            .arg("--input")
            .arg(&input)
            .arg("--state-dir")
            .arg(dir.path().join("state")),
    );
    (dir, base)
}

fn usage_json(state: &std::path::Path, extra: &[&str], from: i64, to: i64) -> serde_json::Value {
    let fmt = |ms: i64| dedupd::event::format_timestamp_ms(ms);
    let out = run_ok(
        dedupd()
            .args(["usage", "--tenant", "acme", "--format", "json", "--from", &fmt(from), "--to", &fmt(to)])
            .arg("--state-dir")
            .arg(state)
            .args(extra),
    );
    serde_json::from_str(&out).expect("usage prints JSON")
}

fn dec(v: &serde_json::Value) -> Decimal {
    v.as_str().unwrap_or_else(|| panic!("{v} is not a decimal string")).parse().expect("decimal")
}

#[test]
fn usage_totals_bill_accepted_events_only_and_late_ones_as_adjustments() {
    let (dir, base) = ledger_with_traffic();
    let state = dir.path().join("state");
    let by_customer = usage_json(&state, &["--group-by", "customer"], base - 100 * HOUR_MS, base + HOUR_MS);
    let rows = by_customer["rows"].as_array().expect("rows");
    let row = |c: &str| rows.iter().find(|r| r["group"] == c).unwrap_or_else(|| panic!("no row {c}: {by_customer}"));
    // cus_1: 10 + 2.5 api_calls + 1 storage_gb; the duplicate and the
    // conflict's 99 are not billed, the late 5 is an adjustment.
    assert_eq!(dec(&row("cus_1")["sum"]), Decimal::new(135, 1));
    assert_eq!(row("cus_1")["count"], 3);
    assert_eq!(dec(&row("cus_2")["sum"]), Decimal::from(7));
    let adjustments = by_customer["adjustments"].as_array().expect("adjustments");
    assert_eq!(adjustments.len(), 1, "{by_customer}");
    assert_eq!((adjustments[0]["event_id"].as_str(), adjustments[0]["reason"].as_str()), (Some("late"), Some("late")));
    assert_eq!(dec(&by_customer["net"]), Decimal::new(255, 1));

    // One customer and meter, by hour: one row, the hour of `base`.
    let hourly = usage_json(
        &state,
        &["--customer", "cus_1", "--meter", "api_calls", "--group-by", "hour"],
        base - 2 * HOUR_MS,
        base + HOUR_MS,
    );
    let rows = hourly["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{hourly}");
    assert_eq!(rows[0]["group"], dedupd::event::format_timestamp_ms(base - base.rem_euclid(HOUR_MS)));
    assert_eq!(
        (dec(&rows[0]["sum"]), dec(&rows[0]["max"]), dec(&rows[0]["last"])),
        (Decimal::new(125, 1), Decimal::from(10), Decimal::new(25, 1))
    );
    // A range without the late event's time shows no adjustment.
    assert!(hourly["adjustments"].as_array().expect("adjustments").is_empty());

    // The table form says the same.
    let table = run_ok(
        dedupd()
            .args(["usage", "--tenant", "acme", "--from", "2020-01", "--to", "2100-01"])
            .arg("--state-dir")
            .arg(&state),
    );
    assert!(table.contains("net 25.5"), "{table}");
}

#[test]
fn usage_verify_finds_no_drift_then_finds_a_tampered_ledger() {
    let (dir, base) = ledger_with_traffic();
    let state = dir.path().join("state");
    let verify = || dedupd().args(["usage", "verify", "--state-dir"]).arg(&state).output().expect("run");
    let clean = verify();
    let text = String::from_utf8_lossy(&clean.stdout).into_owned();
    assert!(clean.status.success(), "{text}{}", String::from_utf8_lossy(&clean.stderr));
    assert!(text.contains("0 drifting") && text.contains("5 accepted events refolded"), "{text}");

    // Fold an event the usage store never accepted into the ledger, past
    // its checkpoint, as a bug would: verify must see the difference.
    {
        let ledger = dedupd::ledger::LedgerStore::open(&state.join("ledger")).expect("open ledger");
        let at = ledger.checkpoint(0).expect("checkpoint").expect("some");
        let v = dedupd::event::Validator::new(dedupd::event::Limits::default(), Vec::new(), "dedupd");
        let ghost = v.validate(line("ghost", "cus_1", "api_calls", "1000", base).as_bytes(), now_ms()).expect("valid");
        ledger.apply(0, &dedupd::ledger::Lateness::default(), &[(&ghost, at + 1)]).expect("apply");
        // Written behind: made durable only by a write (as at a clean close).
        ledger.flush().expect("flush");
    }
    let drifted = verify();
    let text = String::from_utf8_lossy(&drifted.stdout).into_owned();
    assert_eq!(drifted.status.code(), Some(1), "{text}");
    assert!(text.contains("DRIFT partition 0") && text.contains("1 drifting"), "{text}");
}

/// A ledger that lost, or never folded, accepted events holds less usage
/// than the usage store: that is drift, whether the partition has no
/// checkpoint at all (the ledger emptied) or an older one (the ledger
/// restored from a copy taken before later runs).
#[test]
fn usage_verify_reports_accepted_events_the_ledger_never_folded() {
    let (dir, base) = ledger_with_traffic();
    let state = dir.path().join("state");
    let verify = || {
        let out = dedupd().args(["usage", "verify", "--state-dir"]).arg(&state).output().expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let ledger = state.join("ledger");
    let older = dir.path().join("ledger-before-the-second-run");
    std::fs::rename(&ledger, &older).expect("set the ledger aside");

    // The ledger emptied: its partition 0 has no checkpoint, and all five
    // accepted events (output offsets 0..=4) are unfolded.
    std::fs::create_dir(&ledger).expect("empty ledger");
    let (code, text) = verify();
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("partition 0: the usage store holds 5 accepted events the ledger has not folded")
            && text.contains("output offsets 0..=4; ledger checkpoint none")
            && text.contains("1 drifting"),
        "{text}"
    );

    // A second run with the ledger on folds everything (the ledger catches
    // up from the usage store, then takes the new events): no drift.
    std::fs::remove_dir_all(&ledger).expect("drop the empty ledger");
    let more = dir.path().join("more.ndjson");
    std::fs::write(
        &more,
        line("b1", "cus_1", "api_calls", "4", base) + "\n" + &line("b2", "cus_2", "api_calls", "6", base) + "\n",
    )
    .expect("write input");
    run_ok(
        dedupd()
            .args(["dedupe", "--input"])
            .arg(&more)
            .arg("--output")
            .arg(dir.path().join("out.ndjson"))
            .arg("--state-dir")
            .arg(&state),
    );
    let (code, text) = verify();
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("7 accepted events refolded") && text.contains("0 drifting"), "{text}");

    // The ledger as it was before that run: its checkpoint is 4, and the
    // two events past it are unfolded, though every hour it holds agrees
    // with the five events it folded.
    std::fs::remove_dir_all(&ledger).expect("drop the current ledger");
    std::fs::rename(&older, &ledger).expect("restore the older ledger");
    let (code, text) = verify();
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("holds 2 accepted events the ledger has not folded (output offsets 5..=6; ledger checkpoint 4)")
            && text.contains("5 accepted events refolded")
            && text.contains("1 drifting"),
        "{text}"
    );
}

#[test]
fn bad_questions_get_clear_errors_and_change_nothing() {
    let (dir, _) = ledger_with_traffic();
    let state = dir.path().join("state");
    let before = std::fs::read_dir(state.join("ledger")).expect("ledger").count();
    let fails = |args: &[&str], says: &str| {
        let out = dedupd().arg("usage").arg("--state-dir").arg(&state).args(args).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(err.contains(says), "{args:?}: {err}");
    };
    fails(&["--tenant", "acme", "--from", "2026-12", "--to", "2026-11"], "backwards");
    fails(&["--tenant", "acme", "--from", "2026-13", "--to", "2027-01"], "is not a time");
    fails(&["--tenant", "acme", "--from", "2026-11", "--to", "2026-12", "--group-by", "week"], "group-by \"week\"");
    fails(&["--tenant", "acme", "--from", "2026-11", "--to", "2026-12", "--format", "xml"], "--format");
    fails(&["--tenant", "acme", "--from", "2026-11", "--to", "2026-12", "--group-by", "dimension:"], "dimension:KEY");
    assert_eq!(std::fs::read_dir(state.join("ledger")).expect("ledger").count(), before);

    // The Kafka readers take run's security properties: a bad one reaches
    // the client (refused before any connection), a malformed one is named.
    for (cmd, flags) in [
        (vec!["usage", "--tenant", "acme", "--from", "2026-11", "--to", "2026-12"], vec!["--rollups-topic", "r"]),
        (
            vec!["period", "show", "--tenant", "acme", "--period", "2026-11"],
            vec!["--periods-topic", "p", "--rollups-topic", "r"],
        ),
    ] {
        let run = |prop: &str| {
            let out = dedupd()
                .args(&cmd)
                .args(&flags)
                .args(["--brokers", "127.0.0.1:9", "--kafka-property", prop])
                .output()
                .expect("run");
            assert!(!out.status.success(), "{cmd:?} {prop}");
            String::from_utf8_lossy(&out.stderr).into_owned()
        };
        let err = run("security.protocol=carrier-pigeon");
        assert!(err.contains("security.protocol"), "{cmd:?}: {err}");
        let err = run("no-equals-sign");
        assert!(err.contains("kafka_properties"), "{cmd:?}: {err}");
    }

    // A meter override of a setting that does not exist is refused, naming it.
    let config = dir.path().join("dedupd.toml");
    std::fs::write(&config, "[meters.api_calls]\nlateness = \"6h\"\nlatenes = \"1h\"\n").expect("write");
    let out =
        dedupd().args(["dedupe", "--input", "-", "--output", "-", "--config"]).arg(&config).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("latenes"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(&config, "[meters.api_calls]\nlateness = \"soon\"\n").expect("write");
    let out =
        dedupd().args(["dedupe", "--input", "-", "--output", "-", "--config"]).arg(&config).output().expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("meters.api_calls"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Dimension values are not kept in rollups: `--group-by dimension:KEY`
/// refolds the accepted events, late ones still adjustments, and its total
/// equals the rollups' total of the same range.
#[test]
fn usage_by_dimension_is_refolded_from_the_accepted_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let now = now_ms();
    let base = now - now.rem_euclid(HOUR_MS) - HOUR_MS + HOUR_MS / 2;
    let with_region = |id: &str, qty: &str, ts: i64, region: &str| {
        line(id, "cus_1", "api_calls", qty, ts).replace('}', &format!(r#","dimensions":{{"region":"{region}"}}}}"#))
    };
    let lines = [
        with_region("d1", "1", base, "eu"),
        with_region("d2", "2", base + 1, "us"),
        with_region("d3", "4", base + 2, "eu"),
        line("d4", "cus_2", "api_calls", "8", base),
        with_region("d1", "1", base, "eu"), // a retry: counted once
        with_region("late", "16", base - 72 * HOUR_MS, "eu"),
    ];
    assert!(dedupe_into(dir.path(), "dims", &lines).is_empty());
    let state = dir.path().join("state");
    let (from, to) = (base - 100 * HOUR_MS, base + HOUR_MS);
    let by_region = usage_json(&state, &["--group-by", "dimension:region"], from, to);
    let rows: Vec<(String, Decimal)> = by_region["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| (r["group"].as_str().expect("group").to_owned(), dec(&r["sum"])))
        .collect();
    assert_eq!(rows, [("(none)".to_owned(), 8.into()), ("eu".to_owned(), 5.into()), ("us".to_owned(), 2.into())]);
    assert_eq!(by_region["adjustments"][0]["event_id"], "late", "the late event is an adjustment here too");
    let whole = usage_json(&state, &[], from, to);
    assert_eq!(dec(&by_region["net"]), dec(&whole["net"]), "same total as the rollups");
}

/// `dedupd dedupe` of `lines` into `dir`'s state and output; returns the
/// rejected records' reasons.
fn dedupe_into(dir: &std::path::Path, name: &str, lines: &[String]) -> Vec<String> {
    let input = dir.join(format!("{name}.ndjson"));
    let rejected = dir.join(format!("{name}.rejected.ndjson"));
    std::fs::write(&input, lines.join("\n") + "\n").expect("write input");
    run_ok(
        dedupd()
            .args(["dedupe", "--output"])
            .arg(dir.join("out.ndjson"))
            .arg("--input")
            .arg(&input)
            .arg("--rejected")
            .arg(&rejected)
            .arg("--state-dir")
            .arg(dir.join("state")),
    );
    std::fs::read_to_string(&rejected)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["reason"].as_str().expect("r").to_owned())
        .collect()
}

fn period_cmd(dir: &std::path::Path, action: &str, period: &str) -> std::process::Output {
    dedupd()
        .args(["period", action, "--tenant", "acme", "--period", period, "--format", "json", "--state-dir"])
        .arg(dir.join("state"))
        .output()
        .expect("run dedupd period")
}

fn period_json(dir: &std::path::Path, action: &str, period: &str) -> serde_json::Value {
    let out = period_cmd(dir, action, period);
    assert!(out.status.success(), "period {action}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("period prints JSON")
}

/// The README's walkthrough: close a month, see its frozen total, see usage
/// into it refused and a correction arrive as pending, reopen it.
#[test]
fn a_closed_month_is_frozen_refuses_usage_and_shows_corrections_as_pending() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // Five days back, mid-hour: every event below is in one month.
    let now = now_ms();
    let t = now - 5 * 24 * HOUR_MS;
    let t = t - t.rem_euclid(HOUR_MS) + HOUR_MS / 2;
    let month = {
        let date = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(t) * 1_000_000).expect("time");
        format!("{:04}-{:02}", date.year(), u8::from(date.month()))
    };
    let correction = |id: &str, qty: &str, of: &str| {
        format!(
            r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"cus_1","meter":"api_calls","quantity":"{qty}","timestamp":{t},"kind":"correction","correction_ref":{{"original_event_id":"{of}"}}}}"#
        )
    };
    let first = [
        line("e1", "cus_1", "api_calls", "10", t),
        line("e2", "cus_1", "api_calls", "5", t + 1000),
        line("e3", "cus_2", "api_calls", "7", t),
    ];
    assert!(dedupe_into(d, "first", &first).is_empty());

    let closed = period_json(d, "close", &month);
    assert_eq!(closed["status"], "closed");
    assert_eq!(
        (dec(&closed["frozen"]), dec(&closed["pending"]), dec(&closed["net"])),
        (22.into(), 0.into(), 22.into())
    );
    let book = std::fs::read(d.join("state/periods.json")).expect("the book is saved");

    // Closing again is refused and changes nothing: the first snapshot is
    // what was invoiced.
    let again = period_cmd(d, "close", &month);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already closed"), "{again:?}");
    assert_eq!(std::fs::read(d.join("state/periods.json")).expect("book"), book);

    // Usage into the closed month is refused; a correction is accepted and
    // shows as pending on top of the frozen total.
    let late = [line("e4", "cus_1", "api_calls", "4", t + 2000), correction("e5", "-2", "e2")];
    assert_eq!(dedupe_into(d, "late", &late), ["closed_period"]);
    let shown = period_json(d, "show", &month);
    assert_eq!(
        (dec(&shown["frozen"]), dec(&shown["pending"]), dec(&shown["net"])),
        (22.into(), (-2).into(), 20.into())
    );
    let cus_1 = &shown["lines"][0];
    assert_eq!((cus_1["customer_id"].as_str(), cus_1["pending"]["corrections"].as_i64()), (Some("cus_1"), Some(1)));
    assert_eq!(dec(&cus_1["frozen"]["quantity"]), Decimal::from(15));

    // Reopened: no snapshot, usage flows again, nothing pending.
    let reopened = period_json(d, "reopen", &month);
    assert_eq!((reopened["status"].as_str(), reopened["lines"][0]["frozen"].is_null()), (Some("open"), true));
    assert!(dedupe_into(d, "reopened", &late[..1]).is_empty());
    let shown = period_json(d, "show", &month);
    assert_eq!((dec(&shown["pending"]), dec(&shown["net"])), (0.into(), 24.into()));
    assert_eq!(shown["history"].as_array().map(Vec::len), Some(2), "close and reopen are both kept");
    let again = period_cmd(d, "reopen", &month);
    assert!(String::from_utf8_lossy(&again.stderr).contains("not closed"), "{again:?}");

    // An empty tenant is refused; a tenant with no usage in the month is
    // closed (invoiced as nothing), with a warning that a typo looks so.
    let empty = dedupd()
        .args(["period", "close", "--tenant", " ", "--period", &month, "--state-dir"])
        .arg(d.join("state"))
        .output()
        .expect("run");
    assert!(!empty.status.success() && String::from_utf8_lossy(&empty.stderr).contains("--tenant"), "{empty:?}");
    let typo = dedupd()
        .args(["period", "close", "--tenant", "Acme", "--period", &month, "--state-dir"])
        .arg(d.join("state"))
        .output()
        .expect("run");
    assert!(typo.status.success(), "{typo:?}");
    assert!(String::from_utf8_lossy(&typo.stderr).contains("no usage at all"), "{typo:?}");

    // A period that is not YYYY-MM is refused, naming the flag.
    let bad = period_cmd(d, "close", "2026-1");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--period"), "{bad:?}");
    // The fixed list is gone, with a message that says what replaced it.
    let old = dedupd().args(["dedupe", "--input", "-", "--output", "-", "--closed-period", "acme:2026-10"]).output();
    let old = old.expect("run");
    assert!(!old.status.success());
    assert!(String::from_utf8_lossy(&old.stderr).contains("dedupd period close"), "{old:?}");
}

/// A close freezes the ledger's total as the invoice, so it is refused
/// while the ledger lags the usage store (here after a run with the
/// ledger off; a run that died does the same), and made once a run with
/// the ledger on has folded the rest. It froze the lagging total before.
#[test]
fn a_close_waits_for_a_ledger_that_holds_every_stored_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let t = now_ms() - 5 * 24 * HOUR_MS;
    let t = t - t.rem_euclid(HOUR_MS) + HOUR_MS / 2;
    let month = {
        let date = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(t) * 1_000_000).expect("time");
        format!("{:04}-{:02}", date.year(), u8::from(date.month()))
    };
    assert!(dedupe_into(d, "first", &[line("e1", "cus_1", "api_calls", "3", t)]).is_empty());
    let input = d.join("ledger-off.ndjson");
    std::fs::write(&input, line("e2", "cus_1", "api_calls", "100", t + 1000) + "\n").expect("write");
    run_ok(
        dedupd()
            .args(["dedupe", "--ledger", "false", "--input"])
            .arg(&input)
            .arg("--output")
            .arg(d.join("out.ndjson"))
            .arg("--state-dir")
            .arg(d.join("state")),
    );
    let refused = period_cmd(d, "close", &month);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "a close froze a ledger behind its usage store: {stderr}");
    assert!(stderr.contains("behind its usage store"), "{stderr}");
    assert!(!d.join("state/periods.json").exists(), "the refused close saved a record");

    // A run with the ledger on folds what the other left; the close then
    // freezes every accepted event.
    assert!(dedupe_into(d, "third", &[line("e3", "cus_1", "api_calls", "1", t + 2000)]).is_empty());
    let closed = period_json(d, "close", &month);
    assert_eq!(dec(&closed["frozen"]), Decimal::from(104));
}

/// Six tenants' months closed at once against one state directory: every
/// close that reports success is in the book afterwards (each loads the
/// book and saves it with its record; unlocked, a later save dropped an
/// earlier one's, and a month billed as closed took usage again).
#[test]
fn closes_made_at_once_all_stay_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let t = now_ms() - 5 * 24 * HOUR_MS;
    let month = {
        let date = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(t) * 1_000_000).expect("time");
        format!("{:04}-{:02}", date.year(), u8::from(date.month()))
    };
    let tenants: Vec<String> = (0..6).map(|i| format!("t{i}")).collect();
    let events: Vec<String> = tenants
        .iter()
        .map(|tenant| line("e1", "cus_1", "api_calls", "1", t).replace("\"acme\"", &format!("\"{tenant}\"")))
        .collect();
    assert!(dedupe_into(d, "first", &events).is_empty());
    for round in 0..3 {
        let month = if round == 0 { month.clone() } else { format!("20{}-0{round}", 10 + round) };
        let children: Vec<_> = tenants
            .iter()
            .map(|tenant| {
                dedupd()
                    .args(["period", "close", "--tenant", tenant, "--period", &month, "--state-dir"])
                    .arg(d.join("state"))
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn")
            })
            .collect();
        // Each close takes milliseconds; a deadline, not a timing, so a
        // close that never got the book's lock fails the test, not CI.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        for mut child in children {
            let status = loop {
                if let Some(status) = child.try_wait().expect("wait") {
                    break status;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("round {round}: a close did not end within two minutes");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            let mut stderr = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut stderr);
            }
            assert!(status.success(), "round {round}: {stderr}");
        }
        for tenant in &tenants {
            let out = dedupd()
                .args(["period", "show", "--tenant", tenant, "--period", &month, "--format", "json", "--state-dir"])
                .arg(d.join("state"))
                .output()
                .expect("show");
            let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
            assert_eq!(shown["status"], "closed", "round {round}: {tenant}'s {month} was reported closed and is not");
        }
    }
}

/// Half past the last whole hour, and a quantity near the largest exact
/// decimal (about 7.9e28): two of it in one total do not fit.
fn last_half_hour_and_a_huge_quantity() -> (i64, &'static str) {
    let now = now_ms();
    (now - now.rem_euclid(HOUR_MS) - HOUR_MS / 2, "50000000000000000000000000000")
}

/// `usage --format FORMAT` over the two hours around `ts`, which must fail
/// (exit 2): its error.
fn usage_refused(state: &std::path::Path, format: &str, ts: i64) -> String {
    let fmt = |ms: i64| dedupd::event::format_timestamp_ms(ms);
    let (from, to) = (fmt(ts - HOUR_MS), fmt(ts + 2 * HOUR_MS));
    let out = dedupd()
        .args(["usage", "--tenant", "acme", "--format", format, "--from", &from, "--to", &to, "--state-dir"])
        .arg(state)
        .output()
        .expect("run usage");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "usage --format {format}: {stderr}");
    stderr
}

/// Every hour's sum fits an exact decimal, their total does not: `usage`
/// and `period show` panicked (exit 101, "Addition overflowed", a worker's
/// `/v1/usage` with them); now each says which total, exit 2.
#[test]
fn a_total_past_the_exact_decimal_range_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ts, huge) = last_half_hour_and_a_huge_quantity();
    let rejected = dedupe_into(
        dir.path(),
        "huge",
        &[line("h1", "cus_1", "api_calls", huge, ts), line("h2", "cus_2", "api_calls", huge, ts)],
    );
    assert!(rejected.is_empty(), "{rejected:?}");
    let state = dir.path().join("state");
    for format in ["json", "table"] {
        let stderr = usage_refused(&state, format, ts);
        assert!(stderr.contains("does not fit an exact decimal"), "{stderr}");
    }
    // One customer alone is within range and answers.
    let one = usage_json(&state, &["--customer", "cus_1"], ts - HOUR_MS, ts + 2 * HOUR_MS);
    assert_eq!(dec(&one["net"]), huge.parse::<Decimal>().expect("decimal"));
    let month = dedupd::event::format_timestamp_ms(ts)[..7].to_owned();
    let out = period_cmd(dir.path(), "show", &month);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "period show: {stderr}");
    assert!(stderr.contains("the net total does not fit an exact decimal"), "{stderr}");
}

/// An accepted event its hour's sum cannot take exactly (past the largest
/// decimal here) is published already when the ledger folds it. The fold
/// failed: the run stopped after writing the output (exit 2), and every
/// later run, repairing state from that output, failed the same way. Now
/// the event is a `sum_limit` adjustment: runs go on, the ledger agrees
/// with the accepted events, and a total that cannot be exact is an error.
#[test]
fn an_event_past_its_hours_sum_limit_is_an_adjustment_and_the_state_directory_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ts, huge) = last_half_hour_and_a_huge_quantity();
    let lines = [
        line("s1", "cus_1", "api_calls", huge, ts),
        line("s2", "cus_1", "api_calls", huge, ts + 1),
        line("s3", "cus_1", "api_calls", "1", ts + 2),
    ];
    assert!(dedupe_into(dir.path(), "first", &lines).is_empty());
    assert_eq!(std::fs::read_to_string(dir.path().join("out.ndjson")).expect("output").lines().count(), 3);
    // A later run opens the state directory (it failed there before) and
    // finds the same input all duplicates.
    assert!(dedupe_into(dir.path(), "again", &lines).is_empty());
    assert_eq!(std::fs::read_to_string(dir.path().join("out.ndjson")).expect("output").lines().count(), 3);
    let state = dir.path().join("state");
    run_ok(dedupd().args(["usage", "verify", "--state-dir"]).arg(&state));
    let stderr = usage_refused(&state, "json", ts);
    assert!(stderr.contains("the net total does not fit an exact decimal"), "{stderr}");
}

/// A worker's environment names both ways of answering (`DEDUPD_STATE_DIR`
/// and `DEDUPD_BROKERS`, `DEDUPD_ROLLUPS_TOPIC`, ...). `usage` and `period`
/// on the command line with `--state-dir` were refused over a topic flag
/// the user never typed; the flags typed win now, and typing both ways is
/// still refused.
#[test]
fn flags_typed_for_one_way_of_answering_win_over_the_environment_of_the_other() {
    let (dir, base) = ledger_with_traffic();
    let state = dir.path().join("state");
    let fmt = |ms: i64| dedupd::event::format_timestamp_ms(ms);
    let (from, to) = (fmt(base - 100 * HOUR_MS), fmt(base + HOUR_MS));
    let month = fmt(base)[..7].to_owned();
    let worker_env = |cmd: &mut Command| {
        cmd.env("DEDUPD_BROKERS", "127.0.0.1:9")
            .env("DEDUPD_ROLLUPS_TOPIC", "usage-rollups")
            .env("DEDUPD_OUTPUT_TOPIC", "usage-accepted")
            .env("DEDUPD_PERIODS_TOPIC", "usage-periods");
    };
    let runs: [Vec<&str>; 3] = [
        vec!["usage", "--tenant", "acme", "--from", &from, "--to", &to],
        vec!["usage", "verify"],
        vec!["period", "show", "--tenant", "acme", "--period", &month],
    ];
    for args in &runs {
        let mut cmd = dedupd();
        cmd.args(args).arg("--state-dir").arg(&state);
        worker_env(&mut cmd);
        run_ok(&mut cmd);
    }
    let mut both = dedupd();
    both.args(&runs[0]).arg("--state-dir").arg(&state).args(["--rollups-topic", "r", "--brokers", "127.0.0.1:9"]);
    let out = both.output().expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}
