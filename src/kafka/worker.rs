//! `dedupd run`: start-up checks, the consumer group, the partition tasks,
//! the rebalance callbacks and shutdown.
//!
//! ```text
//!            ┌──────────── main task ─────────────┐
//!            │ consumer.recv(): serves rebalances │──post_rebalance(Assign)──► spawn partition task p
//!            │ (and forwards stray messages)      │──pre_rebalance(Revoke)───► stop p, wait until done
//!            └────────────────────────────────────┘
//!  partition task p: repair p ─► [batch ─► classify ─► publish ─► apply ─► commit]*
//!                                                        │
//!                         exactly-once: publisher task (one transaction for all waiting batches)
//!                         at-least-once: shared idempotent producer
//!  maintenance task: engine.maintain + state gauges     metrics task: /metrics /healthz /readyz
//!  standby task (--standby-replicas): other owners' output partitions followed into local state
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use hashbrown::HashMap;
use rdkafka::client::ClientContext;
use rdkafka::consumer::stream_consumer::StreamPartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::statistics::Statistics;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{mpsc, watch};

use crate::classify::Clock;
use crate::event::Validator;
use crate::kafka::clients::{self, TopicLayout};
use crate::kafka::engine::{read_engine, write_engine, Engine, SharedEngine};
use crate::kafka::error::KafkaError;
use crate::kafka::partition::{run_partition, PartitionProgress};
use crate::kafka::publisher::{self, Publisher, TxnTimeouts};
use crate::kafka::repair::Repairer;
use crate::kafka::settings::{DeliveryMode, RunSettings};
use crate::metrics::{
    AssignmentChanged, Bucket, GroupStuck, HeadAgeObserved, LagObserved, Metrics, MetricsServer, PartitionsStalled,
    Rebalanced, StateObserved, UnownedLagObserved,
};

pub type InputConsumer = StreamConsumer<WorkerContext>;
pub type InputQueue = StreamPartitionQueue<WorkerContext>;

/// What [`run`] needs besides settings: the engine and its collaborators.
pub struct WorkerParts {
    /// Validates input (and reads output back during repair).
    pub validator: Validator,
    /// Local state; `crate::state::LocalState` in production.
    pub engine: Box<dyn Engine>,
    pub clock: Arc<dyn Clock>,
    /// Shared with the caller so tests and the demo can read the counters.
    pub metrics: Arc<Metrics>,
}

/// What a finished run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunReport {
    pub accepted: u64,
    pub duplicate: u64,
    pub conflict: u64,
    pub rejected: u64,
    pub replayed: u64,
    pub repaired_records: u64,
    pub batches: u64,
    /// Batches given up because the partition's assignment was lost.
    pub batches_abandoned: u64,
    /// Revokes that came with the assignment lost (session timeout, fencing).
    pub assignments_lost: u64,
}

/// State shared by the main task, partition tasks and rebalance callbacks.
pub(crate) struct Shared {
    pub settings: RunSettings,
    pub layout: TopicLayout,
    /// A std `RwLock`, not tokio's: it is only ever taken on blocking
    /// threads (engine calls may fsync), never held across an await, and
    /// the rebalance callback runs outside any async context.
    pub engine: SharedEngine,
    pub repairer: Repairer,
    pub publisher: Publisher,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    pub transactional_id: String,
    /// Weak: the consumer owns the context that owns this; a strong
    /// reference would be a cycle that never closes the consumer.
    consumer: Arc<OnceLock<Weak<InputConsumer>>>,
    fatal: mpsc::UnboundedSender<KafkaError>,
    /// Owned partitions whose first repair has not ended: `/readyz`
    /// answers 200 only once none is left. A set, not a count: a partition
    /// revoked before its repair ended must leave it, and only it.
    pending_repairs: RepairsPending,
    assignment_seen: AtomicBool,
    pub batches: AtomicU64,
    pub batches_abandoned: AtomicU64,
    pub assignments_lost: AtomicU64,
    /// The end of each input partition a `read_committed` consumer can
    /// reach (last stable offset), from librdkafka statistics; with each
    /// task's next offset it gives the lag in both delivery modes (librdkafka's
    /// own `consumer_lag` follows committed offsets, which exactly-once mode
    /// commits through the transaction, out of the consumer's sight).
    /// A std `Mutex`: written once a second by the statistics callback.
    input_ends: Mutex<HashMap<i32, i64>>,
    /// Input offsets the broker confirmed as committed (commit callback).
    /// A std `Mutex`: touched briefly from the callback and the pipelines.
    committed: Mutex<HashMap<i32, i64>>,
    /// Warm standbys: other owners' output partitions this worker follows.
    pub(crate) standbys: crate::kafka::standby::Standbys,
}

impl Shared {
    pub(crate) fn batch_layout(&self) -> crate::kafka::batch::BatchLayout {
        crate::kafka::batch::BatchLayout {
            placement: Some(crate::classify::Placement {
                partitioner: self.settings.partitioner,
                partitions: u32::try_from(self.layout.partitions).unwrap_or(u32::MAX),
                on_misrouted: self.settings.on_misrouted,
            }),
            conflicts_partitions: self.layout.conflicts_partitions,
            rejected_partitions: self.layout.rejected_partitions,
            max_rejected_raw_bytes: self.settings.max_rejected_raw_bytes,
            rollups_partitions: self.layout.rollups_partitions,
            republish_replays: self.settings.delivery == DeliveryMode::AtLeastOnce,
        }
    }

