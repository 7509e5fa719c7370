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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::classify::Clock;
use crate::event::{Position, Validator};
use crate::kafka::engine::{Engine, StoredEvent};
use crate::kafka::error::KafkaError;
use crate::kafka::records::parse_output;
use crate::kafka::settings::OnOutputGap;
use crate::metrics::{Metrics, RepairGapFound, RepairProgressed};

/// Records applied per engine call: bounds memory and engine lock hold time.
const APPLY_CHUNK: usize = 4096;

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
    pub engine: Arc<Mutex<Box<dyn Engine>>>,
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

pub(crate) fn lock_engine(engine: &Mutex<Box<dyn Engine>>) -> std::sync::MutexGuard<'_, Box<dyn Engine>> {
    // A panic while holding the lock leaves the engine as it was before the
    // panicking call's first write; engines apply idempotently by output
    // offset, so carrying on is safe.
    engine.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How often a running repair logs its progress.
const REPAIR_PROGRESS_INTERVAL: Duration = Duration::from_secs(10);

impl Repairer {
    /// Repairs `partition`. Blocking (network and fsync): run it on a
    /// blocking thread. `abandon` is asked while repair waits or reads: when
    /// it says yes (the partition was revoked), repair stops and returns
    /// `None`; what it applied so far stays (applying is idempotent).
    pub fn repair_blocking(
        &self,
        partition: i32,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Option<RepairOutcome>, KafkaError> {
        let started = Instant::now();
        let (checkpoint, furthest) = {
            let engine = lock_engine(&self.engine);
            (engine.checkpoint(partition), engine.furthest_checkpoint(partition))
        };
        let consumer: BaseConsumer =
            self.config.create().map_err(KafkaError::client("creating the repair consumer"))?;
        let probe: BaseConsumer =
            self.uncommitted_config.create().map_err(KafkaError::client("creating the repair watermark probe"))?;
        let (_, hwm) = probe
            .fetch_watermarks(&self.output_topic, partition, self.stall_timeout)
            .map_err(KafkaError::client("reading the output high watermark for repair"))?;
        drop(probe);
        // The furthest tier decides this check: a tier with no checkpoint
        // (a dropped or moved key store) beside one that has one must not
        // hide a recreated output topic, or the other tier would skip the
        // new topic's offsets as already applied.
        if let Some(c) = furthest.filter(|&c| c >= hwm) {
            return Err(KafkaError::StateAheadOfOutput {
                topic: self.output_topic.clone(),
                partition,
                checkpoint: c,
                end: hwm,
            });
        }
        // With `read_committed` the broker answers (log start, LSO).
        let mut stable = || {
            consumer
                .fetch_watermarks(&self.output_topic, partition, self.stall_timeout)
                .map_err(KafkaError::client("reading the output last stable offset for repair"))
        };
        let Some((low, high)) =
            wait_for_stable_end(partition, hwm, &mut stable, abandon, self.settle_timeout, Duration::from_millis(200))?
        else {
            return Ok(None);
        };
        let from = match checkpoint {
            Some(c) => {
                let (from, gap) = start_after_checkpoint(&self.output_topic, partition, c, low, self.on_output_gap)?;
                if gap > 0 {
                    RepairGapFound { partition, records: gap }.emit(&self.metrics);
                }
                from
            }
            None => self.first_offset_within_horizon(&consumer, partition, low, high),
        };
        if from >= high {
            return Ok(Some(RepairOutcome { from_offset: from, records: 0, duration: started.elapsed() }));
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.output_topic, partition, Offset::Offset(from))
            .map_err(KafkaError::client("assigning the output partition for repair"))?;
        consumer.assign(&tpl).map_err(KafkaError::client("assigning the output partition for repair"))?;

        let mut chunk: Vec<StoredEvent> = Vec::with_capacity(APPLY_CHUNK.min((high - from) as usize));
        let mut records = 0u64;
        let mut last_progress = Instant::now();
        let mut last_report = Instant::now();
        let progressed = |records: u64| {
            RepairProgressed { partition, remaining: high - (from + records as i64) }.emit(&self.metrics);
        };
        progressed(0);
        loop {
            // A repair over the whole horizon can read for a long time: say
            // where it is at a steady interval, not only when it is done.
            if last_report.elapsed() >= REPAIR_PROGRESS_INTERVAL {
                last_report = Instant::now();
                progressed(records);
                let next = from + records as i64;
                tracing::info!(
                    partition,
                    records,
                    remaining = high - next,
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
                    if m.offset() + 1 >= high {
                        break;
                    }
                }
                Some(Err(RdError::PartitionEOF(_))) => break,
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
                        "repair of output partition {partition} made no progress for {:?} (next offset {}, end {high})",
                        self.stall_timeout,
                        from + records as i64
                    ),
                });
            }
        }
        self.apply(partition, &mut chunk)?;
        Ok(Some(RepairOutcome { from_offset: from, records, duration: started.elapsed() }))
    }

    /// Where a partition this instance has no state for starts: the first
    /// output record published within the horizon (record timestamps are
    /// ingest times, DESIGN §6), because older keys would be forgotten at
    /// once. Falls back to the log start, always correct, when the broker
    /// cannot look offsets up by time.
    fn first_offset_within_horizon(&self, consumer: &BaseConsumer, partition: i32, low: i64, high: i64) -> i64 {
        let horizon_ms = i64::try_from(lock_engine(&self.engine).horizon().as_millis()).unwrap_or(i64::MAX);
        let since = self.clock.now_ms().saturating_sub(horizon_ms);
        match self.offset_for_time(consumer, partition, since) {
            Ok(Some(Offset::Offset(o))) => o.clamp(low, high),
            // "No record at or after `since`": nothing within the horizon,
            // if the broker can look offsets up by time at all. Brokers that
            // cannot (librdkafka's mock cluster) give this same answer to
            // every time, so ask for time 0, which any record matches: only a
            // real lookup answers it with an offset.
            Ok(Some(Offset::End))
                if matches!(self.offset_for_time(consumer, partition, 0), Ok(Some(Offset::Offset(_)))) =>
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
    fn offset_for_time(&self, consumer: &BaseConsumer, partition: i32, ts_ms: i64) -> Result<Option<Offset>, RdError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.output_topic, partition, Offset::Offset(ts_ms))?;
        let found = consumer.offsets_for_times(tpl, self.stall_timeout)?;
        Ok(found.find_partition(&self.output_topic, partition).map(|e| e.offset()))
    }

    fn apply(&self, partition: i32, chunk: &mut Vec<StoredEvent>) -> Result<(), KafkaError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        lock_engine(&self.engine).apply_published(partition, chunk, now)?;
        chunk.clear();
        Ok(())
    }
}

