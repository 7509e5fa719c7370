//! `dedupd dedupe`: the engine over NDJSON files (DESIGN §9).
//!
//! The same pipeline as the Kafka worker, with files in place of topics:
//! the input file is the input topic (partition 0, offset = line index), the
//! output file is the output topic (offset = line index in the output file).
//!
//! Without `--state-dir` everything is in memory, bounded by the hot cache
//! capacity and the batch size. With `--state-dir` state persists across
//! runs, and the output file plays the output topic's role as the source of
//! truth (DESIGN §1.4): it is locked for the run and appended to, and a
//! restart first repairs local state from the output lines past the state's
//! checkpoint, then cuts a torn last line past it. So a crash between writing
//! an accepted event and applying it to state never doubles or drops it.
//!
//! Side files (`--rejected`, `--conflicts`) are reports, not sources of truth:
//! after a crash a rerun may write a report line again.
//!
//! With `--state-dir` and a regular input file, batches are decoded, validated and
//! hashed one batch ahead on a thread of their own (`Validation`), beside
//! the batch whose output and state are being written, and each batch's
//! usage-store append and WAL fsync are made beside the next batch
//! (`usage_writer.rs`; see `docs/ARCHITECTURE.md`).

mod demo;
mod lines;
mod report;
pub mod sample;
mod usage_writer;
pub use demo::{bucket_table, run_offline_demo};

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::ScopedJoinHandle;
use std::time::Instant;

use crate::classify::{validate_records, Clock, InputRecord, Outcome, SeenKey, Validated};
use crate::config::{EngineSettings, FsyncPolicy};
use crate::event::{id_hash, payload_hash, write_canonical_json, IdHash, Position, UsageEvent, Validator};
use crate::state::{LocalState, ReadCores, StateError, StoredEvent};

pub use lines::{read_bounded_line, Line};

/// The single partition offline mode uses.
pub const OFFLINE_PARTITION: i32 = 0;

/// Where a stream goes or comes from: a file or `-` (standard input/output).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stdio {
    Std,
    File(PathBuf),
}

impl std::str::FromStr for Stdio {
    type Err = String;
    fn from_str(s: &str) -> Result<Stdio, String> {
        if s.is_empty() {
            return Err("empty path".into());
        }
        Ok(if s == "-" { Stdio::Std } else { Stdio::File(PathBuf::from(s)) })
    }
}

/// What to dedupe, and where the buckets go.
#[derive(Clone, Debug)]
pub struct DedupeOptions {
    pub input: Stdio,
    pub output: Stdio,
    pub state_dir: Option<PathBuf>,
    pub rejected: Option<PathBuf>,
    pub conflicts: Option<PathBuf>,
    /// Records classified and published together.
    pub batch_records: usize,
}

/// The bucket counts of one run, printed as the last line on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub accepted: u64,
    pub duplicates: u64,
    pub conflicts: u64,
    pub rejected: u64,
}

/// Why an offline run stopped.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: String, source: io::Error },
    #[error(
        "--state-dir needs --output to be a regular file: the output file is the source of truth that state is repaired from"
    )]
    StateNeedsOutputFile,
    #[error(
        "output file {path} has {lines} lines but the state in {state_dir} has applied up to line {checkpoint} \
         (in {parts}): the output file was truncated or replaced, or that part of the state came from a later \
         copy (or reached the disk before the output under --fsync interval when the machine lost power); \
         restore the output file, or remove what is ahead ({parts} in the state directory: the next run rebuilds \
         it from the output), or start over with an empty state directory"
    )]
    StateAheadOfOutput { path: String, lines: u64, checkpoint: i64, state_dir: String, parts: String },
    #[error(
        "output file {path} is being written by another dedupd (a run with another state directory, or a second \
         run): an output file takes one writer, or its events would be published twice"
    )]
    OutputLocked { path: String },
    #[error("{first} {first_path} and {second} {second_path} are the same file: one would overwrite the other; give each its own file")]
    SameFile { first: &'static str, first_path: String, second: &'static str, second_path: String },
    #[error("{flag} {path} is inside the state directory {state_dir}: writing it would damage the state; name a file outside it")]
    InsideStateDir { flag: &'static str, path: String, state_dir: String },
    #[error("output file {path} line {line} is not a dedupd event ({why}); refusing to repair from it")]
    CorruptOutput { path: String, line: u64, why: String },
    #[error("the state directory's closed periods: {0}")]
    Periods(String),
    #[error(transparent)]
    State(#[from] StateError),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> OfflineError + 'a {
    move |source| OfflineError::Io { what, path: path.display().to_string(), source }
}

/// The output file or stdout, with the fsync policy applied per batch.
struct OutputSink {
    path: Option<PathBuf>,
    writer: BufWriter<Box<dyn Write>>,
    file: Option<File>,
    fsync: Option<FsyncPolicy>,
    last_sync: Instant,
    /// Offset the next output line gets.
    next_offset: i64,
}

impl OutputSink {
    fn write_line(&mut self, line: &str) -> Result<(), OfflineError> {
        let written = self.writer.write_all(line.as_bytes()).and_then(|()| self.writer.write_all(b"\n"));
        written.map_err(|source| self.write_error(source))
    }

    /// Makes the batch's lines visible, and durable as the policy says, before
    /// state is changed for them.
    fn end_batch(&mut self) -> Result<(), OfflineError> {
        self.sync_batch().map_err(|source| self.write_error(source))
    }

    fn sync_batch(&mut self) -> io::Result<()> {
        self.writer.flush()?;
        if let (Some(file), Some(policy)) = (&self.file, &self.fsync) {
            let due = match policy {
                FsyncPolicy::Always => true,
                FsyncPolicy::Interval(d) => self.last_sync.elapsed() >= *d,
            };
            if due {
                file.sync_data()?;
                self.last_sync = Instant::now();
            }
        }
        Ok(())
    }

    /// Flushes the last lines and syncs the file whatever the policy: the
    /// run's output is complete and durable when it returns (a regular
    /// file; a pipe or a device is only flushed).
    fn finish(&mut self) -> Result<(), OfflineError> {
        let synced = self.writer.flush().and_then(|()| self.file.as_ref().map_or(Ok(()), File::sync_all));
        synced.map_err(|source| self.write_error(source))
    }

    fn write_error(&self, source: io::Error) -> OfflineError {
        OfflineError::Io {
            what: "cannot write output",
            path: self.path.as_ref().map_or("standard output".into(), |p| p.display().to_string()),
            source,
        }
    }
}

/// Runs `dedupd dedupe`. Returns the bucket counts of this run.
pub fn run_dedupe(opts: &DedupeOptions, settings: &EngineSettings, clock: &dyn Clock) -> Result<Summary, OfflineError> {
    run_dedupe_with_progress(opts, settings, clock, &mut |_| {})
}

/// How far a run has got, reported after every batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Input lines read so far.
    pub records: u64,
    /// Input bytes read so far, newlines included.
    pub bytes: u64,
    pub summary: Summary,
}

