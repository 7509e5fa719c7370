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

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot};

use crate::kafka::records::{Destination, OutRecord};
use crate::kafka::settings::Topics;

/// Why a publish did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Nothing of the batch is committed (exactly-once), or an unknown part
    /// of it reached the output (at-least-once): retry after repair.
    #[error("publish failed, retry: {detail}")]
    Retriable { detail: String },
    /// The producer cannot go on (fenced by a newer instance, or a fatal
    /// idempotence error): stop the worker.
    #[error("publish failed for good: {source}")]
    Fatal {
        #[source]
        source: RdError,
    },
}

/// Where each record of a published batch landed: `(partition, offset)` in
/// request order.
pub type Published = Vec<(i32, i64)>;

/// A request from one partition pipeline to the transaction task.
#[derive(Debug)]
pub struct TxnRequest {
    input_partition: i32,
    records: Vec<OutRecord>,
    /// The next input offset of `input_partition` to consume after this batch.
    next_input_offset: i64,
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
        next_input_offset: i64,
    ) -> Result<Published, PublishError> {
        match self {
            Publisher::Transactional { tx } => {
                let (reply, rx) = oneshot::channel();
                let req = TxnRequest { input_partition, records, next_input_offset, reply };
                tx.send(req).await.map_err(|_| PublishError::Retriable { detail: "publisher task stopped".into() })?;
                rx.await.map_err(|_| PublishError::Retriable { detail: "publisher task stopped".into() })?
            }
            Publisher::Idempotent { producer, topics } => produce_all(producer, topics, &records).await,
        }
    }
}

fn topic(topics: &Topics, d: Destination) -> &str {
    match d {
        Destination::Output => &topics.output,
        Destination::Conflicts => &topics.conflicts,
        Destination::Rejected => &topics.rejected,
    }
}

fn classify_error(e: RdError) -> PublishError {
    let fatal = match &e {
        RdError::Transaction(t) => t.is_fatal(),
        other => matches!(
            other.rdkafka_error_code(),
            Some(RDKafkaErrorCode::Fatal | RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch)
        ),
    };
    if fatal {
        PublishError::Fatal { source: e }
    } else {
        PublishError::Retriable { detail: e.to_string() }
    }
}

/// Produces every record and waits for every acknowledgement.
async fn produce_all(
    producer: &FutureProducer,
    topics: &Topics,
    records: &[OutRecord],
) -> Result<Published, PublishError> {
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let headers = r.owned_headers();
        let mut fr: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic(topics, r.destination))
            .partition(r.partition)
            .timestamp(r.timestamp_ms)
            .headers(headers);
        if let Some(k) = &r.key {
            fr = fr.key(k.as_slice());
        }
        if let Some(v) = &r.value {
            fr = fr.payload(v.as_slice());
        }
        loop {
            match producer.send_result(fr) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((RdError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // librdkafka's queue is full: let deliveries drain it.
                    fr = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => return Err(classify_error(e)),
            }
        }
    }
    let mut out = Vec::with_capacity(pending.len());
    let mut first_error = None;
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

/// Starts the transaction task. `producer` must have completed
/// `init_transactions`.
pub fn start_transactional(
    producer: FutureProducer,
    topics: Arc<Topics>,
    group_metadata: GroupMetadataSource,
    timeout: Duration,
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
            let result = run_transaction(&producer, &topics, &group_metadata, &group, timeout).await;
            match result {
                Ok(mut per_request) => {
                    for (req, published) in group.into_iter().zip(per_request.drain(..)) {
                        let _ = req.reply.send(Ok(published));
                    }
                }
                Err(e) => {
                    let fatal = matches!(e, PublishError::Fatal { .. });
                    for req in group {
                        let err = match &e {
                            PublishError::Fatal { source } => PublishError::Fatal { source: source.clone() },
                            PublishError::Retriable { detail } => PublishError::Retriable { detail: detail.clone() },
                        };
                        let _ = req.reply.send(Err(err));
                    }
                    if fatal {
                        // The producer is unusable; later requests fail fast.
                        while let Some(req) = rx.recv().await {
                            let _ =
                                req.reply.send(Err(PublishError::Retriable { detail: "producer is fenced".into() }));
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
    timeout: Duration,
) -> Result<Vec<Published>, PublishError> {
    producer.begin_transaction().map_err(classify_error)?;
    let outcome = async {
        let mut per_request = Vec::with_capacity(group.len());
        for req in group {
            per_request.push(produce_all(producer, topics, &req.records).await?);
        }
        let mut tpl = TopicPartitionList::new();
        for req in group {
            tpl.add_partition_offset(&topics.input, req.input_partition, Offset::Offset(req.next_input_offset))
                .map_err(classify_error)?;
        }
        let cgm = group_metadata().ok_or_else(|| PublishError::Retriable { detail: "not a group member".into() })?;
        let p = producer.clone();
        blocking(move || p.send_offsets_to_transaction(&tpl, &cgm, timeout)).await.map_err(classify_error)?;
        commit_with_retries(producer, timeout).await?;
        Ok(per_request)
    }
    .await;
    if let Err(PublishError::Retriable { detail }) = &outcome {
        tracing::warn!(%detail, batches = group.len(), "transaction failed; aborting it");
        let p = producer.clone();
        if let Err(e) = blocking(move || p.abort_transaction(timeout)).await {
            let e = classify_error(e);
            if matches!(e, PublishError::Fatal { .. }) {
                return Err(e);
            }
            tracing::warn!(error = %e, "abort failed; the broker aborts the transaction on its timeout");
        }
    }
    outcome
}

/// Commits the open transaction. A retriable commit error leaves the outcome
/// unknown to us, so it is retried (librdkafka's documented recovery) rather
/// than aborted: aborting a commit that did reach the broker would make the
/// pipeline publish its batch again.
async fn commit_with_retries(producer: &FutureProducer, timeout: Duration) -> Result<(), PublishError> {
    const ATTEMPTS: usize = 5;
    for attempt in 1..=ATTEMPTS {
        let p = producer.clone();
        match blocking(move || p.commit_transaction(timeout)).await {
            Ok(()) => return Ok(()),
            Err(RdError::Transaction(t)) if t.is_retriable() && !t.txn_requires_abort() && attempt < ATTEMPTS => {
                tracing::warn!(error = %t, attempt, "transaction commit outcome unknown; retrying the commit");
            }
            Err(e) => return Err(classify_error(e)),
        }
    }
    Err(PublishError::Retriable { detail: "transaction commit did not complete".into() })
}