    pub(crate) fn consumer(&self) -> Option<Arc<InputConsumer>> {
        self.consumer.get().and_then(Weak::upgrade)
    }

    /// Reports a fatal error to the main task, which stops the worker.
    pub(crate) fn fail(&self, e: KafkaError) {
        tracing::error!(error = %e, "fatal worker error");
        self.metrics.set_unhealthy();
        let _ = self.fatal.send(e);
    }

    /// The highest next-offset of `partition` the broker confirmed.
    pub(crate) fn committed_offset(&self, partition: i32) -> Option<i64> {
        self.committed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&partition).copied()
    }

    /// Records of `partition` not yet processed, when both ends are known.
    pub(crate) fn input_lag(&self, partition: i32, progress: &PartitionProgress) -> Option<i64> {
        let next = progress.next_offset.load(Ordering::Relaxed);
        let end = *self.input_ends.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&partition)?;
        (next >= 0).then(|| (end - next).max(0))
    }

    pub(crate) fn partition_repaired(&self, partition: i32) {
        self.pending_repairs.repaired(partition, |left| self.update_ready(left));
    }

    fn update_ready(&self, pending: usize) {
        self.metrics.set_ready(self.assignment_seen.load(Ordering::SeqCst) && pending == 0);
    }
}

/// The owned partitions whose first repair has not ended. Each change
/// hands how many are left to `then` while the lock is still held, so
/// readiness is set in the order the changes were made (a repair ending
/// beside a new assignment cannot set ready after the assignment cleared
/// it). A std `Mutex`: touched briefly from the rebalance callback and the
/// partition tasks, never across an await.
#[derive(Debug, Default)]
pub(crate) struct RepairsPending(Mutex<std::collections::BTreeSet<i32>>);

impl RepairsPending {
    fn change(&self, f: impl FnOnce(&mut std::collections::BTreeSet<i32>), then: impl FnOnce(usize)) {
        let mut s = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut s);
        then(s.len());
    }

    /// A partition's task started: its repair is to come.
    fn started(&self, partition: i32, then: impl FnOnce(usize)) {
        self.change(
            |s| {
                s.insert(partition);
            },
            then,
        );
    }

    /// A partition's first repair ended.
    fn repaired(&self, partition: i32, then: impl FnOnce(usize)) {
        self.change(
            |s| {
                s.remove(&partition);
            },
            then,
        );
    }

    /// Partitions revoked, their repairs ended or not.
    fn released(&self, partitions: &[i32], then: impl FnOnce(usize)) {
        self.change(
            |s| {
                for p in partitions {
                    s.remove(p);
                }
            },
            then,
        );
    }

    /// Readiness as it stands (after the assignment is seen).
    fn report(&self, then: impl FnOnce(usize)) {
        self.change(|_| {}, then);
    }
}

/// A running partition task, as the rebalance callback sees it.
struct PartitionHandle {
    stop: watch::Sender<bool>,
    /// Disconnects when the task ends (its sender is dropped).
    done: std::sync::mpsc::Receiver<()>,
    strays: mpsc::UnboundedSender<OwnedMessage>,
    progress: Arc<PartitionProgress>,
}

/// The consumer context: rebalance callbacks and statistics.
pub struct WorkerContext {
    shared: Arc<Shared>,
    /// A std `Mutex`: taken in librdkafka callbacks (sync) and briefly in the
    /// main task, never across an await.
    tasks: Mutex<HashMap<i32, PartitionHandle>>,
    runtime: Handle,
}

impl WorkerContext {
    fn tasks(&self) -> std::sync::MutexGuard<'_, HashMap<i32, PartitionHandle>> {
        self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The input partitions this worker owns now.
    pub(crate) fn owned_partitions(&self) -> std::collections::BTreeSet<i32> {
        self.tasks().keys().copied().collect()
    }

    pub(crate) fn owns(&self, partition: i32) -> bool {
        self.tasks().contains_key(&partition)
    }

