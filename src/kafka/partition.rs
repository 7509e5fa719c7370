//! The pipeline of one assigned input partition: repair, then batches of
//! classify → publish → apply (→ commit, at-least-once), one batch at a time.
//!
//! One batch at a time is what makes classification exact: a batch is
//! classified against state that already holds every earlier batch of the
//! partition. Parallelism comes from partitions, each its own task.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, watch};

use crate::event::Position;
use crate::kafka::batch::{classify_batch, BatchInput, DeferredRollups, Prepared};
use crate::kafka::engine::{read_engine, write_engine, Engine};
use crate::kafka::error::KafkaError;
use crate::kafka::publisher::{PublishError, Published};
use crate::kafka::records::OutRecord;
use crate::kafka::repair::{monotonic_ms, RepairClients, RepairOutcome};
use crate::kafka::worker::{InputQueue, Shared};
use crate::metrics::{PublishRetried, RepairCompleted, Stage, StageTimed};
use crate::pipeline::{BatchFailure, Event, PartitionLife, Step};

/// How often an idle partition task polls its queue again (see the idle
/// branch of [`pipeline`]).
const IDLE_REPOLL: Duration = Duration::from_millis(250);

/// What the worker knows of one partition's progress, shared between its
/// task (which writes it) and the statistics callback (which turns it into
/// lag, head-age and stall gauges). Atomics: written once per batch, read
/// once a second, never a reason to block either side.
#[derive(Debug)]
pub(crate) struct PartitionProgress {
    /// The assignment was lost (session timeout): the task abandons its
    /// in-flight batch instead of finishing it, because another member may
    /// already own the partition.
    pub lost: Arc<AtomicBool>,
    /// True while repair runs: repair has its own no-progress deadline, and
    /// a long repair is not a stall.
    pub repairing: AtomicBool,
    /// Wall-clock ms of the last sign of progress: a batch done, or an idle
    /// poll that found no input.
    pub last_progress_ms: AtomicI64,
    /// The next input offset this task will process; -1 until known.
    pub next_offset: AtomicI64,
    /// Append time (ms) of the last input record processed; -1 until known.
    pub last_record_ms: AtomicI64,
}

impl PartitionProgress {
    pub(crate) fn new(now_ms: i64) -> PartitionProgress {
        PartitionProgress {
            lost: Arc::new(AtomicBool::new(false)),
            repairing: AtomicBool::new(true),
            last_progress_ms: AtomicI64::new(now_ms),
            next_offset: AtomicI64::new(-1),
            last_record_ms: AtomicI64::new(-1),
        }
    }

