//! Errors of the Kafka worker.

use crate::kafka::engine::EngineError;
use crate::metrics::MetricsError;

/// Why the worker could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    #[error("kafka client error while {operation}: {source}")]
    Client {
        operation: &'static str,
        #[source]
        source: rdkafka::error::KafkaError,
    },
    #[error("topic `{topic}` does not exist on {brokers} (create it before starting dedupd)")]
    TopicMissing { topic: String, brokers: String },
    #[error(
        "input topic `{input}` has {input_partitions} partitions but output topic `{output}` has {output_partitions}: \
         they must be co-partitioned (output partition p is the changelog of input partition p)"
    )]
    PartitionMismatch { input: String, input_partitions: usize, output: String, output_partitions: usize },
    #[error(
        "the broker at {brokers} does not support Kafka transactions ({detail}); \
         exactly-once delivery needs them: run with `--delivery at-least-once` against this broker"
    )]
    TransactionsUnsupported { brokers: String, detail: String },
    #[error(
        "the producer cannot go on ({source}): a newer instance with transactional id `{transactional_id}` fenced \
         it, or an idempotence error made it fatal; restart to repair from the output topic"
    )]
    Fenced {
        transactional_id: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },
    #[error(
        "local state has applied output partition {partition} of `{topic}` up to offset {checkpoint}, but the \
         partition ends at {end}: the output topic was recreated or truncated. Refusing to consume, because \
         state that skips the new offsets would publish retries again; move the state directory aside to \
         rebuild it from the output topic"
    )]
    StateAheadOfOutput { topic: String, partition: i32, checkpoint: i64, end: i64 },
    #[error(
        "retention deleted output records {first_missing}..{log_start} of `{topic}` partition {partition} before \
         local state applied them (checkpoint {checkpoint}): retries of those {missing} events could no longer be \
         recognised and would be billed twice. Keep the output topic's retention longer than the dedupe horizon plus --max-future-skew; \
         to go on anyway and count the gap, run with `--on-output-gap continue`"
    )]
    OutputGap { topic: String, partition: i32, checkpoint: i64, first_missing: i64, log_start: i64, missing: i64 },
    #[error("publishing a batch of input partition {partition} failed for good: {source}")]
    Publish {
        partition: i32,
        #[source]
        source: crate::kafka::publisher::PublishError,
    },
    #[error("the Kafka consumer cannot go on: {detail}")]
    ConsumerFatal { detail: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A usage or period total the rollups topic's sums cannot give exactly.
    #[error(transparent)]
    Total(#[from] crate::ledger::FoldError),
    #[error("output record {partition}@{offset} of topic `{topic}` is not a dedupd record: {detail}")]
    ForeignOutputRecord { topic: String, partition: i32, offset: i64, detail: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("a worker task failed: {detail}")]
    Task { detail: String },
}

impl KafkaError {
    /// The worker's error for a decision of the core on `partition` of the
    /// output topic `topic`.
    pub(crate) fn from_life(e: crate::pipeline::LifeError, topic: &str, partition: i32) -> KafkaError {
        use crate::pipeline::LifeError as L;
        let topic = topic.to_owned();
        match e {
            L::StateAheadOfOutput { checkpoint, end } => {
                KafkaError::StateAheadOfOutput { topic, partition, checkpoint, end }
            }
            L::OutputGap { checkpoint, first_missing, log_start, missing } => {
                KafkaError::OutputGap { topic, partition, checkpoint, first_missing, log_start, missing }
            }
            other => {
                KafkaError::Task { detail: format!("repair of output partition {partition} of `{topic}`: {other}") }
            }
        }
    }

    pub(crate) fn client(operation: &'static str) -> impl FnOnce(rdkafka::error::KafkaError) -> KafkaError {
        move |source| KafkaError::Client { operation, source }
    }
}
