//! Crash test on the real binary: `dedupd dedupe --state-dir --fsync always`
//! is SIGKILLed at random points, many times, and restarted each time until
//! it finishes its input. Small memtables and WAL files make the kills land
//! across WAL writes, segment flushes, manifest swaps and compactions.
//!
//! Each round feeds a new input file: new events, respelled retries of events
//! from earlier rounds, conflicting re-sends and invalid lines. The output
//! file accumulates across rounds (it is the source of truth). At the end it
//! must hold every distinct valid event exactly once, with its first payload.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// At least this many SIGKILLs must land mid-run.
const KILLS: usize = 50;
/// Rounds whose run finished before its kill do not count; stop here regardless.
const MAX_ROUNDS: usize = 150;
const NEW_PER_ROUND: usize = 1500;

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as i64
}

#[derive(Clone)]
struct Ev {
    tenant: &'static str,
    id: String,
    customer: u32,
    quantity_milli: u64,
    ts_ms: i64,
}

fn render(e: &Ev, quantity_milli: u64, spelling: u32) -> String {
    let q = match spelling % 3 {
        0 => format!("\"{}.{:03}\"", quantity_milli / 1000, quantity_milli % 1000),
        1 => format!("{quantity_milli}e-3"),
        _ => format!("\"{}.{:03}00\"", quantity_milli / 1000, quantity_milli % 1000),
    };
    if spelling % 2 == 0 {
        format!(
            r#"{{"event_id":"{}","tenant_id":"{}","customer_id":"cus_{}","meter":"api_calls","quantity":{q},"timestamp":{}}}"#,
            e.id, e.tenant, e.customer, e.ts_ms
        )
    } else {
        format!(
            r#"{{ "timestamp": {}, "quantity": {q}, "meter": "api_calls", "customer_id": "cus_{}", "tenant_id": "{}", "event_id": "{}" }}"#,
            e.ts_ms, e.customer, e.tenant, e.id
        )
    }
}