    fn assign(&self, partitions: Vec<i32>) {
        let Some(consumer) = self.shared.consumer() else { return };
        let topic = &self.shared.settings.topics.input;
        let mut started = Vec::new();
        let new: Vec<i32> = partitions.iter().copied().filter(|p| !self.tasks().contains_key(p)).collect();
        // Each new partition's queue is split off first, before the slow
        // part below (the followers' lock, which a standby's reconcile may
        // hold for seconds, a hand-over, and loading hot caches can take
        // seconds): what librdkafka fetches for it until the split goes to
        // the main queue, and the main task forwards those strays to the
        // partition's task, which takes them before its own queue. Split at
        // once, there are next to none, so a task cannot finish its repair
        // and read its own queue before a stray sent long before has been
        // forwarded (it would commit past it).
        let mut queues = std::collections::BTreeMap::new();
        for &p in &new {
            match consumer.split_partition_queue(topic, p) {
                Some(queue) => {
                    queues.insert(p, queue);
                }
                None => self
                    .shared
                    .fail(KafkaError::Task { detail: format!("cannot split the queue of input partition {p}") }),
            }
        }
        // Held until every task has started: no standby of these partitions
        // may start in between (see `crate::kafka::standby`).
        let mut following = block_outside_runtime(|| self.shared.standbys.lock());
        block_outside_runtime(|| following.hand_over(&self.shared, &new));
        // Every new partition's hot cache from one pass over the stored keys
        // (each task's repair would otherwise read them all once per
        // partition). A failure here comes back to each task's own load.
        let now = self.shared.clock.now_ms();
        if let Err(e) = block_outside_runtime(|| write_engine(&self.shared.engine).assign_all(&new, now)) {
            tracing::warn!(error = %e, "loading the assigned partitions' state together failed; each loads its own");
        }
        for (p, queue) in queues {
            let (stop, stop_rx) = watch::channel(false);
            let (done_tx, done) = std::sync::mpsc::channel();
            let (strays, strays_rx) = mpsc::unbounded_channel();
            let progress = Arc::new(PartitionProgress::new(wall_ms()));
            self.shared.pending_repairs.started(p, |_| {});
            self.runtime.spawn(run_partition(
                self.shared.clone(),
                p,
                queue,
                stop_rx,
                strays_rx,
                progress.clone(),
                done_tx,
            ));
            self.tasks().insert(p, PartitionHandle { stop, done, strays, progress });
            started.push(p);
        }
        self.shared.assignment_seen.store(true, Ordering::SeqCst);
        self.shared.pending_repairs.report(|left| self.shared.update_ready(left));
        AssignmentChanged { assigned: started, revoked: vec![], owned_now: self.tasks().len() }
            .emit(&self.shared.metrics);
    }

    /// Stops the tasks of `partitions` and waits (bounded) until each has
    /// finished or abandoned its batch: only then may another owner start.
    /// `lost`: the assignment was lost (session timeout), another member may
    /// own the partitions already, so in-flight batches are abandoned rather
    /// than finished.
    fn revoke(&self, partitions: &[i32], lost: bool) {
        // Held until the tasks have ended and released their partitions in
        // local state: a partition being released is owned still, and no
        // standby may start following it before that (`crate::kafka::standby`).
        let _following = block_outside_runtime(|| self.shared.standbys.lock());
        let handles: Vec<(i32, PartitionHandle)> =
            partitions.iter().filter_map(|p| self.tasks().remove(p).map(|h| (*p, h))).collect();
        for (_, h) in &handles {
            if lost {
                h.progress.lost.store(true, Ordering::SeqCst);
            }
            let _ = h.stop.send(true);
        }
        let timeout = self.shared.settings.revoke_timeout;
        let wait = || {
            let deadline = std::time::Instant::now() + timeout;
            for (p, h) in &handles {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = h.done.recv_timeout(left) {
                    // Releasing the partition while its task may still
                    // publish would let two owners publish the same record
                    // (and, exactly-once, commit a transaction after the next
                    // owner's repair has ended). Dying instead is what crash
                    // recovery is built for: no more sends leave this process,
                    // the partition moves when the session expires, and the
                    // next owner repairs from the output topic.
                    tracing::error!(
                        partition = p,
                        ?timeout,
                        "partition task did not finish its batch within the revoke timeout; aborting the process \
                         rather than releasing a partition that may still publish"
                    );
                    std::process::abort();
                }
            }
        };
        block_outside_runtime(wait);
        self.shared.pending_repairs.released(partitions, |left| self.shared.update_ready(left));
        AssignmentChanged { assigned: vec![], revoked: partitions.to_vec(), owned_now: self.tasks().len() }
            .emit(&self.shared.metrics);
    }

    fn forward_stray(&self, m: OwnedMessage) {
        match self.tasks().get(&m.partition()) {
            Some(h) => {
                let _ = h.strays.send(m);
            }
            None => tracing::warn!(partition = m.partition(), offset = m.offset(), "message for an unowned partition"),
        }
    }
}

