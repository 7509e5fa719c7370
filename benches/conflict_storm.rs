//! A conflict storm against a long history (issue #14's must-show): the
//! same stream with 10% conflicts and with none, through `dedupd dedupe
//! --state-dir` on a state directory holding `DEDUPD_BENCH_HISTORY` events
//! (default 20,000,000) spread over 30 days of event time.
//!
//! A conflict is an event id from the history sent again with another
//! quantity: classification finds its key (hot cache or key store) and the
//! report needs the original payload, read from the usage store by its
//! first-seen time. Reports events/s of each stream and the p50/p99 of its
//! batches (1,000 records), from the time between the engine's per-batch
//! progress calls. Not criterion: one pass over a long history is the
//! measurement. Run with
//! `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo bench --profile dev --bench conflict_storm`.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use dedupd::classify::SystemClock;
use dedupd::config::EngineSettings;
use dedupd::offline::{run_dedupe_with_progress, DedupeOptions, Stdio};

/// As the `dedupd` binary allocates (see `src/main.rs`): with the system
/// allocator this bench measured glibc's malloc and free (5% of its main
/// thread in a conflict storm), which the binary never runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DAY_MS: i64 = 86_400_000;
const CHUNK: u64 = 1_000_000;

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64
}

fn line(id: &str, n: u64, qty: u64, ts: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"cus_{}","meter":"api_calls","quantity":"{qty}","timestamp":{ts}}}"#,
        n % 2000
    )
}

/// One `dedupd dedupe` run of `lines` into `dir`; the duration of each batch.
fn run(dir: &Path, name: &str, lines: impl Iterator<Item = String>, settings: &EngineSettings) -> (Vec<Duration>, u64) {
    let input = dir.join(format!("{name}.ndjson"));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&input).expect("input"));
    for l in lines {
        writeln!(f, "{l}").expect("write");
    }
    f.flush().expect("flush");
    drop(f);
    let opts = DedupeOptions {
        input: Stdio::File(input.clone()),
        output: Stdio::File(dir.join("output.ndjson")),
        state_dir: Some(dir.join("state")),
        rejected: None,
        conflicts: Some(dir.join("conflicts.ndjson")),
        batch_records: 1000,
    };
    let mut batches = Vec::new();
    let mut last = Instant::now();
    let summary = run_dedupe_with_progress(&opts, settings, &SystemClock, &mut |_| {
        batches.push(last.elapsed());
        last = Instant::now();
    })
    .expect("dedupe");
    std::fs::remove_file(&input).expect("remove input");
    // The first interval also holds opening the state directory and
    // checking the output file against it: not a batch.
    if !batches.is_empty() {
        batches.remove(0);
    }
    (batches, summary.conflicts)
}

fn report(name: &str, events: u64, batches: &mut [Duration], conflicts: u64) -> f64 {
    let total: Duration = batches.iter().sum();
    batches.sort();
    let pct = |p: f64| batches[((batches.len() as f64 - 1.0) * p) as usize].as_secs_f64() * 1000.0;
    // Every batch but the first (see `run`) holds 1,000 records.
    let rate = (batches.len() * 1000) as f64 / total.as_secs_f64();
    println!(
        "{name}: {events} records, {conflicts} conflicts, {rate:.0} records/s, batch p50 {:.2} ms p99 {:.2} ms",
        pct(0.50),
        pct(0.99)
    );
    rate
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let history: u64 = std::env::var("DEDUPD_BENCH_HISTORY").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000_000);
    let stream: u64 = std::env::var("DEDUPD_BENCH_STREAM").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let dir = tempfile::tempdir_in(std::env::var("DEDUPD_BENCH_DIR").unwrap_or_else(|_| ".".into())).expect("dir");
    let settings = EngineSettings::default();
    let now = now_ms();
    // The history: event times spread evenly over the last 30 days.
    let started = Instant::now();
    let mut written = 0;
    while written < history {
        let n = CHUNK.min(history - written);
        let lines = (written..written + n).map(|i| {
            let ts = now - 30 * DAY_MS + (i as i64 * 30 * DAY_MS) / history as i64;
            line(&format!("h{i}"), i, i % 97 + 1, ts)
        });
        run(dir.path(), "history", lines, &settings);
        written += n;
        println!("history: {written} events in {:.0} s", started.elapsed().as_secs_f64());
    }
    // The streams: new events, and in the storm every tenth record an id
    // of the history with another quantity (a pseudo-random walk over it).
    let mut next = history;
    let mut stream_of = |conflicts: bool| -> Vec<String> {
        (0..stream)
            .map(|k| {
                if conflicts && k % 10 == 0 {
                    let i = (k.wrapping_mul(2_654_435_761) ^ next) % history;
                    let ts = now - 30 * DAY_MS + (i as i64 * 30 * DAY_MS) / history as i64;
                    line(&format!("h{i}"), i, i % 97 + 1000, ts)
                } else {
                    next += 1;
                    line(&format!("n{next}"), next, 1, now - 60_000)
                }
            })
            .collect()
    };
    let mut rates = Vec::new();
    for round in 0..2 {
        for (name, conflicts) in [("clean", false), ("storm_10pct", true)] {
            let lines = stream_of(conflicts);
            let (mut batches, found) = run(dir.path(), name, lines.into_iter(), &settings);
            rates.push((name, report(&format!("round {round} {name}"), stream, &mut batches, found)));
        }
    }
    let mean = |n: &str| {
        let r: Vec<f64> = rates.iter().filter(|(name, _)| *name == n).map(|(_, r)| *r).collect();
        r.iter().sum::<f64>() / r.len() as f64
    };
    println!("storm / clean throughput: {:.2}", mean("storm_10pct") / mean("clean"));
}