/// [`run_dedupe`], calling `progress` after every batch (the binary draws a
/// progress bar with it when standard error is a terminal).
pub fn run_dedupe_with_progress(
    opts: &DedupeOptions,
    settings: &EngineSettings,
    clock: &dyn Clock,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Summary, OfflineError> {
    let validator = settings.validator();
    let batch_records = opts.batch_records.max(1);
    refuse_shared_files(opts)?;

    // The input is opened before any output is made or truncated, or any
    // state directory made: a mistyped `--input` must fail with every file
    // as it was (it emptied an existing output and reports before).
    //
    // Whether the input is a regular file, read at its own pace; a pipe
    // (standard input, or a path such as `/dev/stdin` or a shell's
    // `<(producer)`) may be a producer waiting for each batch's output.
    let (mut input, input_is_regular): (Box<dyn BufRead>, bool) = match &opts.input {
        Stdio::Std => {
            // Standard input redirected from a regular file (`< f`) reads
            // ahead like `--input f`; when that cannot be told, it does not.
            let regular = duplicate(io::stdin().as_fd()).and_then(|f| is_regular_file(&f)).unwrap_or(false);
            (Box::new(BufReader::with_capacity(1 << 16, io::stdin().lock())), regular)
        }
        Stdio::File(p) => {
            let f = File::open(p).map_err(io_err("cannot open input", p))?;
            let regular = is_regular_file(&f).map_err(io_err("cannot open input", p))?;
            (Box::new(BufReader::with_capacity(1 << 16, f)), regular)
        }
    };
    let input_name = match &opts.input {
        Stdio::Std => "standard input".to_owned(),
        Stdio::File(p) => p.display().to_string(),
    };

    let (state, mut output) = match &opts.state_dir {
        None => {
            // Without a state directory nothing outlives the run but its
            // output and counts: a ledger folded in memory would be dropped
            // unread at the end (it was 16% of such a run's CPU). So no
            // ledger here, whatever `--ledger` says.
            let mut state = LocalState::in_memory(EngineSettings { ledger: false, ..settings.clone() }, false);
            state.assign(OFFLINE_PARTITION, clock.now_ms())?;
            let output = open_fresh_output(&opts.output)?;
            (state, output)
        }
        Some(dir) => {
            let Stdio::File(path) = &opts.output else {
                return Err(OfflineError::StateNeedsOutputFile);
            };
            // Repair reads the output back and the next run appends to it: a
            // pipe or a device (`/dev/null`) would hand back nothing, and
            // state would be ahead of an output that keeps nothing. Refused
            // before the state directory is made or locked.
            match std::fs::metadata(path) {
                Ok(m) if !m.file_type().is_file() => return Err(OfflineError::StateNeedsOutputFile),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("cannot open output", path)(e)),
            }
            let mut state = LocalState::open(Some(dir), settings.clone(), false)?;
            // Periods closed with `dedupd period close --state-dir` take no
            // usage; the book is read once, at the start of the run.
            let book = crate::ledger::PeriodBook::load(dir).map_err(OfflineError::Periods)?;
            validator.closed_periods().replace(book.closed());
            state.assign(OFFLINE_PARTITION, clock.now_ms())?;
            let (file, lines) = repair_from_output(&mut state, path, dir, &validator, clock)?;
            let output = append_output(file, path, lines, settings.fsync.clone())?;
            (state, output)
        }
    };

    let mut rejected = report::open(opts.rejected.as_deref())?;
    let mut conflicts = report::open(opts.conflicts.as_deref())?;

    let limit = validator.limits().max_record_bytes;
    let mut summary = Summary::default();
    let mut derived_ids = 0u64;
    let mut line_text = String::with_capacity(512);
    let mut reading = Reading { limit, batch_records, next_line: 0, bytes_read: 0 };
    // With a state directory and a regular input file, batches are decoded,
    // validated and hashed (the stateless half of classification) on a
    // thread of their own, one batch ahead: batch N+1's while this thread
    // classifies, writes and applies batch N, much of which is waiting for
    // its two fsyncs. Without a state directory nothing waits, and two
    // threads took 1.6x the CPU for the same time on this 2-core machine.
    // From standard input or any other pipe, reading ahead would hold a
    // batch's output back until the next batch arrived, and a producer
    // waiting for it would wait forever. In both cases each batch is
    // validated here and the next is read only once this one is done. The
    // lines are read on this thread either way, so the other never blocks
    // on input: when this one returns, early or not, the channel closes and
    // that thread ends.
    std::thread::scope(|scope| -> Result<(), OfflineError> {
        let mut validation = if opts.state_dir.is_some() && input_is_regular {
            Validation::ahead(scope, &validator)?
        } else {
            Validation::Here { validator: &validator, waiting: None }
        };
        let mut read_next = |validation: &mut Validation<'_, '_>| -> Result<(), OfflineError> {
            let next = reading.batch(&mut input, &input_name, clock)?;
            if !next.lines.is_empty() {
                validation.submit(next);
            }
            Ok(())
        };
        let state = &state;
        // Each batch's usage-store append and WAL fsync are made beside the
        // next batch (see `usage_writer.rs`); without a state directory
        // there is no usage store. Conflicts' originals are read (below)
        // only when conflicts are reported.
        let mut usage_writer = match opts.state_dir {
            Some(_) => usage_writer::UsageWriter::start(scope, state, conflicts.is_some()),
            None => usage_writer::UsageWriter::inline(state),
        };
        // A batch's reports wait for its conflicts' originals, which are read
        // on a thread of their own while this one writes, syncs and applies
        // it and, reading ahead, classifies, writes, syncs and applies the
        // next: much of that is waiting on fsyncs. They are then written
        // after the next batch's apply, before its own reports. Offline that
        // order is safe: a conflict or a reject never changes state, so a
        // run stopped before its reports are written reports them again
        // when the input is run again.
        let mut waiting: Option<BatchReports<'_>> = None;
        let mut reading_now: Option<Originals<'_>> = None;
        let mut reports = Reports { conflicts: conflicts.as_mut(), rejected: rejected.as_mut() };
        // Called at once: every `?` of the run lands in `close`, which ends
        // the validating thread before the scope judges it.
        let run = (|| -> Result<(), OfflineError> {
            read_next(&mut validation)?;
            while let Some((batch, checked)) = validation.take() {
                // Ahead, the next batch goes to be validated before this one is
                // classified; a read error waits until this batch is done, as
                // it does when the next batch is read after it.
                let read_ahead = validation.is_ahead().then(|| read_next(&mut validation));
                let (first_offset, now_ms) = (batch.first_offset, batch.now_ms);
                let (records_end, bytes_end) = (batch.records_end, batch.bytes_end);
                let mut outcomes = state.classify_validated(OFFLINE_PARTITION, checked, now_ms)?.outcomes;
                // A record longer than the limit was read only in part; its
                // reason must say so whatever the part looks like.
                for (o, l) in outcomes.iter_mut().zip(&batch.lines) {
                    if l.truncated() {
                        *o = Outcome::Rejected(crate::event::Rejection::new(
                            crate::event::RejectReason::RecordTooLarge,
                            format!("{} bytes, limit {limit}", l.len),
                        ));
                    }
                }
                for o in &outcomes {
                    match o {
                        Outcome::Accepted { .. } => {}
                        Outcome::Duplicate { .. } | Outcome::Replayed { .. } => summary.duplicates += 1,
                        Outcome::Conflict { .. } => summary.conflicts += 1,
                        Outcome::Rejected(_) => summary.rejected += 1,
                    }
                }

                // The originals of conflicts with earlier batches, read together
                // (only when conflicts are reported, and only from a usage
                // store): one read per group, without the usage store's lock
                // (see `LocalState::originals_seen_at`). Held outside the batch
                // until its reports are made, so an error on the way still
                // joins the thread (see below).
                let wanted: Vec<(IdHash, i64)> = if reports.conflicts.is_some() && opts.state_dir.is_some() {
                    outcomes.iter().filter_map(Outcome::original_to_read).collect()
                } else {
                    Vec::new()
                };
                reading_now = Some(if wanted.is_empty() {
                    Originals::Known(Vec::new())
                } else {
                    // An original may be in a batch whose append is still
                    // to be made.
                    usage_writer.settle(wanted.iter().map(|(id, _)| *id))?;
                    let asked = wanted.clone();
                    let read = move || state.originals_seen_at(OFFLINE_PARTITION, &asked, ReadCores::BesideTheBatch);
                    match std::thread::Builder::new().name("dedupd-conflicts".into()).spawn_scoped(scope, read) {
                        Ok(thread) => Originals::Reading(thread),
                        // No thread to be had: read here, on every core.
                        Err(_) => {
                            Originals::Known(state.originals_seen_at(OFFLINE_PARTITION, &wanted, ReadCores::All)?)
                        }
                    }
                });
                let (published, accepted_in_batch) = publish_accepted(
                    &mut outcomes,
                    &mut output,
                    &mut line_text,
                    (first_offset, now_ms),
                    &mut summary,
                    &mut derived_ids,
                )?;
                // The originals of conflicts within the batch are its own
                // accepted events: copied now (only when conflicts are
                // reported), so the batch's events need not wait with its
                // reports.
                let in_batch = match reports.conflicts {
                    None => Default::default(),
                    Some(_) => outcomes
                        .iter()
                        .enumerate()
                        .filter_map(|(i, o)| match o {
                            Outcome::Conflict { first, .. } => first
                                .batch_index
                                .and_then(|j| accepted_in_batch[j])
                                .map(|k| (i, published[k].event.clone())),
                            _ => None,
                        })
                        .collect(),
                };
                // Only now, with the batch's output visible, does state change.
                let (_, append) = state.apply_published_append_later(OFFLINE_PARTITION, published, now_ms)?;
                // The state's upkeep comes with it (see `usage_writer.rs`).
                usage_writer.hand(append, now_ms)?;
                if let Some(last) = waiting.take() {
                    reports.write(last)?;
                }
                let originals = reading_now.take().unwrap_or(Originals::Known(Vec::new()));
                // Reading ahead (a regular input file), a batch whose originals are
                // still being read has its reports wait for the next batch;
                // from a pipe each batch's reports are written before
                // the next batch is read, so a producer waiting for them never
                // waits on its own next batch.
                let defer = validation.is_ahead() && matches!(originals, Originals::Reading(_));
                let this = BatchReports { batch, outcomes, in_batch, originals };
                if defer {
                    waiting = Some(this);
                } else {
                    reports.write(this)?;
                }
                progress(&Progress { records: records_end, bytes: bytes_end, summary });
                match read_ahead {
                    Some(read) => read?,
                    None => read_next(&mut validation)?,
                }
            }
            Ok(())
        })();
        // Every batch's append and WAL fsync has ended, or the first that
        // failed says why (a run that failed already keeps its own error).
        let run = match run {
            Ok(()) => usage_writer.finish(),
            Err(e) => {
                usage_writer.abandon();
                Err(e)
            }
        };
        // The last batch's reports. After an error: the failed batch's
        // reading is joined (a panic there logged, the run's error kept, as
        // `close` does for the validating thread), and a batch written and
        // applied before it still gets its reports.
        let run = match run {
            Ok(()) => waiting.take().map_or(Ok(()), |last| reports.write(last)),
            Err(e) => {
                if let Some(failed) = reading_now.take() {
                    drop(failed.settle());
                }
                if let Some(mut last) = waiting.take() {
                    if let Some(found) = last.originals.settle() {
                        last.originals = Originals::Known(found);
                        if let Err(w) = reports.write(last) {
                            tracing::warn!(error = %w, "writing the reports of the batch before the failed one");
                        }
                    }
                }
                Err(e)
            }
        };
        validation.close(run)
    })?;
    output.finish()?;
    report::finish(rejected.as_mut())?;
    report::finish(conflicts.as_mut())?;
    state.close()?;
    if derived_ids > 0 {
        tracing::info!(derived_ids, "accepted events whose event_id was derived from the business tuple");
    }
    Ok(summary)
}