fn dedupe(input: &Path, output: &Path, state: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupd"));
    c.env("DEDUPD_LOG", "error")
        .args(["dedupe", "--fsync", "always", "--memtable-events", "700", "--wal-rotate-bytes", "64KiB"])
        .args(["--batch-records", "200"])
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output)
        .arg("--state-dir")
        .arg(state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

#[test]
fn sigkill_at_random_points_never_loses_or_doubles_an_accepted_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let output = dir.path().join("accepted.ndjson");
    let mut rng = StdRng::seed_from_u64(0x5eed_deed);
    let base_ts = now_ms() - 3_600_000;

    let mut all: Vec<Ev> = Vec::new();
    // First payload (canonical quantity) per (tenant, id), in input order.
    let mut first: HashMap<(String, String), u64> = HashMap::new();
    let mut kills = 0usize;
    let mut finished_before_kill = 0usize;
    let mut round = 0;
    while kills < KILLS && round < MAX_ROUNDS {
        round += 1;
        let mut lines: Vec<String> = Vec::new();
        for i in 0..NEW_PER_ROUND {
            let e = Ev {
                tenant: ["acme", "globex", "initech"][rng.random_range(0..3)],
                id: format!("r{round}_e{i}"),
                customer: rng.random_range(1..50),
                quantity_milli: rng.random_range(0..1_000_000),
                ts_ms: base_ts + rng.random_range(0..3_000_000),
            };
            lines.push(render(&e, e.quantity_milli, 0));
            first.entry((e.tenant.to_owned(), e.id.clone())).or_insert(e.quantity_milli);
            all.push(e);
            match rng.random_range(0..100u32) {
                0..=9 => {
                    // A respelled retry of any earlier event, this round or before.
                    let old = &all[rng.random_range(0..all.len())];
                    lines.push(render(old, old.quantity_milli, rng.random_range(1..6)));
                }
                10..=11 => {
                    // A conflicting re-send of an earlier event.
                    let old = &all[rng.random_range(0..all.len())];
                    lines.push(render(old, old.quantity_milli + 1, 0));
                }
                12 => lines.push("{\"tenant_id\":\"acme\",".to_owned()),
                _ => {}
            }
        }
        let input = dir.path().join(format!("round-{round}.ndjson"));
        std::fs::write(&input, lines.join("\n") + "\n").expect("write input");

        // The killed run.
        let mut child = dedupe(&input, &output, &state).spawn().expect("spawn");
        let kill_after = Duration::from_millis(rng.random_range(2..150));
        let started = Instant::now();
        let mut exited = None;
        while started.elapsed() < kill_after {
            if let Some(status) = child.try_wait().expect("try_wait") {
                exited = Some(status);
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        match exited {
            Some(status) => {
                assert!(status.success(), "round {round}: run failed before the kill");
                finished_before_kill += 1;
            }
            None => {
                child.kill().expect("SIGKILL");
                child.wait().expect("reap");
                kills += 1;
            }
        }

        // The restart finishes the input.
        let out = dedupe(&input, &output, &state).output().expect("restart");
        assert!(
            out.status.success(),
            "round {round}: restart after kill failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(kills >= KILLS, "only {kills} kills landed ({finished_before_kill} runs finished first)");

    let text = std::fs::read_to_string(&output).expect("output");
    let mut seen: HashMap<(String, String), u64> = HashMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("output lines are whole JSON");
        let key = (v["tenant_id"].as_str().expect("tenant").to_owned(), v["event_id"].as_str().expect("id").to_owned());
        let q = v["quantity"].as_str().expect("canonical quantity is a string");
        let milli = (q.parse::<f64>().expect("number") * 1000.0).round() as u64;
        assert!(seen.insert(key.clone(), milli).is_none(), "{key:?} published twice");
    }
    assert_eq!(seen.len(), first.len(), "distinct valid events vs accepted");
    for (key, q) in &first {
        assert_eq!(seen.get(key), Some(q), "{key:?}: missing, or not its first payload");
    }

    // The state after the kills is what the output says: every tier's
    // checksums hold, and the usage store holds each accepted event once,
    // with the ledger's totals refolded from it to the same figures (the
    // tiers are written in different orders and on different threads, so
    // a kill leaves them at different points, and repair must even them).
    let state_check = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .env("DEDUPD_LOG", "error")
            .args(args)
            .arg("--state-dir")
            .arg(&state)
            .output()
            .expect("run");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{args:?} failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    state_check(&["verify"]);
    let refolded = state_check(&["usage", "verify"]);
    assert!(
        refolded.contains(&format!("usage verify: {} accepted events refolded", first.len())),
        "the usage store and ledger after the kills: {refolded}"
    );

    // A conflict's report compares against its original, read from the
    // usage store: after the kills it must still find every one, whichever
    // run accepted it and whatever a kill cut short around it.
    let sample: Vec<&Ev> = (0..3000).map(|_| &all[rng.random_range(0..all.len())]).collect();
    let resends: Vec<String> = sample
        .iter()
        .map(|e| {
            let q = first[&(e.tenant.to_owned(), e.id.clone())];
            render(e, q + 1, 0)
        })
        .collect();
    let input = dir.path().join("conflicts.ndjson");
    std::fs::write(&input, resends.join("\n") + "\n").expect("write input");
    let reports = dir.path().join("conflicts-report.ndjson");
    let out = dedupe(&input, &output, &state).arg("--conflicts").arg(&reports).output().expect("run");
    assert!(out.status.success(), "the conflicts run: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&reports).expect("conflicts report");
    let mut reported = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("report lines are JSON");
        assert_eq!(v["differs"], serde_json::json!(["quantity"]), "original not found: {line}");
        assert!(v["first_output_offset"].as_i64().is_some(), "{line}");
        reported += 1;
    }
    assert_eq!(reported, sample.len(), "one report per conflicting re-send");
}
