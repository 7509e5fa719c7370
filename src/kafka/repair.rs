//! Repair: read output partition `p` from the local checkpoint to its end and
//! apply every record to local state, before any input of `p` is consumed
//! (DESIGN §1.4, §6). The output topic is the source of truth; local state
//! is its materialised view.
//!
//! Read committed only: an aborted transaction's records never enter state.
//!
//! Where repair ends matters for billing. A `read_committed` reader stops at
//! the last stable offset (LSO), the start of the oldest transaction still
//! open. If the partition's previous owner crashed with a transaction open
//! (another instance, whose transactional id this one cannot fence), that
//! transaction may still commit: its events would then be on the output but
//! not in this instance's state, and a later retry of one of them would be
//! published again. So repair first reads the high watermark (HWM, read
//! uncommitted) and waits until the LSO has reached it, i.e. until every
//! transaction that touched the partition before repair began has committed
//! or aborted. Only then does it read, up to that LSO. A restart of the same
//! instance fences its own open transaction at `init_transactions`, which
//! runs before any repair, so the wait is only long when a peer died
//! mid-transaction: at most that peer's transaction timeout. Past
//! [`Repairer::settle_timeout`] repair fails instead of guessing.
//!
//! Those decisions (when to wait, where to start, when repair is done) are
//! [`crate::pipeline::PartitionLife`]'s; this module performs its repair
//! steps with librdkafka and local state ([`Repairer::perform`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::classify::Clock;
use crate::event::{Position, Validator};
use crate::kafka::engine::{read_engine, write_engine, SharedEngine, StoredEvent};
use crate::kafka::error::KafkaError;
use crate::kafka::records::parse_output;
use crate::kafka::settings::OnOutputGap;
use crate::metrics::{Metrics, RepairGapFound, RepairProgressed};
use crate::pipeline::{Event, LifeSettings, PartitionLife, Step};

/// Records applied per engine call: bounds memory and engine lock hold time.
pub(crate) const APPLY_CHUNK: usize = 4096;

/// What one repair did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepairOutcome {
    /// First output offset read.
    pub from_offset: i64,
    pub records: u64,
    pub duration: Duration,
}

/// Everything repair needs; shared by every partition pipeline.
pub struct Repairer {
    pub config: ClientConfig,
    pub output_topic: String,
    pub validator: Validator,
    pub engine: SharedEngine,
    pub clock: Arc<dyn Clock>,
    /// Longest repair waits without any progress before failing.
    pub stall_timeout: Duration,
    /// Longest repair waits for transactions open on the output partition
    /// to end (see the module doc). At least the transaction timeout of the
    /// producers that write the output topic.
    pub settle_timeout: Duration,
    /// Reads the high watermark regardless of transactions (a
    /// `read_uncommitted` client of the same brokers).
    pub uncommitted_config: ClientConfig,
    pub on_output_gap: OnOutputGap,
    pub metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Repairer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repairer").field("output_topic", &self.output_topic).finish_non_exhaustive()
    }
}

/// How often a running repair logs its progress.
const REPAIR_PROGRESS_INTERVAL: Duration = Duration::from_secs(10);

/// The clients of one partition's repair, kept across its steps (the last
/// stable offset is read again every few hundred ms while waiting).
pub struct RepairClients {
    consumer: BaseConsumer,
    probe: BaseConsumer,
}

impl std::fmt::Debug for RepairClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RepairClients")
    }
}

/// Milliseconds on a monotonic clock: the core's time for deadlines and
/// back-offs (never event time, which comes from the injectable clock).
pub(crate) fn monotonic_ms() -> i64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    i64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(i64::MAX)
}

impl Repairer {
    /// The core's settings for `partition`'s repair steps.
    pub fn life_settings(&self, partition: i32, delivery: crate::pipeline::DeliveryMode) -> LifeSettings {
        let mut s = LifeSettings::new(partition, delivery);
        s.on_output_gap = self.on_output_gap;
        s.settle_timeout_ms = i64::try_from(self.settle_timeout.as_millis()).unwrap_or(i64::MAX);
        s
    }