/// A batch's conflicts' originals: read already (or none to read), or
/// being read on a thread of their own.
enum Originals<'scope> {
    Known(Vec<Option<UsageEvent>>),
    Reading(ScopedJoinHandle<'scope, Result<Vec<Option<UsageEvent>>, StateError>>),
}

impl Originals<'_> {
    /// The originals, in the order asked, once read; a panic while reading
    /// is raised here as its own.
    fn wait(self) -> Result<Vec<Option<UsageEvent>>, OfflineError> {
        match self {
            Originals::Known(found) => Ok(found),
            Originals::Reading(thread) => match thread.join() {
                Ok(found) => Ok(found?),
                Err(panic) => std::panic::resume_unwind(panic),
            },
        }
    }

    /// The originals once read, after the run has already failed: a read
    /// error or a panic is logged, not raised, so the run's own error is
    /// the one reported.
    fn settle(self) -> Option<Vec<Option<UsageEvent>>> {
        match self {
            Originals::Known(found) => Some(found),
            Originals::Reading(thread) => match thread.join() {
                Ok(Ok(found)) => Some(found),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "reading conflicts' originals failed after the run had");
                    None
                }
                Err(panic) => {
                    let what = (panic.downcast_ref::<&str>().copied())
                        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                        .unwrap_or("(no message)");
                    tracing::error!(panic = %what, "reading conflicts' originals panicked after the run had failed");
                    None
                }
            },
        }
    }
}