/// Where repair of a partition with checkpoint `c` starts, given the
/// output's log start `low`: right after the checkpoint, unless retention
/// deleted output this instance never applied. Retries of those events can
/// no longer be recognised, so that gap stops the worker (naming it) unless
/// the operator chose to continue; then repair starts at the log start and
/// the gap size is returned to be counted.
fn start_after_checkpoint(
    topic: &str,
    partition: i32,
    c: i64,
    low: i64,
    on_gap: OnOutputGap,
) -> Result<(i64, u64), KafkaError> {
    let first_missing = c.saturating_add(1);
    if first_missing >= low {
        return Ok((first_missing, 0));
    }
    let missing = low - first_missing;
    match on_gap {
        OnOutputGap::Stop => Err(KafkaError::OutputGap {
            topic: topic.to_owned(),
            partition,
            checkpoint: c,
            first_missing,
            log_start: low,
            missing,
        }),
        OnOutputGap::Continue => Ok((low, u64::try_from(missing).unwrap_or(0))),
    }
}

/// Polls `stable` (log start, last stable offset) until the LSO reaches
/// `hwm`, the high watermark seen when repair began: then no transaction
/// that wrote below `hwm` is still open, and reading committed data up to the
/// returned LSO misses nothing that can still commit. Fails after `timeout`
/// rather than end repair early; `None` when `abandon` says so first.
fn wait_for_stable_end(
    partition: i32,
    hwm: i64,
    stable: &mut dyn FnMut() -> Result<(i64, i64), KafkaError>,
    abandon: &dyn Fn() -> bool,
    timeout: Duration,
    poll_every: Duration,
) -> Result<Option<(i64, i64)>, KafkaError> {
    let started = Instant::now();
    let mut warned = false;
    loop {
        let (low, lso) = stable()?;
        if lso >= hwm {
            return Ok(Some((low, lso)));
        }
        if abandon() {
            return Ok(None);
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(KafkaError::Task {
                detail: format!(
                    "repair of output partition {partition}: a transaction on the output stayed open for {waited:?} \
                     (last stable offset {lso}, high watermark {hwm}); refusing to consume input before it ends, \
                     because its events may still commit"
                ),
            });
        }
        if !warned && waited >= Duration::from_secs(1) {
            warned = true;
            tracing::warn!(
                partition,
                lso,
                hwm,
                "repair waiting for an open transaction on the output partition to commit or abort (a previous owner died mid-batch)"
            );
        }
        std::thread::sleep(poll_every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(answers: Vec<(i64, i64)>) -> impl FnMut() -> Result<(i64, i64), KafkaError> {
        let mut it = answers.into_iter();
        move || Ok(it.next().expect("asked more often than scripted"))
    }

    #[test]
    fn a_retention_gap_below_the_log_start_stops_the_worker_naming_it() {
        let err = start_after_checkpoint("out", 2, 99, 150, OnOutputGap::Stop).expect_err("a gap must stop");
        let text = err.to_string();
        assert!(matches!(err, KafkaError::OutputGap { missing: 50, first_missing: 100, log_start: 150, .. }));
        assert!(text.contains("100..150") && text.contains("--on-output-gap continue"), "{text}");
    }

    #[test]
    fn a_retention_gap_is_skipped_and_counted_only_when_asked_to_continue() {
        assert_eq!(start_after_checkpoint("out", 0, 99, 150, OnOutputGap::Continue).expect("continues"), (150, 50));
        assert_eq!(start_after_checkpoint("out", 0, 149, 150, OnOutputGap::Stop).expect("no gap"), (150, 0));
        assert_eq!(start_after_checkpoint("out", 0, 7, 0, OnOutputGap::Stop).expect("no gap"), (8, 0));
    }

    #[test]
    fn repair_end_waits_until_open_transactions_below_the_high_watermark_end() {
        // A dead owner's transaction holds the LSO at 40 until it aborts and
        // the LSO jumps past the HWM seen at start (50).
        let mut stable = replay(vec![(0, 40), (0, 40), (0, 40), (0, 52)]);
        let end = wait_for_stable_end(0, 50, &mut stable, &|| false, Duration::from_secs(5), Duration::ZERO);
        assert_eq!(end.expect("ends"), Some((0, 52)));
    }

    #[test]
    fn repair_end_is_immediate_without_open_transactions() {
        let mut stable = replay(vec![(3, 50)]);
        let end = wait_for_stable_end(0, 50, &mut stable, &|| false, Duration::ZERO, Duration::ZERO);
        assert_eq!(end.expect("ends"), Some((3, 50)));
    }

    #[test]
    fn repair_fails_rather_than_stop_short_of_a_transaction_that_never_ends() {
        let mut stable = || Ok((0, 10));
        let err =
            wait_for_stable_end(7, 11, &mut stable, &|| false, Duration::from_millis(30), Duration::from_millis(5))
                .expect_err("must not end repair below the high watermark");
        let text = err.to_string();
        assert!(text.contains("partition 7") && text.contains("last stable offset 10"), "{text}");
    }

    #[test]
    fn a_revoke_abandons_the_wait_for_an_open_transaction() {
        let stable = || Ok((0, 10));
        let revoked = std::sync::atomic::AtomicBool::new(false);
        let mut asked = 0;
        let mut stable_then_revoke = || {
            asked += 1;
            if asked == 3 {
                revoked.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            stable()
        };
        let end = wait_for_stable_end(
            0,
            11,
            &mut stable_then_revoke,
            &|| revoked.load(std::sync::atomic::Ordering::SeqCst),
            Duration::from_secs(60),
            Duration::ZERO,
        );
        assert_eq!(end.expect("abandoned, not failed"), None);
        assert_eq!(asked, 3, "stops at the first look after the revoke");
    }
}
