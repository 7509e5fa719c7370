//! The offline demo: generated traffic through `dedupe`, with a bucket table.

use std::io::Write;
use std::path::PathBuf;

use super::sample::{generate, SampleCounts};
use super::{run_dedupe, DedupeOptions, OfflineError, Stdio, Summary};
use crate::classify::Clock;
use crate::config::EngineSettings;

/// Runs `events` generated events (plus their faults) through the offline
/// engine in `work_dir` and returns what went in and what came out.
pub fn run_offline_demo(
    events: u64,
    work_dir: &std::path::Path,
    settings: &EngineSettings,
    clock: &dyn Clock,
) -> Result<(SampleCounts, Summary, PathBuf), OfflineError> {
    let (records, counts) = generate(events, 42, clock.now_ms());
    let input = work_dir.join("input.ndjson");
    let io = |source| OfflineError::Io { what: "cannot write demo input", path: input.display().to_string(), source };
    let mut f = std::io::BufWriter::new(std::fs::File::create(&input).map_err(io)?);
    for r in &records {
        // Newlines inside a garbage record would split it; the generator
        // makes none, and JSON strings escape theirs.
        f.write_all(&r.bytes).map_err(io)?;
        f.write_all(b"\n").map_err(io)?;
    }
    f.flush().map_err(io)?;
    let opts = DedupeOptions {
        input: Stdio::File(input.clone()),
        output: Stdio::File(work_dir.join("accepted.ndjson")),
        state_dir: None,
        rejected: Some(work_dir.join("rejected.ndjson")),
        conflicts: Some(work_dir.join("conflicts.ndjson")),
        batch_records: 1000,
    };
    let summary = run_dedupe(&opts, settings, clock)?;
    Ok((counts, summary, work_dir.to_owned()))
}

/// The bucket table a person reads.
pub fn bucket_table(counts: &SampleCounts, summary: &Summary) -> String {
    let total = summary.accepted + summary.duplicates + summary.conflicts + summary.rejected;
    format!(
        "bucket       records   expected\n\
         accepted   {:>10} {:>10}\n\
         duplicate  {:>10} {:>10}\n\
         conflict   {:>10} {:>10}\n\
         rejected   {:>10} {:>10}\n\
         total      {:>10} {:>10}\n",
        summary.accepted,
        counts.distinct_events,
        summary.duplicates,
        counts.retries,
        summary.conflicts,
        counts.conflicts,
        summary.rejected,
        counts.invalid,
        total,
        counts.distinct_events + counts.retries + counts.conflicts + counts.invalid,
    )
}