/// Runs a blocking wait from a callback that may be on a runtime worker
/// thread: `block_in_place` lets the runtime move its other tasks (the very
/// partition tasks being waited on) to other threads meanwhile.
fn block_outside_runtime<T>(f: impl FnOnce() -> T) -> T {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl ClientContext for WorkerContext {
    fn stats(&self, statistics: Statistics) {
        let Some(topic) = statistics.topics.get(&self.shared.settings.topics.input) else { return };
        let now = wall_ms();
        let stall_ms = i64::try_from(self.shared.settings.stall_timeout.as_millis()).unwrap_or(i64::MAX);
        let owned: Vec<(i32, Arc<PartitionProgress>)> =
            self.tasks().iter().map(|(p, h)| (*p, h.progress.clone())).collect();
        {
            let mut ends = self.shared.input_ends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (&partition, p) in &topic.partitions {
                // read_committed: the last stable offset is the end this
                // consumer can reach; before it is known, the high watermark.
                let end = if p.ls_offset >= 0 { p.ls_offset } else { p.hi_offset };
                if end >= 0 {
                    ends.insert(partition, end);
                }
            }
        }
        let mut stalled = 0;
        for (partition, progress) in &owned {
            let lag = self
                .shared
                .input_lag(*partition, progress)
                .or_else(|| topic.partitions.get(partition).map(|p| p.consumer_lag).filter(|l| *l >= 0));
            if let Some(lag_records) = lag {
                LagObserved { partition: *partition, lag_records }.emit(&self.shared.metrics);
                // The head of the unprocessed input is younger than the last
                // record processed: its age bounds the head's from above.
                let last = progress.last_record_ms.load(Ordering::Relaxed);
                let seconds = if lag_records > 0 && last >= 0 { (now - last) as f64 / 1000.0 } else { 0.0 };
                HeadAgeObserved { partition: *partition, seconds }.emit(&self.shared.metrics);
            }
            if progress.stalled(now, stall_ms, lag) {
                stalled += 1;
            }
        }
        PartitionsStalled { count: stalled }.emit(&self.shared.metrics);
    }

    fn error(&self, error: RdError, reason: &str) {
        if let Some(detail) = self.fatal_detail(&error, reason) {
            self.shared.fail(KafkaError::ConsumerFatal { detail });
        } else {
            tracing::warn!(%error, reason, "kafka client error");
        }
    }
}

impl WorkerContext {
    /// Describes `error` when no retry can heal it: a fatal client error
    /// (e.g. `FENCED_INSTANCE_ID`: another process uses this
    /// `--instance-id`), or credentials and ACLs the brokers refuse. Such
    /// errors stop the worker at once rather than leave it retrying for ever
    /// with `/healthz` green.
    fn fatal_detail(&self, error: &RdError, reason: &str) -> Option<String> {
        let client_fatal = self.shared.consumer().and_then(|c| c.client().fatal_error());
        let fatal_event = matches!(error, RdError::MessageConsumptionFatal(_));
        let code = error.rdkafka_error_code()?;
        if !(fatal_event || client_fatal.is_some() || fatal_consumer_code(code)) {
            return None;
        }
        // librdkafka reports a fatal error under its underlying code (or as
        // `Fatal`, whose cause the client keeps).
        let (code, why) = match client_fatal {
            Some((c, why)) if code == RDKafkaErrorCode::Fatal => (c, why),
            _ => (code, format!("{error} ({reason})")),
        };
        let hint = match code {
            RDKafkaErrorCode::FencedInstanceId => format!(
                "; another process joined group `{}` with the same --instance-id {:?}: give each worker its own",
                self.shared.settings.group,
                self.shared.settings.instance_id.as_deref().unwrap_or("")
            ),
            RDKafkaErrorCode::InconsistentGroupProtocol => format!(
                "; group `{}` has members with another partition.assignment.strategy: give every member the \
                 same one (dedupd's default is cooperative-sticky)",
                self.shared.settings.group
            ),
            _ => String::new(),
        };
        Some(format!("{code:?}: {why}{hint}"))
    }
}

/// Consumer error codes no retry heals.
pub(crate) fn fatal_consumer_code(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::Fatal
            | C::FencedInstanceId
            | C::Authentication
            | C::SaslAuthenticationFailed
            | C::GroupAuthorizationFailed
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            // Members of one group with assignors that cannot work together
            // (a `partition.assignment.strategy` override on some of them):
            // this member would never join.
            | C::InconsistentGroupProtocol
    )
}

/// How long after start a worker may own nothing before it reports the
/// group's input lag as unowned (joins and first rebalances take seconds).
const UNOWNED_LAG_GRACE: Duration = Duration::from_secs(30);

/// Whether a group is stuck, as seen by a member that owns nothing: the
/// group's input has lag and its committed offsets have not moved for the
/// stall timeout. A member idle beside busy peers sees offsets move and is
/// never stuck; a member the broker left without partitions while nobody
/// consumes is, and failing `/healthz` gets it restarted (a new join), the
/// way an operator would unstick it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StuckGroup {
    /// Committed offsets summed, and since when they have stood still.
    still: Option<(i64, i64)>,
}

impl StuckGroup {
    /// One observation while owning nothing: the group's committed offsets
    /// (summed) and its lag. Returns whether the group is stuck.
    pub(crate) fn observe(&mut self, now_ms: i64, committed: i64, lag: i64, stall_ms: i64) -> bool {
        if lag <= 0 {
            self.still = None;
            return false;
        }
        match self.still {
            Some((c, since)) if c == committed => now_ms.saturating_sub(since) >= stall_ms,
            _ => {
                self.still = Some((committed, now_ms));
                false
            }
        }
    }

    /// This member owns partitions again: it is consuming, not stuck.
    pub(crate) fn reset(&mut self) {
        self.still = None;
    }
}

/// The group's committed input offsets (summed) and its unprocessed input
/// (high watermarks minus committed offsets), over every input partition.
/// Blocking. `None` when the brokers do not answer.
fn group_input_lag(consumer: &InputConsumer, topic: &str, partitions: usize, timeout: Duration) -> Option<(i64, i64)> {
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..i32::try_from(partitions).ok()? {
        tpl.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(tpl, timeout).ok()?;
    let (mut lag, mut sum) = (0i64, 0i64);
    for e in committed.elements() {
        let (low, high) = consumer.fetch_watermarks(topic, e.partition(), timeout).ok()?;
        let from = match e.offset() {
            rdkafka::Offset::Offset(o) => o,
            _ => low,
        };
        sum += from;
        lag += (high - from).max(0);
    }
    Some((sum, lag))
}

/// Wall-clock milliseconds, for progress and lag only.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn partitions_of(tpl: &rdkafka::TopicPartitionList, topic: &str) -> Vec<i32> {
    tpl.elements().iter().filter(|e| e.topic() == topic).map(|e| e.partition()).collect()
}