/// A batch written and applied, its reports not yet: what they are made of.
struct BatchReports<'scope> {
    batch: ReadBatch,
    outcomes: Vec<Outcome>,
    /// The originals of conflicts within the batch, by record: the batch's
    /// own accepted events.
    in_batch: std::collections::HashMap<usize, UsageEvent>,
    /// The originals of conflicts with earlier batches, in record order.
    originals: Originals<'scope>,
}

/// Where a run's reports go: the conflicts and rejected files asked for.
struct Reports<'w> {
    conflicts: Option<&'w mut report::ReportWriter>,
    rejected: Option<&'w mut report::ReportWriter>,
}

impl Reports<'_> {
    /// Writes one batch's conflicts (with the fields that differ from their
    /// originals, once read) and rejects, and ends the batch in each file.
    fn write(&mut self, done: BatchReports<'_>) -> Result<(), OfflineError> {
        let BatchReports { batch, outcomes, mut in_batch, originals } = done;
        let mut originals = originals.wait()?.into_iter();
        for (i, o) in outcomes.iter().enumerate() {
            let line_no = batch.first_offset as u64 + i as u64 + 1;
            match o {
                Outcome::Conflict { event, id_hash, payload_hash, tier, first } => {
                    if let Some(w) = self.conflicts.as_deref_mut() {
                        let original: Option<UsageEvent> = match first.batch_index {
                            Some(_) => in_batch.remove(&i),
                            None => originals.next().flatten(),
                        };
                        let differs = original.as_ref().map(|orig| orig.differing_fields(event));
                        w.conflict(
                            line_no,
                            event,
                            id_hash,
                            payload_hash,
                            *tier,
                            first,
                            differs.as_deref(),
                            &batch.lines[i],
                        )?;
                    }
                }
                Outcome::Rejected(rejection) => {
                    if let Some(w) = self.rejected.as_deref_mut() {
                        w.rejected(line_no, rejection, &batch.lines[i])?;
                    }
                }
                Outcome::Accepted { .. } | Outcome::Duplicate { .. } | Outcome::Replayed { .. } => {}
            }
        }
        report::end_batch(self.rejected.as_deref_mut())?;
        report::end_batch(self.conflicts.as_deref_mut())?;
        Ok(())
    }
}

/// Writes a batch's accepted events to the output (and syncs it, as the
/// fsync policy says), moving each out of its outcome into what the state
/// then applies. Returns those events, and for each record of the batch
/// where its event is among them.
fn publish_accepted(
    outcomes: &mut [Outcome],
    output: &mut OutputSink,
    line_text: &mut String,
    (first_offset, now_ms): (i64, i64),
    summary: &mut Summary,
    derived_ids: &mut u64,
) -> Result<(Vec<StoredEvent>, Vec<Option<usize>>), OfflineError> {
    // Sized up front: a batch's events grew it by doubling, copying each
    // event several times over (1% of the offline path).
    let mut published: Vec<StoredEvent> = Vec::with_capacity(outcomes.len());
    let mut accepted_in_batch: Vec<Option<usize>> = vec![None; outcomes.len()];
    for (i, o) in outcomes.iter_mut().enumerate() {
        if let Outcome::Accepted { event, id_hash, payload_hash } = o {
            line_text.clear();
            write_canonical_json(event, line_text);
            output.write_line(line_text)?;
            let key = SeenKey {
                id_hash: *id_hash,
                payload_hash: *payload_hash,
                first_seen_ms: now_ms,
                source: Position::new(OFFLINE_PARTITION, first_offset + i as i64),
                output: Position::new(OFFLINE_PARTITION, output.next_offset),
            };
            output.next_offset += 1;
            accepted_in_batch[i] = Some(published.len());
            if event.event_id_derived {
                *derived_ids += 1;
            }
            // Moved, not copied: from here on the outcome only counts as
            // accepted, and conflicts read the event from `published`.
            published.push(StoredEvent { key, event: std::mem::replace(event, UsageEvent::blank()) });
            summary.accepted += 1;
        }
    }
    output.end_batch()?;
    Ok((published, accepted_in_batch))
}

/// Where reading the input stands: the next line's offset and the bytes
/// read so far.
struct Reading {
    limit: usize,
    batch_records: usize,
    next_line: i64,
    bytes_read: u64,
}

/// One batch of input lines, as read, with the time it was read at (the
/// time it is validated against and its accepted events are first seen at).
struct ReadBatch {
    lines: Vec<Line>,
    first_offset: i64,
    now_ms: i64,
    /// Lines and bytes read up to the end of this batch, for progress.
    records_end: u64,
    bytes_end: u64,
}