    /// Repairs `partition` from local state's checkpoint, blocking (network
    /// and fsync): the core's repair steps performed one after the other on
    /// this thread. `abandon` is asked while repair waits or reads: when it
    /// says yes, repair stops and returns `None`; what it applied so far
    /// stays (applying is idempotent). The partition must be assigned.
    pub fn repair_blocking(
        &self,
        partition: i32,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Option<RepairOutcome>, KafkaError> {
        let started = Instant::now();
        let settings = self.life_settings(partition, crate::pipeline::DeliveryMode::ExactlyOnce);
        let (mut life, mut step) = PartitionLife::assigned(settings, monotonic_ms());
        let mut clients = None;
        let mut outcome = RepairOutcome { from_offset: -1, records: 0, duration: Duration::ZERO };
        loop {
            if abandon() {
                if let Some(release) = life.revoke(false) {
                    step = release;
                }
            }
            if let Step::Wait { until_ms } = step {
                let wait = until_ms.saturating_sub(monotonic_ms());
                std::thread::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(0)));
            }
            if let Step::Load { .. } = step {
                // Assigned by the caller.
                step = Step::Load { assign: false };
            }
            let event = match step {
                Step::Collect => {
                    outcome.duration = started.elapsed();
                    return Ok(Some(outcome));
                }
                Step::Release { .. } => return Ok(None),
                Step::Stop(e) => return Err(KafkaError::from_life(e, &self.output_topic, partition)),
                Step::Wait { .. } => Some(Event::Waited),
                step => self.perform(&mut clients, partition, &step, abandon, &mut outcome)?,
            };
            let Some(event) = event else { return Ok(None) };
            step = life.on(event, monotonic_ms());
        }
    }

    /// Performs one repair step of the core. `Ok(None)`: `abandon` said so
    /// while reading. Broker errors come back as [`Event::RepairFailed`], for
    /// the core to retry; local-state errors and foreign output records fail.
    /// `outcome` gathers where reading started and how much it read.
    pub fn perform(
        &self,
        clients: &mut Option<RepairClients>,
        partition: i32,
        step: &Step,
        abandon: &dyn Fn() -> bool,
        outcome: &mut RepairOutcome,
    ) -> Result<Option<Event>, KafkaError> {
        let result = self.perform_inner(clients, partition, step, abandon, outcome);
        match result {
            Err(e @ KafkaError::Client { .. }) => {
                // A fresh client for the next attempt.
                *clients = None;
                tracing::warn!(partition, error = %e, "repair step failed; retrying");
                Ok(Some(Event::RepairFailed { detail: e.to_string() }))
            }
            other => other,
        }
    }

    fn perform_inner(
        &self,
        clients: &mut Option<RepairClients>,
        partition: i32,
        step: &Step,
        abandon: &dyn Fn() -> bool,
        outcome: &mut RepairOutcome,
    ) -> Result<Option<Event>, KafkaError> {
        let event = match *step {
            Step::Load { assign } => {
                let mut engine = write_engine(&self.engine);
                if assign {
                    engine.assign(partition, self.clock.now_ms())?;
                }
                Event::Loaded {
                    checkpoint: engine.checkpoint(partition),
                    furthest: engine.furthest_checkpoint(partition),
                }
            }
            Step::ProbeOutputEnd => {
                let c = self.clients(clients)?;
                let (_, high_watermark) =
                    c.probe
                        .fetch_watermarks(&self.output_topic, partition, self.stall_timeout)
                        .map_err(KafkaError::client("reading the output high watermark for repair"))?;
                Event::OutputEnd { high_watermark }
            }
            Step::ProbeStableEnd => {
                // With `read_committed` the broker answers (log start, LSO).
                let c = self.clients(clients)?;
                let (log_start, last_stable) = c
                    .consumer
                    .fetch_watermarks(&self.output_topic, partition, self.stall_timeout)
                    .map_err(KafkaError::client("reading the output last stable offset for repair"))?;
                Event::StableEnd { log_start, last_stable }
            }
            Step::FindHorizonStart { log_start, end } => {
                let c = self.clients(clients)?;
                Event::HorizonStart {
                    offset: self.first_offset_within_horizon(
                        &c.consumer,
                        partition,
                        log_start,
                        end,
                        self.stall_timeout,
                    ),
                }
            }
            Step::ReadOutput { from, end, gap } => {
                if gap > 0 {
                    RepairGapFound { partition, records: gap }.emit(&self.metrics);
                }
                if outcome.from_offset < 0 {
                    outcome.from_offset = from;
                }
                if from >= end {
                    return Ok(Some(Event::OutputRead { next: end }));
                }
                let c = self.clients(clients)?;
                match self.read_output(&c.consumer, partition, from, end, abandon)? {
                    Some(records) => {
                        outcome.records += records;
                        Event::OutputRead { next: end }
                    }
                    None => return Ok(None),
                }
            }
            ref other => {
                return Err(KafkaError::Task { detail: format!("{other:?} is not a repair step") });
            }
        };
        Ok(Some(event))
    }

    fn clients<'c>(&self, clients: &'c mut Option<RepairClients>) -> Result<&'c RepairClients, KafkaError> {
        if clients.is_none() {
            *clients = Some(RepairClients {
                consumer: self.config.create().map_err(KafkaError::client("creating the repair consumer"))?,
                probe: self
                    .uncommitted_config
                    .create()
                    .map_err(KafkaError::client("creating the repair watermark probe"))?,
            });
        }
        Ok(clients.as_ref().expect("just created"))
    }

    /// Reads output `from..end` of `partition` (read_committed) and applies
    /// every record. `None` when `abandon` said so first.
    fn read_output(
        &self,
        consumer: &BaseConsumer,
        partition: i32,
        from: i64,
        end: i64,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Option<u64>, KafkaError> {
        let started = Instant::now();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.output_topic, partition, Offset::Offset(from))
            .map_err(KafkaError::client("assigning the output partition for repair"))?;
        consumer.assign(&tpl).map_err(KafkaError::client("assigning the output partition for repair"))?;

        let mut chunk: Vec<StoredEvent> = Vec::with_capacity(APPLY_CHUNK.min((end - from) as usize));
        let mut records = 0u64;
        let mut last_progress = Instant::now();
        let mut last_report = Instant::now();
        let progressed = |next: i64| {
            RepairProgressed { partition, remaining: end - next }.emit(&self.metrics);
        };
        progressed(from);
        let mut next = from;
        loop {
            // A repair over the whole horizon can read for a long time: say
            // where it is at a steady interval, not only when it is done.
            if last_report.elapsed() >= REPAIR_PROGRESS_INTERVAL {
                last_report = Instant::now();
                progressed(next);
                tracing::info!(
                    partition,
                    records,
                    remaining = end - next,
                    seconds = started.elapsed().as_secs(),
                    rate = records as f64 / started.elapsed().as_secs_f64().max(0.001),
                    "repair in progress"
                );
            }
            if abandon() {
                self.apply(partition, &mut chunk)?;
                RepairProgressed { partition, remaining: 0 }.emit(&self.metrics);
                return Ok(None);
            }
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    last_progress = Instant::now();
                    next = m.offset() + 1;
                    let position = Position::new(partition, m.offset());
                    let stored =
                        parse_output(&self.validator, position, m.headers(), m.payload()).map_err(|detail| {
                            KafkaError::ForeignOutputRecord {
                                topic: self.output_topic.clone(),
                                partition,
                                offset: m.offset(),
                                detail,
                            }
                        })?;
                    chunk.push(stored);
                    records += 1;
                    if chunk.len() >= APPLY_CHUNK {
                        self.apply(partition, &mut chunk)?;
                    }
                    if next >= end {
                        break;
                    }
                }
                Some(Err(RdError::PartitionEOF(_))) => break,
                // Retention deleted the position (`auto.offset.reset` is
                // `error`): what was applied stays applied, and the retry
                // starts over from the checkpoint, where the gap is seen.
                Some(Err(e)) if crate::kafka::clients::position_gone(&e) => {
                    self.apply(partition, &mut chunk)?;
                    return Err(KafkaError::Client { operation: "reading the output for repair", source: e });
                }
                Some(Err(e)) => {
                    // Transient broker errors are retried by librdkafka; only
                    // a lack of progress ends the repair.
                    tracing::debug!(partition, error = %e, "repair consumer error");
                }
                None => {}
            }
            if last_progress.elapsed() > self.stall_timeout {
                return Err(KafkaError::Task {
                    detail: format!(
                        "repair of output partition {partition} made no progress for {:?} (next offset {next}, end {end})",
                        self.stall_timeout,
                    ),
                });
            }
        }
        self.apply(partition, &mut chunk)?;
        Ok(Some(records))
    }

    /// Where a partition this instance has no state for starts: the first
    /// output record published within the horizon (record timestamps are
    /// ingest times, DESIGN §6), because older keys would be forgotten at
    /// once. Falls back to the log start, always correct, when the broker
    /// cannot look offsets up by time. Each lookup waits at most `timeout`;
    /// one that fails reads from the log start too (only longer).
    pub(crate) fn first_offset_within_horizon(
        &self,
        consumer: &BaseConsumer,
        partition: i32,
        low: i64,
        high: i64,
        timeout: Duration,
    ) -> i64 {
        let horizon_ms = i64::try_from(read_engine(&self.engine).horizon().as_millis()).unwrap_or(i64::MAX);
        let since = self.clock.now_ms().saturating_sub(horizon_ms);
        match self.offset_for_time(consumer, partition, since, timeout) {
            Ok(Some(Offset::Offset(o))) => o.clamp(low, high),
            // "No record at or after `since`": nothing within the horizon,
            // if the broker can look offsets up by time at all. Brokers that
            // cannot (librdkafka's mock cluster) give this same answer to
            // every time, so ask for time 0, which any record matches: only a
            // real lookup answers it with an offset.
            Ok(Some(Offset::End))
                if matches!(self.offset_for_time(consumer, partition, 0, timeout), Ok(Some(Offset::Offset(_)))) =>
            {
                high
            }
            Ok(other) => {
                tracing::debug!(partition, ?other, "no offset by time for repair; reading from the log start");
                low
            }
            Err(e) => {
                tracing::warn!(partition, error = %e, "cannot look up output offsets by time; repair reads from the log start");
                low
            }
        }
    }

    /// The broker's answer to "first output offset of `partition` with a
    /// timestamp at or after `ts_ms`".
    fn offset_for_time(
        &self,
        consumer: &BaseConsumer,
        partition: i32,
        ts_ms: i64,
        timeout: Duration,
    ) -> Result<Option<Offset>, RdError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.output_topic, partition, Offset::Offset(ts_ms))?;
        let found = consumer.offsets_for_times(tpl, timeout)?;
        Ok(found.find_partition(&self.output_topic, partition).map(|e| e.offset()))
    }

    fn apply(&self, partition: i32, chunk: &mut Vec<StoredEvent>) -> Result<(), KafkaError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        read_engine(&self.engine).apply_published(partition, chunk, now)?;
        chunk.clear();
        Ok(())
    }
}