impl ConsumerContext for WorkerContext {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &rdkafka::TopicPartitionList) {
        match result {
            Ok(()) => {
                let mut committed = self.shared.committed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for e in offsets.elements() {
                    if let (true, rdkafka::Offset::Offset(o)) =
                        (e.topic() == self.shared.settings.topics.input, e.offset())
                    {
                        let c = committed.entry(e.partition()).or_insert(o);
                        *c = (*c).max(o);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "input offset commit failed"),
        }
    }

    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let lost = base.assignment_lost();
            let kind = if lost { Rebalanced::Lost } else { Rebalanced::Revoked };
            kind.emit(&self.shared.metrics);
            if lost {
                self.shared.assignments_lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("assignment lost (session timeout or fenced): abandoning in-flight batches");
            }
            self.revoke(&partitions_of(tpl, &self.shared.settings.topics.input), lost);
        }
        if let Rebalance::Error(e) = rebalance {
            tracing::warn!(error = %e, "rebalance error");
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            Rebalanced::Assigned.emit(&self.shared.metrics);
            self.assign(partitions_of(tpl, &self.shared.settings.topics.input));
        }
    }
}

fn engine_stats(engine: &std::sync::RwLock<Box<dyn Engine>>, now_ms: i64) -> StateObserved {
    let s = read_engine(engine).stats(now_ms);
    let age = |ms: Option<i64>| ms.map(|m| Duration::from_millis(u64::try_from(now_ms.saturating_sub(m)).unwrap_or(0)));
    StateObserved {
        hot_cache_entries: s.hot_cache_entries,
        keystore_bytes: s.keystore_bytes,
        hot_window: age(s.oldest_hot_first_seen_ms),
        keystore_window: age(s.oldest_keystore_first_seen_ms),
        window_below_floor: s.window_below_floor,
        hot_evictions: s.hot_evictions,
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, KafkaError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| KafkaError::Task { detail: e.to_string() })
}

/// Creates the producer and, for exactly-once, checks the broker speaks
/// transactions and fences any previous instance with the same id.
pub(crate) async fn start_publisher(
    settings: &RunSettings,
    transactional_id: &str,
    group_metadata: publisher::GroupMetadataSource,
    metrics: Arc<Metrics>,
) -> Result<(Publisher, Option<tokio::task::JoinHandle<()>>, FutureProducer), KafkaError> {
    let topics = Arc::new(settings.topics.clone());
    let timeout = settings.operation_timeout;
    match settings.delivery {
        DeliveryMode::AtLeastOnce => {
            let producer: FutureProducer = clients::producer_config(settings, None)
                .create()
                .map_err(KafkaError::client("creating the producer"))?;
            Ok((Publisher::Idempotent { producer: producer.clone(), topics }, None, producer))
        }
        DeliveryMode::ExactlyOnce => {
            let s = settings.clone();
            let probe = blocking(move || clients::missing_transaction_apis(&s, Duration::from_secs(10))).await?;
            match probe {
                Ok(Some(missing)) if !missing.is_empty() => {
                    return Err(KafkaError::TransactionsUnsupported {
                        brokers: settings.brokers.clone(),
                        detail: format!("it does not serve {}", missing.join(", ")),
                    });
                }
                Ok(_) => {}
                Err(detail) => tracing::warn!(%detail, "could not probe the broker's APIs; relying on librdkafka"),
            }
            let producer: FutureProducer = clients::producer_config(settings, Some(transactional_id))
                .create()
                .map_err(KafkaError::client("creating the transactional producer"))?;
            let p = producer.clone();
            blocking(move || p.init_transactions(timeout)).await?.map_err(|e| {
                let unsupported = matches!(
                    e.rdkafka_error_code(),
                    Some(
                        RDKafkaErrorCode::UnsupportedVersion
                            | RDKafkaErrorCode::UnsupportedFeature
                            | RDKafkaErrorCode::UnsupportedForMessageFormat
                    )
                );
                if unsupported {
                    KafkaError::TransactionsUnsupported { brokers: settings.brokers.clone(), detail: e.to_string() }
                } else {
                    KafkaError::Client { operation: "initialising transactions", source: e }
                }
            })?;
            let timeouts = TxnTimeouts { operation: timeout, resolve_deadline: settings.repair_settle_timeout() };
            let (publisher, task) =
                publisher::start_transactional(producer.clone(), topics, group_metadata, timeouts, metrics);
            Ok((publisher, Some(task), producer))
        }
    }
}

/// The group metadata of the consumer in `slot`, for the transactional
/// offset commit. Only a live member's: after a lost session librdkafka
/// reports no member id and generation -1, and Kafka lets a transactional
/// offset commit without a generation through unfenced (found by the
/// simulator, seed 164). Refusing it turns a zombie's commit into an abort.
pub(crate) fn live_group_metadata<C: ConsumerContext + 'static>(
    slot: Arc<OnceLock<Weak<StreamConsumer<C>>>>,
) -> publisher::GroupMetadataSource {
    Arc::new(move || {
        let consumer = slot.get().and_then(Weak::upgrade)?;
        has_member_id(&consumer).then(|| consumer.group_metadata()).flatten()
    })
}

/// Whether the consumer is a group member now (librdkafka clears the member
/// id when its session is lost).
fn has_member_id<C: ConsumerContext>(consumer: &StreamConsumer<C>) -> bool {
    member_id(consumer).is_some()
}