impl ReadBatch {
    /// The batch as input records: line `i` is input offset
    /// `first_offset + i` of the one offline partition.
    fn records(&self) -> Vec<InputRecord<'_>> {
        self.lines
            .iter()
            .enumerate()
            .map(|(i, l)| InputRecord {
                source: Position::new(OFFLINE_PARTITION, self.first_offset + i as i64),
                payload: Some(&l.bytes[..]),
            })
            .collect()
    }

    /// The stateless half of classifying the batch: every line decoded,
    /// validated against the time it was read at, and hashed. One
    /// partition and no topic: placement does not apply.
    fn validate(&self, validator: &Validator) -> Validated {
        validate_records(validator, &self.records(), self.now_ms, None)
    }
}

impl Reading {
    /// The next batch of at most `batch_records` lines; empty at the end of
    /// the input.
    fn batch(
        &mut self,
        input: &mut impl BufRead,
        input_name: &str,
        clock: &dyn Clock,
    ) -> Result<ReadBatch, OfflineError> {
        let first_offset = self.next_line;
        let mut lines = Vec::with_capacity(self.batch_records);
        while lines.len() < self.batch_records {
            let mut l = Line::default();
            // The first line may start with a byte order mark, which is not
            // part of the record: room for it, so that a record at the limit
            // is kept whole once the mark is off.
            // The same for a CR ending the line (CRLF line ends).
            let limit = if self.next_line == 0 { self.limit + BYTE_ORDER_MARK.len() } else { self.limit } + 1;
            let more = read_bounded_line(input, limit, &mut l).map_err(|source| OfflineError::Io {
                what: "cannot read input",
                path: input_name.to_owned(),
                source,
            })?;
            if !more {
                break;
            }
            self.bytes_read += l.len + 1;
            if self.next_line == 0 {
                skip_byte_order_mark(&mut l);
            }
            // JSON would read the CR as white space; the size limit, and a
            // report of the line's size or bytes, must not count it.
            if l.ends_in_cr {
                if !l.truncated() {
                    l.bytes.pop();
                }
                l.len -= 1;
            }
            lines.push(l);
            self.next_line += 1;
        }
        Ok(ReadBatch {
            lines,
            first_offset,
            now_ms: clock.now_ms(),
            records_end: self.next_line as u64,
            bytes_end: self.bytes_read,
        })
    }
}

