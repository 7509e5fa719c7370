//! Publishing a batch: output, conflicts and rejected records, and (in
//! exactly-once mode) the input offsets, as one unit.
//!
//! Exactly-once: one transactional producer per process, so transactions are
//! serial. Partition pipelines hand their batches to a single publisher task,
//! which takes every batch waiting at that moment into one transaction
//! (group commit): begin, produce all, `send_offsets_to_transaction` with
//! every partition's next offset, commit. A batch either becomes visible with
//! its offsets or not at all; on an abortable error the whole group is
//! aborted and each pipeline retries its own batch.
//!
//! At-least-once: pipelines produce directly on the shared idempotent
//! producer and wait for every acknowledgement; the caller then applies the
//! batch and commits offsets. After a failure some records may be on the
//! output topic: the pipeline repairs (reads them back) before retrying, so
//! they are recognised as replays instead of published twice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot};

use crate::kafka::records::{Destination, OutRecord};
use crate::kafka::repair::monotonic_ms;
use crate::kafka::settings::Topics;
use crate::metrics::{Metrics, TransactionEnded, TransactionResumed};
use crate::pipeline::{EndAttempt, EndDecision, Ending, Mutations, TransactionEnding};

/// Why a publish did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Nothing of the batch is committed (exactly-once), or an unknown part
    /// of it reached the output (at-least-once): retry after repair.
    /// `reason` is the bounded label of `dedupd_publish_retries_total`.
    #[error("publish failed, retry: {detail}")]
    Retriable { reason: &'static str, detail: String },
    /// The producer cannot go on (fenced by a newer instance, or a fatal
    /// idempotence error): stop the worker.
    #[error("publish failed for good: {source}")]
    Fatal {
        #[source]
        source: RdError,
    },
    /// The brokers refuse these records whatever the number of retries
    /// (too large, not authorised, no such partition): retrying would stall
    /// the partition for ever, so the worker stops and names the cause.
    #[error("the brokers refuse the batch for good ({source}): {hint}")]
    Permanent {
        #[source]
        source: RdError,
        hint: &'static str,
    },
    /// A transaction's commit or abort did not resolve within the deadline,
    /// though repeated as librdkafka requires: its outcome is unknown, so
    /// the worker stops (a restart fences the transaction and repairs).
    #[error("the transaction {operation} did not resolve within {waited:?}: {last}")]
    Unresolved { operation: &'static str, waited: Duration, last: String },
}

impl PublishError {
    fn retriable(reason: &'static str, detail: impl Into<String>) -> PublishError {
        PublishError::Retriable { reason, detail: detail.into() }
    }

    /// A copy for every batch of a failed transaction group (the rdkafka
    /// error is `Clone`, this enum is not, for its `#[source]`).
    fn duplicate(&self) -> PublishError {
        match self {
            PublishError::Retriable { reason, detail } => PublishError::retriable(reason, detail.clone()),
            PublishError::Fatal { source } => PublishError::Fatal { source: source.clone() },
            PublishError::Permanent { source, hint } => PublishError::Permanent { source: source.clone(), hint },
            PublishError::Unresolved { operation, waited, last } => {
                PublishError::Unresolved { operation, waited: *waited, last: last.clone() }
            }
        }
    }

    /// Whether the worker must stop rather than retry the batch.
    pub fn stops_the_worker(&self) -> bool {
        !matches!(self, PublishError::Retriable { .. })
    }
}

/// Where each record of a published batch landed: `(partition, offset)` in
/// request order.
pub type Published = Vec<(i32, i64)>;

/// A request from one partition pipeline to the transaction task.
#[derive(Debug)]
pub struct TxnRequest {
    input_partition: i32,
    records: Vec<OutRecord>,
    /// The next input offset of `input_partition` to consume after this
    /// batch, committed in the transaction (always, but for a test-only
    /// mutation of the core).
    next_input_offset: Option<i64>,
    /// Set when the partition's assignment is lost: its offsets must not
    /// commit (another member may own it).
    assignment_lost: Arc<AtomicBool>,
    reply: oneshot::Sender<Result<Published, PublishError>>,
}

/// Reads the consumer's group metadata at the moment of the commit (it
/// carries the generation that fences a stale owner, KIP-447).
pub type GroupMetadataSource = Arc<dyn Fn() -> Option<ConsumerGroupMetadata> + Send + Sync>;

/// The publishing side of the worker; cheap to clone.
#[derive(Clone)]
pub enum Publisher {
    Transactional { tx: mpsc::Sender<TxnRequest> },
    Idempotent { producer: FutureProducer, topics: Arc<Topics> },
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Publisher::Transactional { .. } => f.write_str("Publisher::Transactional"),
            Publisher::Idempotent { .. } => f.write_str("Publisher::Idempotent"),
        }
    }
}

