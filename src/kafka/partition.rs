//! The pipeline of one assigned input partition: repair, then batches of
//! classify → publish → apply (→ commit, at-least-once), one batch at a time.
//!
//! One batch at a time is what makes classification exact: a batch is
//! classified against state that already holds every earlier batch of the
//! partition. Parallelism comes from partitions, each its own task.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, watch};

use crate::classify::Tier;
use crate::event::{IdHash, Position, UsageEvent};
use crate::kafka::engine::{InputRecord, Outcome, StoredEvent};
use crate::kafka::error::KafkaError;
use crate::kafka::publisher::PublishError;
use crate::kafka::records::{accepted_record, conflict_record, rejected_record, OutRecord};
use crate::kafka::repair::lock_engine;
use crate::kafka::settings::DeliveryMode;
use crate::kafka::worker::{InputQueue, Shared};
use crate::metrics::{BatchClassified, PublishRetried, RepairCompleted, Stage, StageTimed};

/// How often an idle partition task polls its queue again (see the idle
/// branch of [`pipeline`]).
const IDLE_REPOLL: Duration = Duration::from_millis(250);
/// How often an unconfirmed input offset commit is sent again while idle.
const COMMIT_RETRY: Duration = Duration::from_secs(1);

/// What the worker knows of one partition's progress, shared between its
/// task (which writes it) and the statistics callback (which turns it into
/// lag, head-age and stall gauges). Atomics: written once per batch, read
/// once a second, never a reason to block either side.
#[derive(Debug)]
pub(crate) struct PartitionProgress {
    /// The assignment was lost (session timeout): the task abandons its
    /// in-flight batch instead of finishing it, because another member may
    /// already own the partition.
    pub lost: AtomicBool,
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
            lost: AtomicBool::new(false),
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

/// A classified batch, ready to publish.
struct Prepared {
    records: Vec<OutRecord>,
    /// For each accepted event: its index in `records` and the key and event
    /// to apply once the output offset is known.
    accepted: Vec<(usize, StoredEvent)>,
    summary: BatchClassified,
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
    let _ = tokio::task::spawn_blocking(move || lock_engine(&engine).revoke(partition)).await;
    if let Err(e) = result {
        shared.fail(e);
    }
}

async fn pipeline(
    shared: &Arc<Shared>,
    partition: i32,
    queue: &InputQueue,
    stop: &mut watch::Receiver<bool>,
    strays: &mut mpsc::UnboundedReceiver<OwnedMessage>,
    progress: &PartitionProgress,
) -> Result<(), KafkaError> {
    let now = shared.clock.now_ms();
    let engine = shared.engine.clone();
    tokio::task::spawn_blocking(move || lock_engine(&engine).assign(partition, now)).await.map_err(join_error)??;
    // A revoke during repair abandons it (nothing was consumed yet).
    let revoked = stop.clone();
    if !repair(shared, partition, move || *revoked.borrow()).await? {
        return Ok(());
    }
    progress.progressed(wall_ms());
    progress.repairing.store(false, Ordering::Relaxed);
    shared.partition_repaired();

    let limits = shared.settings.batch;
    let at_least_once = shared.settings.delivery == DeliveryMode::AtLeastOnce;
    // At-least-once: the next input offset published and applied but not yet
    // committed (the last commit failed, e.g. mid-rebalance). Retried when
    // the partition is idle and before the task ends, so an idle partition
    // does not leave its offset behind forever.
    let mut uncommitted: Option<i64> = None;
    let mut last_commit_sent = Instant::now();
    loop {
        let mut batch: Vec<OwnedMessage> = Vec::new();
        // Messages librdkafka delivered to the main queue before this
        // partition's queue was split come first: they precede it.
        while let Ok(m) = strays.try_recv() {
            batch.push(m);
        }
        if batch.is_empty() {
            tokio::select! {
                // Biased, stop first: a revoke must not wait for input.
                biased;
                _ = stop.changed() => break,
                m = queue.recv() => match m {
                    Ok(m) => batch.push(m.detach()),
                    Err(e) => {
                        tracing::warn!(partition, error = %e, "input consumer error");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                // rust-rdkafka wakes a split partition queue only on its
                // empty→non-empty edge; a missed edge would park this
                // partition for good while the others keep flowing
                // (rust-rdkafka #665, #840). A fresh `recv` polls the queue
                // before it waits, so waking up regularly heals it.
                _ = tokio::time::sleep(IDLE_REPOLL) => {
                    // Nothing arrived: progress, unless the statistics show
                    // input waiting that the queue does not deliver.
                    if !matches!(shared.input_lag(partition, progress), Some(lag) if lag > 0) {
                        progress.progressed(wall_ms());
                    }
                    // Idle with a commit not yet confirmed by the broker:
                    // send it again now and then (commits are idempotent).
                    if let Some(next) = uncommitted {
                        if shared.committed_offset(partition) >= Some(next) {
                            uncommitted = None;
                        } else if last_commit_sent.elapsed() >= COMMIT_RETRY {
                            last_commit_sent = Instant::now();
                            commit_input(shared, partition, next);
                        }
                    }
                    continue;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + limits.max_wait;
        let mut stopping = false;
        while batch.len() < limits.max_records {
            tokio::select! {
                biased;
                // Stopping while collecting: abandon the unpublished batch.
                // Nothing of it was published or committed, so the next
                // owner consumes it from the committed offset.
                _ = stop.changed() => {
                    stopping = true;
                    break;
                }
                m = queue.recv() => match m {
                    Ok(m) => batch.push(m.detach()),
                    Err(e) => {
                        tracing::warn!(partition, error = %e, "input consumer error");
                        break;
                    }
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        if stopping {
            break;
        }
        let last_record_ms = batch.last().and_then(|m| m.timestamp().to_millis());
        let Some(next) = process_batch(shared, partition, batch, progress).await? else {
            tracing::warn!(partition, "assignment lost: abandoned the in-flight batch; the next owner consumes it");
            shared.batches_abandoned.fetch_add(1, Ordering::Relaxed);
            break;
        };
        progress.next_offset.store(next, Ordering::Relaxed);
        if let Some(ms) = last_record_ms {
            progress.last_record_ms.store(ms, Ordering::Relaxed);
        }
        progress.progressed(wall_ms());
        if at_least_once {
            let started = Instant::now();
            uncommitted = Some(next);
            last_commit_sent = Instant::now();
            commit_input(shared, partition, next);
            StageTimed { stage: Stage::commit, duration: started.elapsed() }.emit(&shared.metrics);
        }
        if *stop.borrow() {
            break;
        }
    }
    if let Some(next) = uncommitted.filter(|_| !progress.lost.load(Ordering::SeqCst)) {
        // Last chance before the partition is released: send the commit and
        // give the broker a moment to confirm it. Unconfirmed, the next owner
        // replays the tail and recognises it as replays.
        commit_input(shared, partition, next);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while shared.committed_offset(partition) < Some(next) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
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

/// Repairs `partition`, retrying broker errors a few times with backoff: a
/// slow or restarting broker must not kill the worker on its first timeout.
/// Local-state errors and foreign output records fail at once. `false` when
/// `abandon` said so first.
async fn repair(
    shared: &Arc<Shared>,
    partition: i32,
    abandon: impl Fn() -> bool + Send + Sync + Clone + 'static,
) -> Result<bool, KafkaError> {
    const ATTEMPTS: u32 = 5;
    let mut backoff = Duration::from_millis(500);
    let mut attempt = 1;
    let outcome = loop {
        let s = shared.clone();
        let abandon = abandon.clone();
        match tokio::task::spawn_blocking(move || s.repairer.repair_blocking(partition, &abandon))
            .await
            .map_err(join_error)?
        {
            Ok(Some(outcome)) => break outcome,
            Ok(None) => return Ok(false),
            Err(e @ KafkaError::Client { .. }) if attempt < ATTEMPTS => {
                tracing::warn!(partition, attempt, error = %e, "repair failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    };
    RepairCompleted {
        partition,
        from_offset: outcome.from_offset,
        records: outcome.records,
        duration: outcome.duration,
    }
    .emit(&shared.metrics);
    Ok(true)
}

/// Classifies, publishes, applies and (at-least-once) commits one batch.
/// Finishes it even when a revoke arrives meanwhile: the rebalance callback
/// waits for this, so two owners never publish the same record. A *lost*
/// assignment is different: another member may own the partition already,
/// so the batch is abandoned (`None`) at the next point where nothing of it
/// is in flight — before its first publish, or before a retry.
/// Returns the next input offset to consume (to commit, at-least-once).
async fn process_batch(
    shared: &Arc<Shared>,
    partition: i32,
    batch: Vec<OwnedMessage>,
    progress: &PartitionProgress,
) -> Result<Option<i64>, KafkaError> {
    let Some(last_offset) = batch.iter().map(|m| m.offset()).max() else {
        return Err(KafkaError::Task { detail: "empty batch".into() });
    };
    let batch = Arc::new(batch);
    let mut backoff = Duration::from_millis(100);
    loop {
        if progress.lost.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let now_ms = shared.clock.now_ms();
        let started = Instant::now();
        let (s, b) = (shared.clone(), batch.clone());
        let prepared =
            tokio::task::spawn_blocking(move || prepare(&s, partition, &b, now_ms)).await.map_err(join_error)??;
        StageTimed { stage: Stage::classify, duration: started.elapsed() }.emit(&shared.metrics);

        let started = Instant::now();
        let published = shared.publisher.publish(partition, prepared.records, last_offset + 1).await;
        StageTimed { stage: Stage::publish, duration: started.elapsed() }.emit(&shared.metrics);
        let published = match published {
            Ok(p) => p,
            Err(PublishError::Fatal { source }) => {
                return Err(KafkaError::Fenced { transactional_id: shared.transactional_id.clone(), source });
            }
            Err(e @ (PublishError::Permanent { .. } | PublishError::Unresolved { .. })) => {
                return Err(KafkaError::Publish { partition, source: e });
            }
            Err(PublishError::Retriable { reason, detail }) => {
                PublishRetried { reason }.emit(&shared.metrics);
                tracing::warn!(partition, %detail, reason, backoff_ms = backoff.as_millis() as u64, "publish failed; repairing, then retrying the batch");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                if progress.lost.load(Ordering::SeqCst) {
                    return Ok(None);
                }
                // Whatever of the batch did reach the output is read back, so
                // the retry sees those records as replays, not new events.
                // Not abandonable: the batch in flight must finish.
                repair(shared, partition, || false).await?;
                continue;
            }
        };

        let started = Instant::now();
        let mut stored = Vec::with_capacity(prepared.accepted.len());
        for (index, mut s) in prepared.accepted {
            let Some(&(p, offset)) = published.get(index) else {
                return Err(KafkaError::Task { detail: "publisher returned fewer positions than records".into() });
            };
            s.key.output = Position::new(p, offset);
            stored.push(s);
        }
        let engine = shared.engine.clone();
        tokio::task::spawn_blocking(move || lock_engine(&engine).apply_published(partition, &stored, now_ms))
            .await
            .map_err(join_error)??;
        StageTimed { stage: Stage::apply, duration: started.elapsed() }.emit(&shared.metrics);

        prepared.summary.emit(&shared.metrics);
        return Ok(Some(last_offset + 1));
    }
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
    let inputs: Vec<InputRecord<'_>> = batch
        .iter()
        .map(|m| InputRecord { source: Position::new(partition, m.offset()), payload: m.payload() })
        .collect();
    let engine = lock_engine(&shared.engine);
    let outcomes = engine.classify(partition, &inputs, now_ms)?;
    let mut summary = BatchClassified { partition, ..Default::default() };
    let mut records = Vec::with_capacity(batch.len());
    let mut accepted = Vec::new();
    let mut in_batch: HashMap<IdHash, UsageEvent> = HashMap::new();
    let mut reasons: HashMap<crate::event::RejectReason, u64> = HashMap::new();
    let mut tenants: HashMap<String, u64> = HashMap::new();
    // Input headers are ignored by design: the payload alone is the event,
    // so unknown or hostile headers cannot change a record's bucket.
    for ((m, input), outcome) in batch.iter().zip(&inputs).zip(outcomes) {
        if m.key().is_none() {
            summary.unkeyed += 1;
        }
        match outcome {
            Outcome::Accepted { event, id_hash, payload_hash } => {
                summary.accepted += 1;
                records.push(accepted_record(&event, id_hash, payload_hash, input.source, now_ms));
                let key = crate::classify::SeenKey {
                    id_hash,
                    payload_hash,
                    first_seen_ms: now_ms,
                    source: input.source,
                    // Filled in with the offset the broker assigns.
                    output: Position::new(partition, -1),
                };
                in_batch.insert(id_hash, event.clone());
                accepted.push((records.len() - 1, StoredEvent { key, event }));
            }
            Outcome::Duplicate { .. } => summary.duplicate += 1,
            Outcome::Replayed { .. } => summary.replayed += 1,
            Outcome::Conflict { event, id_hash, payload_hash, tier, first } => {
                summary.conflict += 1;
                *tenants.entry(event.tenant_id.clone()).or_default() += 1;
                let original = if tier == Tier::Batch {
                    in_batch.get(&id_hash).cloned()
                } else {
                    engine.original(partition, &id_hash)
                };
                records.push(conflict_record(
                    &event,
                    id_hash,
                    payload_hash,
                    tier,
                    &first,
                    original.as_ref(),
                    input.source,
                    now_ms,
                    shared.layout.conflicts_partitions,
                ));
            }
            Outcome::Rejected(rejection) => {
                summary.rejected += 1;
                *reasons.entry(rejection.reason).or_default() += 1;
                records.push(rejected_record(
                    &rejection,
                    m.key(),
                    m.payload(),
                    input.source,
                    now_ms,
                    shared.settings.max_rejected_raw_bytes,
                    shared.layout.rejected_partitions,
                ));
            }
        }
    }
    summary.rejected_by_reason = reasons.into_iter().collect();
    summary.conflicts_by_tenant = tenants.into_iter().collect();
    shared.batches.fetch_add(1, Ordering::Relaxed);
    Ok(Prepared { records, accepted, summary })
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