/// The consumer's member id in its group, `None` while it is not a member.
pub(crate) fn member_id<C: ConsumerContext>(consumer: &StreamConsumer<C>) -> Option<String> {
    let ptr = consumer.client().native_ptr();
    // SAFETY: `ptr` is the live client owned by `consumer`, borrowed for
    // this call; `rd_kafka_memberid` returns a string librdkafka allocated
    // (or null), which is copied once and released with `rd_kafka_mem_free`.
    unsafe {
        let id = rdkafka::bindings::rd_kafka_memberid(ptr);
        if id.is_null() {
            return None;
        }
        let copied = std::ffi::CStr::from_ptr(id).to_string_lossy().into_owned();
        rdkafka::bindings::rd_kafka_mem_free(ptr, id.cast());
        (!copied.is_empty()).then_some(copied)
    }
}

/// Runs the worker until `shutdown` completes (then: stop taking input,
/// finish in-flight batches, commit, flush, close local state) or a fatal
/// error. Needs a multi-threaded tokio runtime: rebalance callbacks block
/// while revoked partitions finish their batch.
pub async fn run(
    settings: RunSettings,
    parts: WorkerParts,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<RunReport, KafkaError> {
    if Handle::current().runtime_flavor() != RuntimeFlavor::MultiThread {
        return Err(KafkaError::Task { detail: "dedupd run needs a multi-threaded tokio runtime".into() });
    }
    let WorkerParts { validator, engine, clock, metrics } = parts;
    settings
        .check_record_bounds(validator.limits().max_output_bytes, validator.limits().max_id_bytes)
        .map_err(KafkaError::Config)?;
    let s = settings.clone();
    let timeout = settings.operation_timeout;
    let layout = blocking(move || clients::check_topics(&s, timeout)).await??;
    // Closed periods are known before the first batch is classified, and
    // followed until the worker stops (dropped with this function's frame).
    let _periods = match &settings.topics.periods {
        Some(topic) => Some(
            crate::kafka::periods::PeriodFollower::start(
                &settings,
                topic,
                validator.closed_periods().clone(),
                metrics.clone(),
                timeout,
            )
            .await?,
        ),
        None => None,
    };

    let engine: SharedEngine = Arc::new(std::sync::RwLock::new(engine));
    let (server_stop, server_stop_rx) = watch::channel(false);
    let server_task = match settings.metrics_addr {
        Some(addr) => {
            let local = engine.clone();
            let usage: crate::metrics::UsageSource = Arc::new(move |query| {
                let answer = read_engine(&local).usage(query).map_err(|e| e.to_string())?;
                answer.map(|a| a.to_json()).transpose().map_err(|e| e.to_string())
            });
            let server = MetricsServer::bind(addr, metrics.clone()).await?.with_usage(usage);
            tracing::info!(addr = %server.local_addr(), "metrics endpoint listening");
            let mut rx = server_stop_rx.clone();
            Some(tokio::spawn(server.serve(async move {
                let _ = rx.wait_for(|stop| *stop).await;
            })))
        }
        None => None,
    };

    let transactional_id = settings.transactional_id(rand::random::<u64>());
    let consumer_slot: Arc<OnceLock<Weak<InputConsumer>>> = Arc::new(OnceLock::new());
    let (publisher, publisher_task, producer) =
        start_publisher(&settings, &transactional_id, live_group_metadata(consumer_slot.clone()), metrics.clone())
            .await?;

    let (fatal_tx, mut fatal_rx) = mpsc::unbounded_channel();
    let repairer = Repairer {
        config: clients::repair_consumer_config(&settings),
        output_topic: settings.topics.output.clone(),
        validator,
        engine: engine.clone(),
        clock: clock.clone(),
        stall_timeout: settings.operation_timeout,
        settle_timeout: settings.repair_open_transaction_wait(),
        uncommitted_config: clients::watermark_probe_config(&settings),
        on_output_gap: settings.on_output_gap,
        metrics: metrics.clone(),
    };
    let shared = Arc::new(Shared {
        settings: settings.clone(),
        layout,
        engine: engine.clone(),
        repairer,
        publisher,
        metrics: metrics.clone(),
        clock: clock.clone(),
        transactional_id,
        consumer: consumer_slot.clone(),
        fatal: fatal_tx,
        pending_repairs: RepairsPending::default(),
        assignment_seen: AtomicBool::new(false),
        batches: AtomicU64::new(0),
        batches_abandoned: AtomicU64::new(0),
        assignments_lost: AtomicU64::new(0),
        input_ends: Mutex::new(HashMap::new()),
        committed: Mutex::new(HashMap::new()),
        standbys: crate::kafka::standby::Standbys::default(),
    });
    let context =
        WorkerContext { shared: shared.clone(), tasks: Mutex::new(HashMap::new()), runtime: Handle::current() };
    let consumer: Arc<InputConsumer> = Arc::new(
        clients::input_consumer_config(&settings)
            .create_with_context(context)
            .map_err(KafkaError::client("creating the input consumer"))?,
    );
    let _ = consumer_slot.set(Arc::downgrade(&consumer));
    consumer.subscribe(&[&settings.topics.input]).map_err(KafkaError::client("subscribing to the input topic"))?;

    let maintain_task = {
        let (engine, metrics, clock, shared) = (engine.clone(), metrics.clone(), clock.clone(), shared.clone());
        // Weak: the consumer must close when the main task drops it.
        let watched = Arc::downgrade(&consumer);
        let (input_topic, partitions, op_timeout) =
            (settings.topics.input.clone(), shared.layout.partitions, settings.operation_timeout);
        let started = std::time::Instant::now();
        let mut stop = server_stop_rx.clone();
        let every = settings.maintain_interval;
        let stall_ms = i64::try_from(settings.stall_timeout.as_millis()).unwrap_or(i64::MAX);
        let mut stuck = StuckGroup::default();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    _ = stop.wait_for(|s| *s) => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let (engine, task_clock) = (engine.clone(), clock.clone());
                let result = tokio::task::spawn_blocking(move || {
                    let now = task_clock.now_ms();
                    let r = write_engine(&engine).maintain(now);
                    (r, engine_stats(&engine, now))
                })
                .await;
                if let Ok((r, stats)) = result {
                    stats.emit(&metrics);
                    if let Err(e) = r {
                        // Fatal, not a warning: a store that failed an fsync
                        // or a background flush is poisoned and refuses every
                        // later write and read, and retrying an fsync can
                        // report success for data the kernel dropped. A
                        // worker whose partitions are idle would otherwise
                        // stay up and ready on a store it can no longer use
                        // until its next batch failed. Stopping lets the
                        // restart recover from the WAL and the output topic.
                        shared.fail(KafkaError::Engine(e));
                        break;
                    }
                }
                // A worker that owns nothing while the group's input waits
                // says so: alone in its group, that is a stuck group.
                if started.elapsed() >= UNOWNED_LAG_GRACE {
                    if let Some(c) = watched.upgrade() {
                        if c.context().tasks().is_empty() {
                            let (topic, n, timeout) = (input_topic.clone(), partitions, op_timeout);
                            if let Ok(Some((committed, lag))) =
                                tokio::task::spawn_blocking(move || group_input_lag(&c, &topic, n, timeout)).await
                            {
                                UnownedLagObserved { lag_records: lag }.emit(&metrics);
                                let now = clock.now_ms();
                                GroupStuck { stuck: stuck.observe(now, committed, lag, stall_ms) }.emit(&metrics);
                            }
                        } else {
                            UnownedLagObserved { lag_records: 0 }.emit(&metrics);
                            stuck.reset();
                            GroupStuck { stuck: false }.emit(&metrics);
                        }
                    }
                }
            }
        })
    };

    let (standby_stop, standby_stop_rx) = watch::channel(false);
    let standby_task = (settings.standby_replicas > 0)
        .then(|| crate::kafka::standby::spawn(shared.clone(), Arc::downgrade(&consumer), standby_stop_rx));

    let mut fatal = None;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            // Biased: shutdown first, then fatal errors, then the consumer,
            // so a busy main queue can never delay a stop.
            biased;
            _ = &mut shutdown => break,
            e = fatal_rx.recv() => {
                fatal = e;
                break;
            }
            m = consumer.recv() => match m {
                Ok(m) => consumer.context().forward_stray(m.detach()),
                Err(e) => {
                    if let Some(detail) = consumer.context().fatal_detail(&e, "input consumer") {
                        fatal = Some(KafkaError::ConsumerFatal { detail });
                        metrics.set_unhealthy();
                        break;
                    }
                    tracing::warn!(error = %e, "input consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    // The select is biased to shutdown: a fatal error that arrived with the
    // stop signal is still waiting in the channel, and decides how the
    // partitions are given up below.
    if fatal.is_none() {
        fatal = fatal_rx.try_recv().ok();
    }
    tracing::info!(fatal = fatal.is_some(), "stopping: finishing in-flight batches");
    // Standbys are told to stop now and joined once the partitions are
    // given up below: a fenced worker must release its partitions first.
    let _ = standby_stop.send(true);

    // Stop every partition task; each finishes (or abandons, if unpublished)
    // its batch. The wait is bounded by revoke_timeout. After a fatal error
    // the partitions are given up as lost: a fenced process (another one
    // holds its --instance-id, or its transactional id) no longer owns
    // them, so a batch waiting to retry its publish must not publish again
    // behind the new owner's repair; one whose publish is in flight still
    // ends as the broker decides, and the next owner repairs from the output.
    let owned: Vec<i32> = consumer.context().tasks().keys().copied().collect();
    let ctx_consumer = consumer.clone();
    let lost = fatal.is_some();
    blocking(move || ctx_consumer.context().revoke(&owned, lost)).await?;
    if let Some(t) = standby_task {
        let _ = t.await;
        // Again, should that task have panicked before it stopped them:
        // local state must be the followers' no more before it closes.
        let s = shared.clone();
        blocking(move || s.standbys.stop_all(&s)).await?;
    }

    drop(shared.publisher.clone());
    flush_and_leave(&producer, consumer, timeout).await?;
    if let Some(t) = publisher_task {
        t.abort();
    }
    let _ = server_stop.send(true);
    let _ = maintain_task.await;
    let e = engine.clone();
    let closed = blocking(move || write_engine(&e).close()).await?;
    if let Some(t) = server_task {
        match t.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "metrics endpoint failed"),
            Err(e) => tracing::warn!(error = %e, "metrics endpoint task failed"),
            Ok(Ok(())) => {}
        }
    }
    if let Some(e) = fatal {
        return Err(e);
    }
    closed?;
    Ok(RunReport {
        accepted: metrics.events(Bucket::accepted),
        duplicate: metrics.events(Bucket::duplicate),
        conflict: metrics.events(Bucket::conflict),
        rejected: metrics.events(Bucket::rejected),
        replayed: metrics.events(Bucket::replayed),
        repaired_records: metrics.repair_records(),
        batches: shared.batches.load(Ordering::Relaxed),
        batches_abandoned: shared.batches_abandoned.load(Ordering::Relaxed),
        assignments_lost: shared.assignments_lost.load(Ordering::Relaxed),
    })
}