/// Where a batch read from the input is decoded, validated and hashed.
enum Validation<'scope, 'v> {
    /// On the batch's own thread, when it is taken.
    Here { validator: &'v Validator, waiting: Option<ReadBatch> },
    /// On a thread of its own, as soon as it is submitted.
    Ahead {
        to_validate: SyncSender<ReadBatch>,
        validated: Receiver<(ReadBatch, Validated)>,
        /// Whether a batch was submitted and not taken back yet.
        in_flight: bool,
        worker: Option<ScopedJoinHandle<'scope, ()>>,
    },
}

impl<'scope, 'v: 'scope> Validation<'scope, 'v> {
    fn ahead<'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        validator: &'v Validator,
    ) -> Result<Self, OfflineError> {
        // One batch at a time is submitted and not taken back: the lines in
        // memory are at most three batches' (the one being validated, the
        // one being written, and the one before it while its reports wait
        // for its conflicts' originals), beside the next batch's decoded
        // events.
        let (to_validate, validating) = sync_channel::<ReadBatch>(1);
        let (to_classify, validated) = sync_channel::<(ReadBatch, Validated)>(1);
        let worker = std::thread::Builder::new()
            .name("dedupd-validate".into())
            .spawn_scoped(scope, move || {
                for batch in validating {
                    let checked = batch.validate(validator);
                    if to_classify.send((batch, checked)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|source| OfflineError::Io {
                what: "cannot start thread",
                path: "dedupd-validate".into(),
                source,
            })?;
        Ok(Validation::Ahead { to_validate, validated, in_flight: false, worker: Some(worker) })
    }
}

impl Validation<'_, '_> {
    fn is_ahead(&self) -> bool {
        matches!(self, Validation::Ahead { .. })
    }

    /// Hands over the next batch, once the one before was taken.
    fn submit(&mut self, batch: ReadBatch) {
        match self {
            Validation::Here { waiting, .. } => {
                debug_assert!(waiting.is_none(), "a batch submitted before the last one was taken");
                *waiting = Some(batch);
            }
            Validation::Ahead { to_validate, in_flight, worker, .. } => {
                debug_assert!(!*in_flight, "a batch submitted before the last one was taken");
                if to_validate.send(batch).is_err() {
                    raise_validator_panic(worker.take());
                }
                *in_flight = true;
            }
        }
    }

    /// The batch submitted last, validated; `None` when none is waiting.
    fn take(&mut self) -> Option<(ReadBatch, Validated)> {
        match self {
            Validation::Here { validator, waiting } => {
                let batch = waiting.take()?;
                let checked = batch.validate(validator);
                Some((batch, checked))
            }
            Validation::Ahead { validated, in_flight, worker, .. } => {
                if !std::mem::take(in_flight) {
                    return None;
                }
                match validated.recv() {
                    Ok(answer) => Some(answer),
                    Err(_) => raise_validator_panic(worker.take()),
                }
            }
        }
    }

    /// Ends validation once the run is over, with `run`'s result: stops the
    /// validating thread and waits for it. An error of the batch's thread
    /// is the run's error even when the validating thread panicked on the
    /// batch after it; without the join here, the scope would replace that
    /// error with a panic of its own that names neither. The panic is
    /// logged (the panic hook has printed its message already).
    fn close(self, run: Result<(), OfflineError>) -> Result<(), OfflineError> {
        let Validation::Ahead { to_validate, validated, worker, .. } = self else {
            return run;
        };
        // Closed channels end the thread's loop, wherever it waits.
        drop((to_validate, validated));
        match (worker.map(ScopedJoinHandle::join), run) {
            (Some(Err(panic)), Err(e)) => {
                tracing::error!(
                    error = %e,
                    "the validating thread of dedupd dedupe panicked on the next batch; the run ends with this batch's error"
                );
                drop(panic);
                Err(e)
            }
            // Every batch submitted was taken, each answered: a panic after
            // the last cannot be, but is not hidden if it is.
            (Some(Err(panic)), Ok(())) => std::panic::resume_unwind(panic),
            (_, run) => run,
        }
    }
}

/// UTF-8's byte order mark, which some Windows tools write at the start of
/// a text file.
const BYTE_ORDER_MARK: &[u8] = b"\xEF\xBB\xBF";

/// Takes a byte order mark off the input's first line: it marks the file,
/// not the first record, and left on, that record (a real usage event)
/// would be rejected as malformed JSON. Only the input's very start is a
/// byte order mark; one anywhere else stays part of its line.
fn skip_byte_order_mark(first: &mut Line) {
    if first.bytes.starts_with(BYTE_ORDER_MARK) {
        first.bytes.drain(..BYTE_ORDER_MARK.len());
        first.len -= BYTE_ORDER_MARK.len() as u64;
    }
}

/// The validating thread stopped answering, which it does only by
/// panicking (it ends on its own only once this side has gone): its panic
/// is raised here again, with its own message.
fn raise_validator_panic(worker: Option<ScopedJoinHandle<'_, ()>>) -> ! {
    match worker.map(ScopedJoinHandle::join) {
        Some(Err(panic)) => std::panic::resume_unwind(panic),
        _ => panic!("the validating thread of dedupd dedupe ended while a batch was waiting for it"),
    }
}

fn open_fresh_output(output: &Stdio) -> Result<OutputSink, OfflineError> {
    Ok(match output {
        Stdio::Std => OutputSink {
            path: None,
            writer: BufWriter::with_capacity(1 << 16, Box::new(io::stdout())),
            file: None,
            fsync: None,
            last_sync: Instant::now(),
            next_offset: 0,
        },
        Stdio::File(p) => {
            // Locked before it is emptied: a run with a state directory may
            // be writing this file, the source of truth its state is
            // repaired from, and truncating it under that run loses events
            // billing has read.
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .map_err(io_err("cannot create output", p))?;
            // Only a regular file is synced (see `is_regular_file`):
            // `--output /dev/null` counts without writing anything down.
            let regular = is_regular_file(&f).map_err(io_err("cannot open output", p))?;
            if regular {
                lock_output(&f, p)?;
                f.set_len(0).map_err(io_err("cannot create output", p))?;
            }
            let clone = if regular { Some(f.try_clone().map_err(io_err("cannot open output", p))?) } else { None };
            OutputSink {
                path: Some(p.clone()),
                writer: BufWriter::with_capacity(1 << 16, Box::new(f)),
                file: clone,
                fsync: None,
                last_sync: Instant::now(),
                next_offset: 0,
            }
        }
    })
}

/// Takes the run's exclusive `flock` on its output file, or fails at once:
/// one writer per output file, whatever its state directory. Held while
/// any descriptor of this open file lives (the sink's writer and its
/// clone), so until the run ends.
fn lock_output(f: &File, path: &Path) -> Result<(), OfflineError> {
    if !fs4::fs_std::FileExt::try_lock_exclusive(f).map_err(io_err("cannot lock output", path))? {
        return Err(OfflineError::OutputLocked { path: path.display().to_string() });
    }
    Ok(())
}

/// The run's writer of the output file that repair opened and locked: it
/// appends after the whole lines, and its descriptors keep the lock until
/// the run ends.
fn append_output(mut f: File, path: &Path, lines: u64, fsync: FsyncPolicy) -> Result<OutputSink, OfflineError> {
    f.seek(SeekFrom::End(0)).map_err(io_err("cannot open output", path))?;
    let clone = f.try_clone().map_err(io_err("cannot open output", path))?;
    Ok(OutputSink {
        path: Some(path.to_owned()),
        writer: BufWriter::with_capacity(1 << 16, Box::new(f)),
        file: Some(clone),
        fsync: Some(fsync),
        last_sync: Instant::now(),
        next_offset: lines as i64,
    })
}

/// Locks the output file for this run, applies every output line past the
/// state's checkpoint to state, then cuts a torn last line. Returns the
/// file, still locked, and the number of whole lines in it.
fn repair_from_output(
    state: &mut LocalState,
    path: &Path,
    state_dir: &Path,
    validator: &Validator,
    clock: &dyn Clock,
) -> Result<(File, u64), OfflineError> {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_err("cannot open output", path))?;
    // Checked before the state was opened too; here for the file actually
    // opened.
    if !is_regular_file(&f).map_err(io_err("cannot open output", path))? {
        return Err(OfflineError::StateNeedsOutputFile);
    }
    // One writer per output file: the state directory's lock does not stop
    // a run on another state directory from appending the same events to
    // the same file, which would publish them twice.
    lock_output(&f, path)?;
    // A torn last line is cut only once it is known to lie past what the
    // state applied: a line the state applied went out whole, so a missing
    // end there is damage to the source of truth, never a torn write.
    let whole = whole_lines_end(&mut f).map_err(io_err("cannot read output", path))?;
    f.seek(SeekFrom::Start(0)).map_err(io_err("cannot read output", path))?;

    // Repair reads from where every part of the state has applied; the
    // output must reach where any part has: one part restored from a later
    // copy than the output (or kept by a disk that lost the output's last
    // writes) holds events the output does not, and going on would skip the
    // next run's events at those offsets in that part.
    let (checkpoint, furthest) = (state.checkpoint(OFFLINE_PARTITION), state.furthest_checkpoint(OFFLINE_PARTITION));
    let parts_before = state.checkpoints_by_part(OFFLINE_PARTITION);
    let mut reader = BufReader::with_capacity(1 << 16, (&f).take(whole.end));
    let mut line = Line::default();
    // Output lines were accepted under whatever limits were in force then;
    // reading them back applies none of today's (a lowered limit must not
    // make existing output unreadable), only a fixed memory ceiling.
    let limit = crate::event::OUTPUT_READ_CEILING_BYTES;
    let mut offset: i64 = 0;
    let mut pending: Vec<StoredEvent> = Vec::new();
    let mut repaired = 0usize;
    let now_ms = clock.now_ms();
    while read_bounded_line(&mut reader, limit, &mut line).map_err(io_err("cannot read output", path))? {
        if checkpoint.is_none_or(|c| offset > c) {
            let corrupt = |why: String| OfflineError::CorruptOutput {
                path: path.display().to_string(),
                line: offset as u64 + 1,
                why,
            };
            if line.truncated() {
                return Err(corrupt(format!("line of {} bytes is longer than any event", line.len)));
            }
            let event = validator.read_output(&line.bytes).map_err(|r| corrupt(r.to_string()))?;
            let position = Position::new(OFFLINE_PARTITION, offset);
            let key = SeenKey {
                id_hash: id_hash(&event.tenant_id, &event.event_id),
                payload_hash: payload_hash(&event),
                // The output file does not keep ingest times; the repair time
                // is a safe stand-in: it can only make a key live longer.
                first_seen_ms: now_ms,
                source: position,
                output: position,
            };
            pending.push(StoredEvent { key, event });
            if pending.len() >= 1000 {
                repaired += state.apply_published(OFFLINE_PARTITION, &pending, now_ms)?;
                pending.clear();
            }
        }
        offset += 1;
    }
    repaired += state.apply_published(OFFLINE_PARTITION, &pending, now_ms)?;
    if let Some(c) = furthest {
        if c >= offset && whole.torn > 0 {
            return Err(OfflineError::CorruptOutput {
                path: path.display().to_string(),
                line: offset as u64 + 1,
                why: format!(
                    "its last {} bytes end without a newline, but the state in {} applied this line: it was \
                     written whole and cut since (restore the file's end; if only the newline is missing, add it)",
                    whole.torn,
                    state_dir.display()
                ),
            });
        }
        if c >= offset {
            let ahead: Vec<&str> = parts_before
                .iter()
                .filter(|(_, cp)| cp.is_some_and(|cp| cp >= offset))
                .map(|(part, _)| *part)
                .collect();
            return Err(OfflineError::StateAheadOfOutput {
                path: path.display().to_string(),
                lines: offset as u64,
                checkpoint: c + 1,
                state_dir: state_dir.display().to_string(),
                parts: ahead.join(", "),
            });
        }
    }
    if whole.torn > 0 {
        tracing::warn!(cut_bytes = whole.torn, "cut a torn last line from the output file");
        f.set_len(whole.end).map_err(io_err("cannot repair output", path))?;
        f.sync_all().map_err(io_err("cannot repair output", path))?;
    }
    if repaired > 0 {
        tracing::info!(repaired, "repaired state from the output file");
    }
    Ok((f, offset as u64))
}

/// Refuses a run whose input, output and report files are not all
/// different files, or whose outputs lie inside the state directory,
/// before any file is opened: the output is created (truncated) first, so
/// `--input f --output f` would destroy the input and count nothing, and
/// two outputs on one file or pipe would write over or into each other. A
/// device (`/dev/null` for every output, a terminal) may be named more than
/// once. `-` is checked as what standard input or output really is.
fn refuse_shared_files(opts: &DedupeOptions) -> Result<(), OfflineError> {
    let named: [(&'static str, &'static str, Option<Named>); 4] = [
        ("--input", "cannot open input", Named::of(&opts.input, Named::Stdin)),
        ("--output", "cannot create output", Named::of(&opts.output, Named::Stdout)),
        ("--rejected", "cannot create report", opts.rejected.clone().map(Named::Path)),
        ("--conflicts", "cannot create report", opts.conflicts.clone().map(Named::Path)),
    ];
    // Resolved whether made yet or not: a report named inside a directory
    // this run is about to make would be written over its files (RocksDB's
    // `CURRENT`, say) once it is made.
    let state_dir = opts.state_dir.as_deref().and_then(resolved);
    let mut seen: Vec<(&'static str, String, FileIdentity)> = Vec::with_capacity(named.len() + 1);
    // The state directory itself, made yet or not: an output of the same
    // name would make it a file, or fail on the directory after it was made.
    if let Some(dir) = &opts.state_dir {
        let shown = dir.display().to_string();
        let id = Named::Path(dir.clone()).identity().map_err(|source| OfflineError::Io {
            what: "cannot open state directory",
            path: shown.clone(),
            source,
        })?;
        seen.extend(id.map(|id| ("--state-dir", shown, id)));
    }
    for (flag, what, named) in named {
        let Some(named) = named else { continue };
        let shown = named.to_string();
        if let (Some(state), Named::Path(p), false) = (&state_dir, &named, flag == "--input") {
            // The file as it would be written, through any link on its way.
            // (Named as the directory itself, it is refused as the same file.)
            if resolved(p).is_some_and(|file| file != *state && file.starts_with(state)) {
                return Err(OfflineError::InsideStateDir { flag, path: shown, state_dir: state.display().to_string() });
            }
        }
        let Some(id) = named.identity().map_err(|source| OfflineError::Io { what, path: shown.clone(), source })?
        else {
            continue;
        };
        if let Some((first, first_path, _)) = seen.iter().find(|(_, _, other)| *other == id) {
            return Err(OfflineError::SameFile {
                first,
                first_path: first_path.clone(),
                second: flag,
                second_path: shown,
            });
        }
        seen.push((flag, shown, id));
    }
    Ok(())
}

/// A file named on the command line: a path, or `-`.
enum Named {
    Path(PathBuf),
    Stdin,
    Stdout,
}

impl Named {
    fn of(s: &Stdio, std: Named) -> Option<Named> {
        Some(match s {
            Stdio::Std => std,
            Stdio::File(p) => Named::Path(p.clone()),
        })
    }

    /// Which file this is, or `None` for one that may be named twice (a
    /// device) or that cannot be opened anyway (its directory is missing:
    /// the open fails later and says so).
    fn identity(&self) -> io::Result<Option<FileIdentity>> {
        let m = match self {
            Named::Path(p) => match std::fs::metadata(p) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return not_made_yet(p),
                Err(e) => return Err(e),
            },
            Named::Stdin => duplicate(io::stdin().as_fd())?.metadata()?,
            Named::Stdout => duplicate(io::stdout().as_fd())?.metadata()?,
        };
        Ok(FileIdentity::of(&m))
    }
}

impl std::fmt::Display for Named {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Named::Path(p) => write!(f, "{}", p.display()),
            Named::Stdin => f.write_str("- (standard input)"),
            Named::Stdout => f.write_str("- (standard output)"),
        }
    }
}