impl Publisher {
    /// Publishes `records` of one input partition's batch. In exactly-once
    /// mode the input offset `next_input_offset` commits with them.
    pub async fn publish(
        &self,
        input_partition: i32,
        records: Vec<OutRecord>,
        next_input_offset: Option<i64>,
        assignment_lost: Arc<AtomicBool>,
    ) -> Result<Published, PublishError> {
        match self {
            Publisher::Transactional { tx } => {
                let (reply, rx) = oneshot::channel();
                let req = TxnRequest { input_partition, records, next_input_offset, assignment_lost, reply };
                let stopped = || PublishError::retriable("broker", "publisher task stopped");
                tx.send(req).await.map_err(|_| stopped())?;
                rx.await.map_err(|_| stopped())?
            }
            Publisher::Idempotent { producer, topics } => produce_all(producer, topics, &records).await,
        }
    }
}

/// The topic of a destination; `None` for rollups without `--rollups-topic`
/// (rollup records are built only when it is set).
fn topic(topics: &Topics, d: Destination) -> Option<&str> {
    match d {
        Destination::Output => Some(&topics.output),
        Destination::Conflicts => Some(&topics.conflicts),
        Destination::Rejected => Some(&topics.rejected),
        Destination::Rollups => topics.rollups.as_deref(),
    }
}

/// Sorts a producer error into retry, stop, or refuse-for-good. Permanent
/// errors are told apart because retrying them only stalls the partition:
/// the same records are refused again, for ever.
pub fn classify_error(e: RdError) -> PublishError {
    use RDKafkaErrorCode as C;
    let code = e.rdkafka_error_code();
    let fatal = match &e {
        RdError::Transaction(t) => t.is_fatal(),
        _ => matches!(code, Some(C::Fatal | C::ProducerFenced | C::InvalidProducerEpoch | C::Fenced)),
    };
    if fatal {
        return PublishError::Fatal { source: e };
    }
    let hint = match code {
        Some(C::MessageSizeTooLarge | C::MessageBatchTooLarge | C::InvalidRecord) => Some(
            "a record is larger than the producer's message.max.bytes or the topic's max.message.bytes; \
             raise the topic's limit or lower --max-output-bytes / --max-rejected-raw-bytes",
        ),
        Some(C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed | C::TransactionalIdAuthorizationFailed) => {
            Some("dedupd's principal lacks an ACL on the output, side topics or transactional id")
        }
        Some(C::SaslAuthenticationFailed | C::Authentication) => Some("the brokers refused dedupd's credentials"),
        Some(C::UnknownPartition) => {
            Some("a partition dedupd writes to does not exist (was a topic recreated smaller?)")
        }
        Some(C::UnknownTopic) => Some("a topic dedupd writes to does not exist or is not configured"),
        _ => None,
    };
    if let Some(hint) = hint {
        return PublishError::Permanent { source: e, hint };
    }
    let reason = match code {
        Some(C::QueueFull) => "queue_full",
        Some(C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut) => "timeout",
        _ if matches!(&e, RdError::Transaction(t) if t.txn_requires_abort()) => "transaction_aborted",
        _ => "broker",
    };
    PublishError::retriable(reason, e.to_string())
}