/// The last steps of an orderly stop: flush what the producer still holds,
/// then close the consumer, which leaves the group (or, with static
/// membership, keeps the slot until the session times out). Blocking calls,
/// off the runtime.
pub(crate) async fn flush_and_leave<C: ConsumerContext + 'static>(
    producer: &FutureProducer,
    consumer: Arc<StreamConsumer<C>>,
    timeout: Duration,
) -> Result<(), KafkaError> {
    let p = producer.clone();
    if let Err(e) = blocking(move || p.flush(timeout)).await? {
        tracing::warn!(error = %e, "producer flush at shutdown failed");
    }
    blocking(move || {
        consumer.unsubscribe();
        drop(consumer);
    })
    .await
}

/// Completes on SIGTERM or SIGINT: the shutdown future for [`run`] in the
/// binary. If the handlers cannot be installed it never completes (the
/// process then stops only by being killed, which repair makes safe).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM: shutting down"),
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => tracing::info!("SIGINT: shutting down"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGINT");
                std::future::pending::<()>().await;
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two partitions assigned; one repaired, the other revoked before its
    /// repair ended (its task never reports it repaired): none is left
    /// pending, so `/readyz` answers 200 again. A count clamped to the tasks
    /// left kept one pending for good.
    #[test]
    fn a_partition_revoked_before_its_repair_ended_leaves_nothing_pending() {
        let pending = RepairsPending::default();
        type Change<'a> = &'a dyn Fn(&dyn Fn(usize));
        let left = |f: Change<'_>| {
            let seen = std::cell::Cell::new(usize::MAX);
            f(&|n| seen.set(n));
            seen.get()
        };
        assert_eq!(left(&|t| pending.started(0, t)), 1);
        assert_eq!(left(&|t| pending.started(1, t)), 2);
        assert_eq!(left(&|t| pending.repaired(0, t)), 1);
        assert_eq!(left(&|t| pending.released(&[1], t)), 0);
        // Assigned again and repaired: counted once each, whatever the order.
        assert_eq!(left(&|t| pending.started(1, t)), 1);
        assert_eq!(left(&|t| pending.started(1, t)), 1);
        assert_eq!(left(&|t| pending.released(&[0], t)), 1, "releasing a repaired partition changes nothing");
        assert_eq!(left(&|t| pending.repaired(1, t)), 0);
    }

    #[test]
    fn an_idle_member_is_stuck_only_when_committed_offsets_stand_still_with_lag() {
        let stall = 20_000;
        let mut g = StuckGroup::default();
        // Peers consuming: offsets move, never stuck however long.
        for (i, committed) in (0..10).zip((0..).step_by(100)) {
            assert!(!g.observe(i * 10_000, committed, 500, stall));
        }
        // Offsets stand still with lag: stuck once the stall timeout passed.
        assert!(!g.observe(100_000, 5000, 500, stall));
        assert!(!g.observe(119_999, 5000, 500, stall));
        assert!(g.observe(120_000, 5000, 500, stall));
        // No lag: nothing to be stuck on.
        assert!(!g.observe(130_000, 5000, 0, stall));
        assert!(!g.observe(160_000, 5000, 500, stall), "the stall clock restarts after the lag cleared");
        g.reset();
        assert!(!g.observe(200_000, 5000, 500, stall));
    }

    /// The transactional offset commit gets group metadata only from a live
    /// member: none before the consumer has joined, none once it has left
    /// (librdkafka clears the member id), none once it is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_metadata_is_offered_only_while_the_consumer_is_a_member() {
        use rdkafka::config::ClientConfig;
        let mock = rdkafka::mocking::MockCluster::new(1).expect("mock cluster");
        mock.create_topic("members", 2, 1).expect("topic");
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .set("group.id", "members-group")
            .set("session.timeout.ms", "6000")
            .create()
            .expect("consumer");
        let consumer = Arc::new(consumer);
        let slot = Arc::new(OnceLock::new());
        assert!(slot.set(Arc::downgrade(&consumer)).is_ok());
        let metadata = live_group_metadata(slot);
        assert!(metadata().is_none(), "not a member before joining");
        consumer.subscribe(&["members"]).expect("subscribe");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while consumer.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
            assert!(std::time::Instant::now() < deadline, "never joined the mock cluster's group");
            let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
        }
        assert!(metadata().is_some(), "a member's metadata is offered");
        consumer.unsubscribe();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while metadata().is_some() {
            assert!(std::time::Instant::now() < deadline, "metadata still offered after leaving the group");
            let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
        }
        drop(consumer);
        assert!(metadata().is_none(), "a dropped consumer offers nothing");
    }
}
