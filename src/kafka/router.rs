//! `dedupd route`: keys and places raw records by identity (issue #13).
//!
//! dedupd is exact only when every delivery of an event reaches the input
//! partition whose state saw the first one. Producers keyed any way, or with
//! another client's default partitioner, break that. The router consumes a
//! raw topic with any keys and any partitioning, reads each record just far
//! enough to know where it belongs ([`Validator::placement_of`]: its
//! identity, derived like the classifier derives it for events without
//! `event_id`, or for a correction its original's), and produces it
//! unchanged (value, headers, timestamp) to the input topic, keyed
//! `tenant_id \0 event_id` (the original's for a correction), on the
//! partition [`Partitioner`] gives that identity. A record without an identity (not JSON, no tenant) goes to the
//! rejected topic with its reason.
//!
//! Stateless. Exactly-once by default: each batch's records and the raw
//! topic's offsets commit in one transaction (consume-transform-produce),
//! with the same publisher and the same commit-resume rules as `dedupd run`.
//! At-least-once publishes, waits for every acknowledgement, then commits
//! the raw offsets; a crash in between routes a batch twice, which the
//! dedupe stage then sees as duplicates of the same identity and payload
//! (counted, never billed twice).
//!
//! Rebalances are served only while the router polls, and no transaction is
//! open then. A batch read while partitions were revoked is handed back
//! (each still-owned partition is rewound to its first record), and so is a
//! partition whose publish failed: nothing is skipped, nothing is committed
//! ahead of what was published.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use futures::future::join_all;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::event::{id_hash, identity_key, Position, Rejection, Validator};
use crate::kafka::clients;
use crate::kafka::error::KafkaError;
use crate::kafka::publisher::Publisher;
use crate::kafka::records::{rejected_record, Destination, OutRecord};
use crate::kafka::settings::{DeliveryMode, RunSettings, Topics};
use crate::kafka::worker::{fatal_consumer_code, flush_and_leave, live_group_metadata, start_publisher};
use crate::metrics::{Metrics, MetricsServer, PublishRetried, Rebalanced, RouteBatchPublished};

/// The settings of `dedupd route`: a [`RunSettings`] whose topics are read
/// as *raw* (consumed) → *input* (the dedupe stage's input, produced) and
/// *rejected* (unroutable records). Clients, group, delivery mode, batch
/// limits, timeouts, partitioner and metrics address mean what they mean
/// for `dedupd run`. Give the router its own consumer group.
#[derive(Clone, Debug)]
pub struct RouteSettings {
    pub run: RunSettings,
}

impl RouteSettings {
    pub fn new(
        brokers: impl Into<String>,
        group: impl Into<String>,
        raw_topic: impl Into<String>,
        input_topic: impl Into<String>,
        rejected_topic: impl Into<String>,
    ) -> RouteSettings {
        let rejected = rejected_topic.into();
        // Conflicts are never written: the router has none.
        let topics = Topics::of(raw_topic, input_topic, rejected.clone(), rejected);
        RouteSettings { run: RunSettings::new(brokers, group, topics) }
    }

    pub fn raw_topic(&self) -> &str {
        &self.run.topics.input
    }

    pub fn input_topic(&self) -> &str {
        &self.run.topics.output
    }

    /// The longest an orderly stop can take: the batch being published
    /// (its commit resumed up to the transaction timeout plus one operation
    /// timeout), then the producer flush and leaving the group (one
    /// operation timeout each). Grace periods must exceed it.
    pub fn shutdown_budget(&self) -> Duration {
        self.run.repair_settle_timeout() + self.run.operation_timeout * 2
    }
}

/// What a router did before it stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteReport {
    pub routed: u64,
    pub rejected: u64,
    pub batches: u64,
    /// Batches handed back (a rebalance while reading, a failed publish).
    pub batches_rewound: u64,
}

/// Notes revocations, which void the batch being read.
#[derive(Default)]
pub struct RouterContext {
    revoked: AtomicBool,
    metrics: OnceLock<Arc<Metrics>>,
}