    fn progressed(&self, now_ms: i64) {
        self.last_progress_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Stalled: not repairing, and no progress for `stall_ms` while the
    /// partition has input (`lag` > 0, or a batch is in flight, which shows
    /// as no progress since it began).
    pub(crate) fn stalled(&self, now_ms: i64, stall_ms: i64, lag: Option<i64>) -> bool {
        if self.repairing.load(Ordering::Relaxed) || lag == Some(0) {
            return false;
        }
        now_ms.saturating_sub(self.last_progress_ms.load(Ordering::Relaxed)) > stall_ms
    }
}

/// The batch a partition has in flight, between the core's steps.
#[derive(Default)]
struct InFlight {
    messages: Arc<Vec<OwnedMessage>>,
    prepared: Option<Prepared>,
    published: Option<Published>,
    /// Event time of the classification (the injectable clock).
    now_ms: i64,
}

/// Runs the pipeline of `partition` until `stop` flips or the queue ends.
/// `_done` is dropped when the task ends, however it ends: the rebalance
/// callback waits on it before giving the partition up.
pub(crate) async fn run_partition(
    shared: Arc<Shared>,
    partition: i32,
    queue: InputQueue,
    mut stop: watch::Receiver<bool>,
    mut strays: mpsc::UnboundedReceiver<OwnedMessage>,
    progress: Arc<PartitionProgress>,
    _done: std::sync::mpsc::Sender<()>,
) {
    let result = pipeline(&shared, partition, &queue, &mut stop, &mut strays, &progress).await;
    let engine = shared.engine.clone();
    let _ = tokio::task::spawn_blocking(move || write_engine(&engine).revoke(partition)).await;
    if let Err(e) = result {
        shared.fail(e);
    }
}

/// The rdkafka driver of [`PartitionLife`]: performs each step the core asks
/// for and reports what happened. Every decision of order (repair first,
/// publish before apply, what a revoke or a lost assignment abandons) is
/// the core's.
async fn pipeline(
    shared: &Arc<Shared>,
    partition: i32,
    queue: &InputQueue,
    stop: &mut watch::Receiver<bool>,
    strays: &mut mpsc::UnboundedReceiver<OwnedMessage>,
    progress: &Arc<PartitionProgress>,
) -> Result<(), KafkaError> {
    let mut settings = shared.repairer.life_settings(partition, shared.settings.delivery);
    let rollups_partitions = shared.batch_layout().rollups_partitions;
    if rollups_partitions.is_some() && !shared.settings.rollups_interval.is_zero() {
        settings.hold_rollups_ms =
            Some(i64::try_from(shared.settings.rollups_interval.as_millis()).unwrap_or(i64::MAX));
    }
    let (mut life, mut step) = PartitionLife::assigned(settings, monotonic_ms());
    let mut batch = InFlight::default();
    // Rollups of published batches the core holds back; dropped with the
    // partition, whose next owner replays those batches (their input
    // offsets were not committed).
    let mut deferred = DeferredRollups::default();
    let mut clients: Option<RepairClients> = None;
    let mut repair = RepairOutcome { from_offset: -1, records: 0, duration: Duration::ZERO };
    let mut repair_started = Instant::now();
    let mut assignment_repaired = false;
    let mut revoke_told = false;
    loop {
        if !revoke_told && *stop.borrow() {
            revoke_told = true;
            if let Some(release) = life.revoke(progress.lost.load(Ordering::SeqCst)) {
                step = release;
            }
        }
        let event = match step {
            Step::Release { commit_first } => {
                if life.lost() && !batch.messages.is_empty() {
                    tracing::warn!(
                        partition,
                        "assignment lost: abandoned the in-flight batch; the next owner consumes it"
                    );
                    shared.batches_abandoned.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(next) = commit_first {
                    // Sent, not awaited: librdkafka holds the group back
                    // until its outstanding commits are answered, both after
                    // a revoke (the rebalance goes on only then) and in
                    // close. The answer itself cannot reach this task: the
                    // consumer's queue, where it arrives, is served by the
                    // poll that is running this revoke, or by none once the
                    // worker is stopping. Waiting for it here cost every
                    // revoke and every stop three seconds and gained nothing.
                    commit_input(shared, partition, next);
                }
                return Ok(());
            }
            Step::Stop(e) => return Err(KafkaError::from_life(e, &shared.settings.topics.output, partition)),
            Step::Wait { until_ms } => {
                let wait = Duration::from_millis(u64::try_from(until_ms - monotonic_ms()).unwrap_or(0));
                tokio::select! {
                    biased;
                    // Back to the top: the core decides whether the revoke
                    // interrupts this wait; if not, the wait goes on.
                    _ = stop.changed(), if !revoke_told => continue,
                    _ = tokio::time::sleep(wait) => Event::Waited,
                }
            }
            Step::Load { .. }
            | Step::ProbeOutputEnd
            | Step::ProbeStableEnd
            | Step::FindHorizonStart { .. }
            | Step::ReadOutput { .. } => {
                let revoked = stop.clone();
                // Only the core's interruptible repairs may be abandoned
                // midway (an assignment's; a retry's when lost).
                let assignment = life.interruptible(false);
                let p = progress.clone();
                let abandon = move || *revoked.borrow() && (assignment || p.lost.load(Ordering::SeqCst));
                let s = shared.clone();
                let this = step.clone();
                let (back, outcome, result) = tokio::task::spawn_blocking(move || {
                    let mut c = clients;
                    let mut outcome = repair;
                    let r = s.repairer.perform(&mut c, partition, &this, &abandon, &mut outcome);
                    (c, outcome, r)
                })
                .await
                .map_err(join_error)?;
                clients = back;
                repair = outcome;
                match result? {
                    Some(event) => event,
                    // Abandoned: back to the top, where the revoke is told.
                    None => continue,
                }
            }
            Step::Collect => match collect(shared, partition, queue, stop, strays, progress, &mut batch).await {
                Some(event) => event,
                None => continue,
            },
            Step::Classify => {
                let started = Instant::now();
                batch.now_ms = shared.clock.now_ms();
                let (s, b, now_ms) = (shared.clone(), batch.messages.clone(), batch.now_ms);
                let prepared = tokio::task::spawn_blocking(move || prepare(&s, partition, &b, now_ms))
                    .await
                    .map_err(join_error)??;
                StageTimed { stage: Stage::classify, duration: started.elapsed() }.emit(&shared.metrics);
                let mut prepared = prepared;
                if let Some(earlier) = &batch.prepared {
                    prepared.counted_as(&earlier.summary);
                }
                batch.prepared = Some(prepared);
                Event::Classified
            }
            Step::Publish { next_input, offsets_in_transaction, flush_rollups } => {
                // The records are moved out, not copied (a copy of an
                // accepted event's record was eight allocations: key,
                // value, the header list and its five headers): a publish
                // is tried once per classification, and a failed one
                // classifies the batch again after its repair (see `Life`).
                let (mut records, rollups) = match batch.prepared.as_mut() {
                    Some(p) => (std::mem::take(&mut p.records), p.rollups.as_slice()),
                    None => (Vec::new(), &[][..]),
                };
                if let (Some(n), true) = (rollups_partitions, flush_rollups) {
                    records.extend(deferred.records(rollups, partition, n, batch.now_ms));
                }
                let offsets = offsets_in_transaction.then_some(next_input);
                match publish(shared, partition, records, offsets, progress).await? {
                    Ok(p) => {
                        batch.published = Some(p);
                        if flush_rollups {
                            deferred.clear();
                        } else if let Some(prepared) = batch.prepared.as_mut() {
                            // Not needed again: the apply takes the events.
                            deferred.hold(std::mem::take(&mut prepared.rollups));
                        }
                        Event::Published
                    }
                    Err(failure) => {
                        tracing::warn!(partition, detail = %failure.detail, reason = failure.reason, "publish failed; repairing, then retrying the batch");
                        Event::PublishFailed(failure)
                    }
                }
            }
            Step::PublishRollups => {
                let records = match rollups_partitions {
                    Some(n) => deferred.records(&[], partition, n, shared.clock.now_ms()),
                    None => Vec::new(),
                };
                match publish(shared, partition, records, None, progress).await? {
                    Ok(_) => {
                        deferred.clear();
                        Event::Published
                    }
                    Err(failure) => {
                        tracing::warn!(partition, detail = %failure.detail, reason = failure.reason, "publishing held rollups failed; retrying");
                        Event::PublishFailed(failure)
                    }
                }
            }
            Step::Apply => {
                apply(shared, partition, &mut batch).await?;
                Event::Applied
            }
            Step::CommitInput { next_input } => {
                let started = Instant::now();
                commit_input(shared, partition, next_input);
                StageTimed { stage: Stage::commit, duration: started.elapsed() }.emit(&shared.metrics);
                Event::CommitSent
            }
        };
        let was_repairing = life.repairing();
        let batches = life.batches();
        step = life.on(event, monotonic_ms());
        if was_repairing && !life.repairing() {
            clients = None;
            if !life.ended() {
                repair.duration = repair_started.elapsed();
                RepairCompleted {
                    partition,
                    from_offset: repair.from_offset,
                    records: repair.records,
                    duration: repair.duration,
                }
                .emit(&shared.metrics);
                repair = RepairOutcome { from_offset: -1, records: 0, duration: Duration::ZERO };
                if !assignment_repaired {
                    assignment_repaired = true;
                    progress.progressed(wall_ms());
                    progress.repairing.store(false, Ordering::Relaxed);
                    shared.partition_repaired(partition);
                }
            }
        } else if !was_repairing && life.repairing() {
            repair_started = Instant::now();
        }
        if life.batches() > batches {
            finish_batch(shared, progress, std::mem::take(&mut batch));
        }
    }
}

/// Publishes `records` (with the input offset `offsets` in the transaction,
/// exactly once) and times it. `Ok(Err(..))`: a retriable failure, counted;
/// `Err`: one that stops the worker.
async fn publish(
    shared: &Arc<Shared>,
    partition: i32,
    records: Vec<OutRecord>,
    offsets: Option<i64>,
    progress: &PartitionProgress,
) -> Result<Result<Published, BatchFailure>, KafkaError> {
    let started = Instant::now();
    let published = shared.publisher.publish(partition, records, offsets, progress.lost.clone()).await;
    StageTimed { stage: Stage::publish, duration: started.elapsed() }.emit(&shared.metrics);
    match published {
        Ok(p) => Ok(Ok(p)),
        Err(PublishError::Fatal { source }) => {
            Err(KafkaError::Fenced { transactional_id: shared.transactional_id.clone(), source })
        }
        Err(e @ (PublishError::Permanent { .. } | PublishError::Unresolved { .. })) => {
            Err(KafkaError::Publish { partition, source: e })
        }
        Err(PublishError::Retriable { reason, detail }) => {
            PublishRetried { reason }.emit(&shared.metrics);
            Ok(Err(BatchFailure { reason, detail }))
        }
    }
}

/// Collects the next batch into `batch`: `Collected`, `Idle` when nothing
/// arrived for a while, `None` when a revoke arrived (the core decides).
async fn collect(
    shared: &Arc<Shared>,
    partition: i32,
    queue: &InputQueue,
    stop: &mut watch::Receiver<bool>,
    strays: &mut mpsc::UnboundedReceiver<OwnedMessage>,
    progress: &PartitionProgress,
    batch: &mut InFlight,
) -> Option<Event> {
    let limits = shared.settings.batch;
    let mut messages: Vec<OwnedMessage> = Vec::new();
    // Messages librdkafka delivered to the main queue before this
    // partition's queue was split come first: they precede it.
    while let Ok(m) = strays.try_recv() {
        messages.push(m);
    }
    while messages.is_empty() {
        tokio::select! {
            // Biased, stop first: a revoke must not wait for input.
            biased;
            _ = stop.changed() => return None,
            m = queue.recv() => match m {
                Ok(m) => messages.push(m.detach()),
                Err(e) => {
                    tracing::warn!(partition, error = %e, "input consumer error");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            // rust-rdkafka wakes a split partition queue only on its
            // empty→non-empty edge; a missed edge would park this partition
            // for good while the others keep flowing (rust-rdkafka #665,
            // #840). A fresh `recv` polls the queue before it waits, so
            // waking up regularly heals it.
            _ = tokio::time::sleep(IDLE_REPOLL) => {
                // Nothing arrived: progress, unless the statistics show
                // input waiting that the queue does not deliver.
                if !matches!(shared.input_lag(partition, progress), Some(lag) if lag > 0) {
                    progress.progressed(wall_ms());
                }
                return Some(Event::Idle { committed: shared.committed_offset(partition) });
            }
        }
    }
    let deadline = tokio::time::Instant::now() + limits.max_wait;
    while messages.len() < limits.max_records {
        tokio::select! {
            biased;
            // Stopping while collecting: the core abandons the unpublished
            // batch. Nothing of it was published or committed, so the next
            // owner consumes it from the committed offset.
            _ = stop.changed() => return None,
            m = queue.recv() => match m {
                Ok(m) => messages.push(m.detach()),
                Err(e) => {
                    tracing::warn!(partition, error = %e, "input consumer error");
                    break;
                }
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    let next_input = messages.iter().map(|m| m.offset()).max()? + 1;
    *batch = InFlight { messages: Arc::new(messages), ..InFlight::default() };
    Some(Event::Collected { next_input })
}

/// Applies the published batch's accepted events at the offsets the
/// broker gave them.
async fn apply(shared: &Arc<Shared>, partition: i32, batch: &mut InFlight) -> Result<(), KafkaError> {
    let (Some(prepared), Some(published)) = (batch.prepared.as_mut(), batch.published.as_ref()) else {
        return Err(KafkaError::Task { detail: "apply asked for a batch that is not published".into() });
    };
    let started = Instant::now();
    let mut stored = Vec::with_capacity(prepared.accepted.len());
    for (index, s) in &prepared.accepted {
        let Some(&(p, offset)) = published.get(*index) else {
            return Err(KafkaError::Task { detail: "publisher returned fewer positions than records".into() });
        };
        let mut s = s.clone();
        s.key.output = Position::new(p, offset);
        stored.push(s);
    }
    let engine = shared.engine.clone();
    let now_ms = batch.now_ms;
    tokio::task::spawn_blocking(move || read_engine(&engine).apply_published(partition, &stored, now_ms))
        .await
        .map_err(join_error)??;
    StageTimed { stage: Stage::apply, duration: started.elapsed() }.emit(&shared.metrics);
    Ok(())
}

/// A batch is published and applied: count it and record the progress.
fn finish_batch(shared: &Shared, progress: &PartitionProgress, batch: InFlight) {
    if let Some(next) = batch.messages.iter().map(|m| m.offset()).max() {
        progress.next_offset.store(next + 1, Ordering::Relaxed);
    }
    if let Some(ms) = batch.messages.last().and_then(|m| m.timestamp().to_millis()) {
        progress.last_record_ms.store(ms, Ordering::Relaxed);
    }
    progress.progressed(wall_ms());
    if let Some(p) = batch.prepared {
        p.summary.emit(&shared.metrics);
    }
}

/// Wall-clock milliseconds, for progress only (never for event time, which
/// comes from the injectable clock).
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn join_error(e: tokio::task::JoinError) -> KafkaError {
    KafkaError::Task { detail: e.to_string() }
}

/// Sends an asynchronous commit of the next input offset of `partition`
/// (at-least-once mode). Never blocks: a broker slow to answer OffsetCommit
/// (Tansu was seen to take seconds) must not stall the pipeline. The broker's
/// answer arrives in the consumer's commit callback, which records it in
/// [`Shared::committed_offset`].
fn commit_input(shared: &Arc<Shared>, partition: i32, next: i64) {
    let Some(consumer) = shared.consumer() else { return };
    let mut tpl = TopicPartitionList::new();
    if let Err(e) = tpl.add_partition_offset(&shared.settings.topics.input, partition, Offset::Offset(next)) {
        tracing::warn!(partition, error = %e, "cannot build the offset commit");
        return;
    }
    if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
        // Behind, never ahead: retried while idle; replays are recognised.
        tracing::warn!(partition, next, error = %e, "input offset commit failed");
    }
}

/// Decode → validate → classify → build the records to publish. Blocking
/// (the engine may read RocksDB).
fn prepare(shared: &Shared, partition: i32, batch: &[OwnedMessage], now_ms: i64) -> Result<Prepared, KafkaError> {
    let inputs: Vec<BatchInput<'_>> =
        batch.iter().map(|m| BatchInput { offset: m.offset(), key: m.key(), payload: m.payload() }).collect();
    // The engine lock is taken for each of classification's calls to local
    // state alone, and shared: the stateless work between them, and other
    // partitions' classification, run beside them. Safe: nothing else
    // changes this partition's state meanwhile (one task per partition;
    // standbys never follow it), and the calls only read.
    let with = |f: &mut dyn FnMut(&dyn Engine)| f(read_engine(&shared.engine).as_ref());
    let prepared = classify_batch(&with, partition, &inputs, now_ms, &shared.batch_layout())?;
    shared.batches.fetch_add(1, Ordering::Relaxed);
    Ok(prepared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_is_stalled_only_with_input_and_no_progress_past_the_timeout() {
        let p = PartitionProgress::new(1_000);
        assert!(!p.stalled(1_000_000, 10_000, Some(5)), "repair has its own deadline");
        p.repairing.store(false, Ordering::Relaxed);
        assert!(!p.stalled(5_000, 10_000, Some(5)), "within the timeout");
        assert!(p.stalled(20_000, 10_000, Some(5)), "input waiting, no progress for longer than the timeout");
        assert!(p.stalled(20_000, 10_000, None), "a batch in flight for longer than the timeout");
        assert!(!p.stalled(20_000, 10_000, Some(0)), "caught up is never a stall");
        p.progressed(19_000);
        assert!(!p.stalled(20_000, 10_000, Some(5)), "progress resets the clock");
    }
}