/// Standard input or output as a `File` of its own (a duplicate of its
/// descriptor, closed when dropped), to ask what it is.
fn duplicate(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<File> {
    Ok(File::from(fd.try_clone_to_owned()?))
}

/// One file, however it is spelled: by device and inode (a hard link, a
/// symlink, `a/../f` and `./f` are the same file), or, not made yet, by its
/// directory's device and inode and its name.
#[derive(PartialEq)]
enum FileIdentity {
    Inode(u64, u64),
    Entry(u64, u64, std::ffi::OsString),
}

impl FileIdentity {
    /// Regular files, directories, pipes and sockets; devices are not kept
    /// (writing one twice loses nothing, or shows both on a terminal).
    fn of(m: &std::fs::Metadata) -> Option<FileIdentity> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let t = m.file_type();
        (!t.is_char_device() && !t.is_block_device()).then(|| FileIdentity::Inode(m.dev(), m.ino()))
    }
}

/// The identity of a path with no file behind it yet. A dangling symlink
/// is followed to the file `File::create` would make.
fn not_made_yet(path: &Path) -> io::Result<Option<FileIdentity>> {
    use std::os::unix::fs::MetadataExt;
    let path = resolved(path).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "its symbolic links cannot be read or loop past 40")
    })?;
    let Some(name) = path.file_name() else { return Ok(None) };
    match std::fs::metadata(directory_of(&path)) {
        Ok(d) => Ok(Some(FileIdentity::Entry(d.dev(), d.ino(), name.to_owned()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `path` made absolute with every symbolic link followed, whether it
/// exists or not: where the file system would put the file `path` names.
/// A link is followed where it points even when nothing is there yet (a
/// dangling link, which creating the file through it would make), and a
/// missing name is taken as written. `None` when the current directory is
/// unknown, a link cannot be read, or more than 40 links are followed.
fn resolved(path: &Path) -> Option<PathBuf> {
    use std::path::Component;
    let mut left: Vec<std::ffi::OsString> = Vec::new();
    let push_parts = |left: &mut Vec<std::ffi::OsString>, p: &Path| {
        // Reversed, so the next part to walk is the last.
        for part in p.components().rev() {
            match part {
                Component::Normal(name) => left.push(name.to_owned()),
                Component::ParentDir => left.push("..".into()),
                Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
            }
        }
    };
    push_parts(&mut left, &std::path::absolute(path).ok()?);
    let mut out = PathBuf::from("/");
    // A bound on the links followed; the kernel's own is 40.
    let mut links = 0;
    while let Some(name) = left.pop() {
        if name == ".." {
            out.pop();
            continue;
        }
        let next = out.join(&name);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > 40 {
                    return None;
                }
                let target = std::fs::read_link(&next).ok()?;
                if target.is_absolute() {
                    out = PathBuf::from("/");
                }
                push_parts(&mut left, &target);
            }
            _ => out = next,
        }
    }
    Some(out)
}

/// The directory a file `path` names is made in (`.` for a bare name).
fn directory_of(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Whether `f` is a regular file: the only kind whose fsync means something
/// (a pipe or a device has nothing to make durable, and fsync of one fails
/// with EINVAL).
pub(super) fn is_regular_file(f: &File) -> io::Result<bool> {
    Ok(f.metadata()?.file_type().is_file())
}

/// Where the output file's whole lines end, and how many bytes follow
/// them (a torn last line, written partly when the process died).
struct WholeLines {
    end: u64,
    torn: u64,
}

fn whole_lines_end(f: &mut File) -> io::Result<WholeLines> {
    let len = f.metadata()?.len();
    let mut pos = len;
    let mut buf = vec![0u8; 64 * 1024];
    while pos > 0 {
        let start = pos.saturating_sub(buf.len() as u64);
        let n = (pos - start) as usize;
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            let end = start + i as u64 + 1;
            return Ok(WholeLines { end, torn: len - end });
        }
        pos = start;
    }
    Ok(WholeLines { end: 0, torn: len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_batch() -> ReadBatch {
        ReadBatch { lines: Vec::new(), first_offset: 0, now_ms: 0, records_end: 0, bytes_end: 0 }
    }

    /// The batch's thread fails (its output cannot be written, say) while
    /// the validating thread panics on the batch after it: the run ends with
    /// the batch's error, not with the scope's panic about a thread.
    #[test]
    fn a_batchs_error_is_the_runs_error_when_validating_the_next_batch_panicked() {
        let result = std::thread::scope(|scope| {
            let (to_validate, validating) = sync_channel::<ReadBatch>(1);
            let (_to_classify, validated) = sync_channel::<(ReadBatch, Validated)>(1);
            let worker = scope.spawn(move || {
                if validating.recv().is_ok() {
                    panic!("a bug in validating the next batch");
                }
            });
            let mut validation = Validation::Ahead { to_validate, validated, in_flight: false, worker: Some(worker) };
            validation.submit(empty_batch());
            validation.close(Err(OfflineError::StateNeedsOutputFile))
        });
        assert!(matches!(result, Err(OfflineError::StateNeedsOutputFile)), "{result:?}");
    }

    /// A batch's originals read on a thread that panicked: waited for on
    /// a run going well, the panic is raised with its own message; settled
    /// after the run has failed, it is logged and the run's error stands.
    #[test]
    fn a_panic_reading_originals_is_its_own_and_never_hides_a_run_error() {
        fn reading<'scope>(scope: &'scope std::thread::Scope<'scope, '_>) -> Originals<'scope> {
            let thread = std::thread::Builder::new()
                .spawn_scoped(scope, || -> Result<Vec<Option<UsageEvent>>, StateError> {
                    panic!("a bug in reading originals")
                })
                .expect("thread");
            Originals::Reading(thread)
        }
        let raised = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            std::thread::scope(|scope| reading(scope).wait().map(|found| found.len()))
        }));
        let message = raised.expect_err("waited for, the panic is raised");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"a bug in reading originals"));
        let settled = std::thread::scope(|scope| reading(scope).settle());
        assert!(settled.is_none());
        let known = std::thread::scope(|_| Originals::Known(vec![None, None]).settle());
        assert_eq!(known.map(|found| found.len()), Some(2));
    }

    /// A run that went well ends the validating thread and stays well:
    /// the join comes after the channels close (joined before, the thread
    /// would wait for its next batch and this test would hang).
    #[test]
    fn closing_after_a_good_run_returns_ok_once_the_validating_thread_ended() {
        let validator = EngineSettings::default().validator();
        let result = std::thread::scope(|scope| {
            let mut validation = Validation::ahead(scope, &validator)?;
            validation.submit(empty_batch());
            assert!(validation.take().is_some());
            validation.close(Ok(()))
        });
        assert!(result.is_ok(), "{result:?}");
    }
}