impl ClientContext for RouterContext {
    // The shared consumer configuration asks for statistics (the worker's
    // lag gauge); the router has no use for them, and the default would log
    // every report.
    fn stats(&self, _: rdkafka::Statistics) {}
}

impl ConsumerContext for RouterContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            tracing::info!(revoked = ?partitions(tpl), "raw partitions revoked");
            self.revoked.store(true, Ordering::SeqCst);
            let lost = base.assignment_lost();
            if let Some(m) = self.metrics.get() {
                if lost { Rebalanced::Lost } else { Rebalanced::Revoked }.emit(m);
            }
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            tracing::info!(assigned = ?partitions(tpl), "raw partitions assigned");
            if let Some(m) = self.metrics.get() {
                Rebalanced::Assigned.emit(m);
            }
        }
    }
}

type RouterConsumer = StreamConsumer<RouterContext>;

fn partitions(tpl: &TopicPartitionList) -> Vec<i32> {
    tpl.elements().iter().map(|e| e.partition()).collect()
}

/// Partition counts the router needs.
#[derive(Clone, Copy, Debug)]
struct Layout {
    input_partitions: u32,
    rejected_partitions: usize,
}

/// Runs the router until `shutdown` completes or a fatal error.
pub async fn route(
    settings: RouteSettings,
    validator: Validator,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<RouteReport, KafkaError> {
    let s = settings.run;
    let (check, timeout) = (s.clone(), s.operation_timeout);
    let layout = blocking(move || -> Result<Layout, KafkaError> {
        let count = clients::partition_counter(&check, timeout)?;
        count(&check.topics.input)?;
        Ok(Layout {
            input_partitions: u32::try_from(count(&check.topics.output)?).unwrap_or(u32::MAX),
            rejected_partitions: count(&check.topics.rejected)?,
        })
    })
    .await??;

    let server = match s.metrics_addr {
        Some(addr) => {
            let server = MetricsServer::bind(addr, metrics.clone()).await?;
            tracing::info!(addr = %server.local_addr(), "metrics endpoint listening");
            let (stop, rx) = tokio::sync::oneshot::channel::<()>();
            Some((
                stop,
                tokio::spawn(server.serve(async move {
                    let _ = rx.await;
                })),
            ))
        }
        None => None,
    };

    let slot: Arc<OnceLock<Weak<RouterConsumer>>> = Arc::new(OnceLock::new());
    let transactional_id = s.transactional_id(rand::random::<u64>());
    let (publisher, publisher_task, producer) =
        start_publisher(&s, &transactional_id, live_group_metadata(slot.clone()), metrics.clone()).await?;
    let context = RouterContext::default();
    let _ = context.metrics.set(metrics.clone());
    let consumer: Arc<RouterConsumer> = Arc::new(
        clients::input_consumer_config(&s)
            .create_with_context(context)
            .map_err(KafkaError::client("creating the raw-topic consumer"))?,
    );
    let _ = slot.set(Arc::downgrade(&consumer));
    consumer.subscribe(&[&s.topics.input]).map_err(KafkaError::client("subscribing to the raw topic"))?;
    metrics.set_ready(true);
    tracing::info!(raw = %s.topics.input, input = %s.topics.output, partitioner = %s.partitioner, "router started");

    let router = Router { s: &s, validator: &validator, metrics: &metrics, publisher: &publisher, layout };
    let mut report = RouteReport::default();
    let result = router.run_loop(&consumer, shutdown, &mut report).await;

    flush_and_leave(&producer, consumer, timeout).await?;
    if let Some(t) = publisher_task {
        t.abort();
    }
    if let Some((stop, task)) = server {
        let _ = stop.send(());
        let _ = task.await;
    }
    result.map(|()| report)
}

struct Router<'a> {
    s: &'a RunSettings,
    validator: &'a Validator,
    metrics: &'a Metrics,
    publisher: &'a Publisher,
    layout: Layout,
}