/// Produces every record and waits for every acknowledgement.
async fn produce_all(
    producer: &FutureProducer,
    topics: &Topics,
    records: &[OutRecord],
) -> Result<Published, PublishError> {
    let mut pending = Vec::with_capacity(records.len());
    let mut enqueue_error = None;
    for r in records {
        let Some(to) = topic(topics, r.destination) else {
            enqueue_error = Some(RdError::MessageProduction(RDKafkaErrorCode::UnknownTopic));
            break;
        };
        let headers = r.owned_headers();
        let mut fr: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(to).partition(r.partition).timestamp(r.timestamp_ms).headers(headers);
        if let Some(k) = &r.key {
            fr = fr.key(k.as_slice());
        }
        if let Some(v) = &r.value {
            fr = fr.payload(v.as_slice());
        }
        let enqueued = loop {
            match producer.send_result(fr) {
                Ok(f) => break Ok(f),
                Err((RdError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // librdkafka's queue is full: let deliveries drain it.
                    fr = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => break Err(e),
            }
        };
        match enqueued {
            Ok(f) => pending.push(f),
            Err(e) => {
                enqueue_error = Some(e);
                break;
            }
        }
    }
    // Every record already handed to the producer is awaited, even after an
    // enqueue error: one still in flight could land after the caller's
    // repair has read the output, and its retry would then publish it twice.
    let mut out = Vec::with_capacity(pending.len());
    let mut first_error = enqueue_error;
    for result in join_all(pending).await {
        match result {
            Ok(Ok(d)) => out.push((d.partition, d.offset)),
            Ok(Err((e, _))) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(RdError::Canceled);
            }
        }
    }
    match first_error {
        None => Ok(out),
        Some(e) => Err(classify_error(e)),
    }
}

/// How the transaction task bounds the end of a transaction.
#[derive(Clone, Copy, Debug)]
pub struct TxnTimeouts {
    /// One call to librdkafka (produce wait, send offsets, one commit try).
    pub operation: Duration,
    /// How long a commit or abort is repeated before the worker gives up on
    /// it: past the transaction timeout the broker has resolved it anyway.
    pub resolve_deadline: Duration,
}

/// Starts the transaction task. `producer` must have completed
/// `init_transactions`.
pub fn start_transactional(
    producer: FutureProducer,
    topics: Arc<Topics>,
    group_metadata: GroupMetadataSource,
    timeouts: TxnTimeouts,
    metrics: Arc<Metrics>,
) -> (Publisher, tokio::task::JoinHandle<()>) {
    // Bounded: a pipeline has at most one batch in flight, so this never
    // fills; the bound only guards against a bug turning into memory growth.
    let (tx, mut rx) = mpsc::channel::<TxnRequest>(1024);
    let task = tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            let mut group = vec![first];
            while let Ok(more) = rx.try_recv() {
                group.push(more);
            }
            let result = run_transaction(&producer, &topics, &group_metadata, &group, timeouts, &metrics).await;
            match result {
                Ok(mut per_request) => {
                    for (req, published) in group.into_iter().zip(per_request.drain(..)) {
                        let _ = req.reply.send(Ok(published));
                    }
                }
                Err(e) => {
                    for req in group {
                        let _ = req.reply.send(Err(e.duplicate()));
                    }
                    if e.stops_the_worker() {
                        // The producer is unusable or its last transaction
                        // unresolved: later requests fail the same way.
                        while let Some(req) = rx.recv().await {
                            let _ = req.reply.send(Err(e.duplicate()));
                        }
                    }
                }
            }
        }
    });
    (Publisher::Transactional { tx }, task)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, RdError> + Send + 'static) -> Result<T, RdError> {
    tokio::task::spawn_blocking(f).await.unwrap_or(Err(RdError::Canceled))
}

