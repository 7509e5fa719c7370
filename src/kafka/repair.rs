//! Repair: read output partition `p` from the local checkpoint to its end and
//! apply every record to local state, before any input of `p` is consumed
//! (DESIGN §1.4, §6). The output topic is the source of truth; local state
//! is its materialised view.
//!
//! Read committed only: an aborted transaction's records never enter state.
//! The end is librdkafka's partition-EOF event, which with `read_committed`
//! arrives at the last stable offset, past any trailing transaction marker.

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

impl Repairer {
    /// Repairs `partition`. Blocking (network and fsync): run it on a
    /// blocking thread.
    pub fn repair_blocking(&self, partition: i32) -> Result<RepairOutcome, KafkaError> {
        let started = Instant::now();
        let checkpoint = lock_engine(&self.engine).checkpoint(partition);
        let consumer: BaseConsumer =
            self.config.create().map_err(KafkaError::client("creating the repair consumer"))?;
        let (low, high) = consumer
            .fetch_watermarks(&self.output_topic, partition, self.stall_timeout)
            .map_err(KafkaError::client("reading output watermarks for repair"))?;
        let from = checkpoint.map_or(low, |c| c.saturating_add(1)).max(low);
        if from >= high {
            return Ok(RepairOutcome { from_offset: from, records: 0, duration: started.elapsed() });
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.output_topic, partition, Offset::Offset(from))
            .map_err(KafkaError::client("assigning the output partition for repair"))?;
        consumer.assign(&tpl).map_err(KafkaError::client("assigning the output partition for repair"))?;

        let mut chunk: Vec<StoredEvent> = Vec::with_capacity(APPLY_CHUNK.min((high - from) as usize));
        let mut records = 0u64;
        let mut last_progress = Instant::now();
        loop {
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
        Ok(RepairOutcome { from_offset: from, records, duration: started.elapsed() })
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