impl Router<'_> {
    async fn run_loop(
        &self,
        consumer: &Arc<RouterConsumer>,
        shutdown: impl Future<Output = ()> + Send,
        report: &mut RouteReport,
    ) -> Result<(), KafkaError> {
        tokio::pin!(shutdown);
        loop {
            let mut batch: Vec<OwnedMessage> = Vec::new();
            tokio::select! {
                biased;
                _ = &mut shutdown => return Ok(()),
                m = consumer.recv() => match m {
                    Ok(m) => batch.push(m.detach()),
                    Err(e) => {
                        self.consumer_error(consumer, &e)?;
                        continue;
                    }
                },
            }
            let deadline = tokio::time::Instant::now() + self.s.batch.max_wait;
            while batch.len() < self.s.batch.max_records {
                tokio::select! {
                    biased;
                    m = consumer.recv() => match m {
                        Ok(m) => batch.push(m.detach()),
                        Err(e) => {
                            self.consumer_error(consumer, &e)?;
                            break;
                        }
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
            let context = consumer.context();
            if context.revoked.swap(false, Ordering::SeqCst) {
                // Some of these records may now belong to another member.
                tracing::info!(records = batch.len(), "partitions revoked while reading; handing the batch back");
                rewind(consumer, &self.s.topics.input, by_partition(&batch).iter().map(|(p, m)| (*p, m[0].offset())))
                    .await?;
                report.batches_rewound += 1;
                continue;
            }
            self.publish_batch(consumer, &batch, report).await?;
        }
    }

    /// Stops on an error no retry heals; otherwise logs and goes on.
    fn consumer_error(&self, consumer: &RouterConsumer, e: &RdError) -> Result<(), KafkaError> {
        let fatal = consumer.client().fatal_error();
        let code = e.rdkafka_error_code();
        if fatal.is_some() || matches!(e, RdError::MessageConsumptionFatal(_)) || code.is_some_and(fatal_consumer_code)
        {
            let why = fatal.map_or_else(|| e.to_string(), |(c, why)| format!("{c:?}: {why}"));
            self.metrics.set_unhealthy();
            return Err(KafkaError::ConsumerFatal { detail: format!("{why} (raw-topic consumer)") });
        }
        tracing::warn!(error = %e, "raw-topic consumer error");
        Ok(())
    }

    async fn publish_batch(
        &self,
        consumer: &Arc<RouterConsumer>,
        batch: &[OwnedMessage],
        report: &mut RouteReport,
    ) -> Result<(), KafkaError> {
        let now_ms = wall_ms();
        let groups = by_partition(batch);
        // Rebalance callbacks run only inside `recv`, never while a batch is
        // published, so no assignment can be lost mid-publish from the
        // router's point of view; a session that expires meanwhile is caught
        // by the transaction's group metadata (a member without an id
        // cannot commit offsets) or, at-least-once, only re-routes a batch.
        let lost = Arc::new(AtomicBool::new(false));
        let mut counts = Vec::with_capacity(groups.len());
        let mut publishes = Vec::with_capacity(groups.len());
        for (&partition, messages) in &groups {
            let mut records = Vec::with_capacity(messages.len());
            let mut rejected = 0u64;
            for m in messages {
                let r = self.route_record(m, now_ms);
                rejected += u64::from(r.destination == Destination::Rejected);
                records.push(r);
            }
            counts.push((messages.len() as u64 - rejected, rejected));
            let next = messages.last().map(|m| m.offset() + 1);
            publishes.push(self.publisher.publish(partition, records, next, lost.clone()));
        }
        let results = join_all(publishes).await;
        let mut commit = TopicPartitionList::new();
        let mut failed = Vec::new();
        for (((&partition, messages), result), (routed, rejected)) in groups.iter().zip(results).zip(counts) {
            match result {
                Ok(_) => {
                    RouteBatchPublished { routed, rejected }.emit(self.metrics);
                    report.routed += routed;
                    report.rejected += rejected;
                    if let Some(last) = messages.last() {
                        let _ = commit.add_partition_offset(
                            &self.s.topics.input,
                            partition,
                            Offset::Offset(last.offset() + 1),
                        );
                    }
                }
                Err(e) if e.stops_the_worker() => {
                    self.metrics.set_unhealthy();
                    return Err(KafkaError::Publish { partition, source: e });
                }
                Err(e) => {
                    if let crate::kafka::publisher::PublishError::Retriable { reason, .. } = &e {
                        PublishRetried { reason }.emit(self.metrics);
                    }
                    tracing::warn!(partition, error = %e, "routing a batch failed; reading it again");
                    failed.push((partition, messages[0].offset()));
                }
            }
        }
        report.batches += 1;
        tracing::debug!(records = batch.len(), partitions = groups.len(), failed = failed.len(), "routed a batch");
        if self.s.delivery == DeliveryMode::AtLeastOnce && commit.count() > 0 {
            // Asynchronous: the batch is published and acknowledged, so a
            // commit that fails or is lost only routes it again, which the
            // dedupe stage recognises as duplicates; waiting for the broker's
            // answer would cost a round trip per batch.
            if let Err(e) = consumer.commit(&commit, CommitMode::Async) {
                tracing::warn!(error = %e, "committing raw offsets failed");
            }
        }
        if !failed.is_empty() {
            report.batches_rewound += 1;
            // Back off a little: the failure was the broker's.
            tokio::time::sleep(Duration::from_millis(100)).await;
            rewind(consumer, &self.s.topics.input, failed.into_iter()).await?;
        }
        Ok(())
    }

    /// The input-topic record of one raw record, or its rejected record.
    fn route_record(&self, m: &OwnedMessage, now_ms: i64) -> OutRecord {
        let source = Position::new(m.partition(), m.offset());
        let identity = match m.payload() {
            Some(bytes) => self.validator.placement_of(bytes),
            None => Err(Rejection::new(
                crate::event::RejectReason::MalformedJson,
                "null value (tombstone); an event is a JSON object",
            )),
        };
        match identity {
            Ok((tenant, event)) => {
                let id = id_hash(&tenant, &event);
                let partition = self.s.partitioner.partition_of(&id, &tenant, &event, self.layout.input_partitions);
                let passthrough_headers = m
                    .headers()
                    .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
                    .unwrap_or_default();
                OutRecord {
                    destination: Destination::Output,
                    partition,
                    key: Some(identity_key(&tenant, &event)),
                    value: m.payload().map(<[u8]>::to_vec),
                    headers: Vec::new(),
                    passthrough_headers,
                    timestamp_ms: m.timestamp().to_millis().unwrap_or(now_ms),
                }
            }
            Err(rejection) => rejected_record(
                &rejection,
                m.key(),
                m.payload(),
                source,
                now_ms,
                self.s.max_rejected_raw_bytes,
                self.layout.rejected_partitions,
            ),
        }
    }
}

/// The batch's records grouped by raw partition, in offset order.
fn by_partition(batch: &[OwnedMessage]) -> BTreeMap<i32, Vec<&OwnedMessage>> {
    let mut groups: BTreeMap<i32, Vec<&OwnedMessage>> = BTreeMap::new();
    for m in batch {
        groups.entry(m.partition()).or_default().push(m);
    }
    groups
}

/// Moves each partition's position back to `offset`, so its records are
/// read again. A partition no longer assigned needs nothing: its next owner
/// starts from the committed offset. A failed rewind stops the router: the
/// position would stay past records never published, and the next commit
/// of that partition would skip them.
async fn rewind(
    consumer: &Arc<RouterConsumer>,
    topic: &str,
    to: impl Iterator<Item = (i32, i64)>,
) -> Result<(), KafkaError> {
    let assigned = consumer.assignment().map_err(KafkaError::client("reading the assignment"))?;
    for (partition, offset) in to {
        if assigned.find_partition(topic, partition).is_none() {
            continue;
        }
        let (c, t) = (consumer.clone(), topic.to_owned());
        blocking(move || c.seek(&t, partition, Offset::Offset(offset), Duration::from_secs(10)))
            .await?
            .map_err(KafkaError::client("rewinding a raw partition"))?;
    }
    Ok(())
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, KafkaError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| KafkaError::Task { detail: e.to_string() })
}