async fn run_transaction(
    producer: &FutureProducer,
    topics: &Topics,
    group_metadata: &GroupMetadataSource,
    group: &[TxnRequest],
    timeouts: TxnTimeouts,
    metrics: &Metrics,
) -> Result<Vec<Published>, PublishError> {
    producer.begin_transaction().map_err(classify_error)?;
    let outcome = async {
        let mut per_request = Vec::with_capacity(group.len());
        for req in group {
            per_request.push(produce_all(producer, topics, &req.records).await?);
        }
        let mut tpl = TopicPartitionList::new();
        for req in group {
            if let Some(next) = req.next_input_offset {
                tpl.add_partition_offset(&topics.input, req.input_partition, Offset::Offset(next))
                    .map_err(classify_error)?;
            }
        }
        if group.iter().any(|r| r.assignment_lost.load(Ordering::SeqCst)) {
            return Err(PublishError::retriable("not_group_member", "a partition of the transaction was lost"));
        }
        let cgm = group_metadata().ok_or_else(|| PublishError::retriable("not_group_member", "not a group member"))?;
        let p = producer.clone();
        let op = timeouts.operation;
        blocking(move || p.send_offsets_to_transaction(&tpl, &cgm, op)).await.map_err(classify_error)?;
        end_transaction(producer, Ending::Commit, timeouts, metrics).await?;
        Ok(per_request)
    }
    .await;
    match &outcome {
        Ok(_) => TransactionEnded { committed: true }.emit(metrics),
        Err(e @ PublishError::Retriable { .. }) => {
            tracing::warn!(error = %e, batches = group.len(), "transaction failed; aborting it");
            end_transaction(producer, Ending::Abort, timeouts, metrics).await?;
            TransactionEnded { committed: false }.emit(metrics);
        }
        Err(_) => {}
    }
    outcome
}

/// Commits or aborts the open transaction, repeating the same call while it
/// times out. librdkafka's transaction calls are resumable: a timed-out
/// commit may still complete, and the only correct next step is the same
/// call again (a different call, or an abort, cannot be made meanwhile);
/// aborting a commit that did reach the broker would publish the batch twice.
/// A commit the broker says must be aborted returns `Retriable`, so the
/// caller aborts. Past `resolve_deadline` the outcome stays unknown and the
/// worker stops, naming it, rather than wedge the partition for ever.
async fn end_transaction(
    producer: &FutureProducer,
    ending: Ending,
    timeouts: TxnTimeouts,
    metrics: &Metrics,
) -> Result<(), PublishError> {
    let started = tokio::time::Instant::now();
    let deadline_ms = i64::try_from(timeouts.resolve_deadline.as_millis()).unwrap_or(i64::MAX);
    let mut resolving = TransactionEnding::new(ending, monotonic_ms(), deadline_ms, Mutations::NONE);
    loop {
        let p = producer.clone();
        let op = timeouts.operation;
        let result = blocking(move || match ending {
            Ending::Commit => p.commit_transaction(op),
            Ending::Abort => p.abort_transaction(op),
        })
        .await;
        let (attempt, error) = match result {
            Ok(()) => (EndAttempt::Resolved, None),
            Err(e) => (end_attempt(ending, &e), Some(e)),
        };
        let decision = resolving.attempted(attempt, monotonic_ms());
        let Some(e) = error else { return Ok(()) };
        match decision {
            EndDecision::Done => return Ok(()),
            EndDecision::Repeat => {
                tracing::debug!(error = %e, waited = ?started.elapsed(), "transaction call timed out");
                TransactionResumed { operation: ending.name(), attempt: resolving.attempts() }.emit(metrics);
            }
            // A commit that must be aborted: the caller aborts.
            EndDecision::AbortInstead => return Err(classify_error(e)),
            EndDecision::Unresolved { .. } => {
                return Err(PublishError::Unresolved {
                    operation: ending.name(),
                    waited: started.elapsed(),
                    last: e.to_string(),
                })
            }
            EndDecision::Fail => return Err(classify_error(e)),
        }
    }
}

/// Sorts a failed commit or abort for [`TransactionEnding`].
fn end_attempt(ending: Ending, e: &RdError) -> EndAttempt {
    // rust-rdkafka flushes before committing: a flush that times out is
    // resumed like the commit itself (the records are still on their way).
    let resumable = match e {
        RdError::Transaction(t) => t.is_retriable() && !t.is_fatal() && !t.txn_requires_abort(),
        RdError::Flush(_) => ending == Ending::Commit,
        _ => false,
    };
    if resumable {
        return EndAttempt::TimedOut;
    }
    match classify_error(e.clone()) {
        PublishError::Retriable { .. } => EndAttempt::MustAbort,
        _ => EndAttempt::Failed,
    }
}
