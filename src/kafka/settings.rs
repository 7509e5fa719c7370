//! What `dedupd run` needs to know, already validated by the caller
//! (`crate::config` builds it from flags, environment and TOML).

use std::net::SocketAddr;
use std::time::Duration;

/// How publishing and input offsets are tied together (DESIGN §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeliveryMode {
    /// Kafka transactions: output records and input offsets commit together;
    /// a zombie instance is fenced. Needs a broker with transactions.
    #[default]
    ExactlyOnce,
    /// Idempotent producer: publish, await every ack, apply, then commit the
    /// input offsets. A crash between publish and commit replays input that
    /// repair recognises, so the output stays exactly once.
    AtLeastOnce,
}

impl DeliveryMode {
    /// The flag spelling (`--delivery`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryMode::ExactlyOnce => "exactly-once",
            DeliveryMode::AtLeastOnce => "at-least-once",
        }
    }

    pub fn parse(s: &str) -> Option<DeliveryMode> {
        match s {
            "exactly-once" => Some(DeliveryMode::ExactlyOnce),
            "at-least-once" => Some(DeliveryMode::AtLeastOnce),
            _ => None,
        }
    }
}

impl std::fmt::Display for DeliveryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The four topics of one deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topics {
    pub input: String,
    /// Accepted events; co-partitioned with `input`.
    pub output: String,
    pub conflicts: String,
    pub rejected: String,
}

/// Bounds on one batch of one partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most records per batch.
    pub max_records: usize,
    /// Longest a batch waits for more records after its first one.
    pub max_wait: Duration,
}

impl Default for BatchLimits {
    fn default() -> BatchLimits {
        BatchLimits { max_records: 2000, max_wait: Duration::from_millis(20) }
    }
}

/// Settings of [`crate::kafka::run`].
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Consumer group id; also the prefix of the transactional id.
    pub group: String,
    pub topics: Topics,
    /// Static membership (`group.instance.id`); also makes the transactional
    /// id stable across restarts, which is what fences a zombie.
    pub instance_id: Option<String>,
    pub delivery: DeliveryMode,
    /// Extra librdkafka properties (TLS, SASL, tuning), applied to every
    /// client after dedupd's own. A key prefixed `consumer.` or `producer.`
    /// applies to that kind of client only, without the prefix.
    pub kafka_properties: Vec<(String, String)>,
    pub batch: BatchLimits,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None` serves nothing.
    pub metrics_addr: Option<SocketAddr>,
    /// Largest raw input copied into a rejected record; longer inputs are
    /// truncated (with their length and hash in headers) so a 1 MB record
    /// never trips the broker's `message.max.bytes`.
    pub max_rejected_raw_bytes: usize,
    /// Time allowed for one broker operation (transaction commit, flush,
    /// metadata) before it counts as failed.
    pub operation_timeout: Duration,
    /// How long a revoke waits for the partition's in-flight batch before
    /// giving the partition up anyway.
    pub revoke_timeout: Duration,
    /// How often local state is maintained and its gauges refreshed.
    pub maintain_interval: Duration,
}

impl RunSettings {
    /// Settings with dedupd's defaults for everything but the essentials.
    pub fn new(brokers: impl Into<String>, group: impl Into<String>, topics: Topics) -> RunSettings {
        RunSettings {
            brokers: brokers.into(),
            group: group.into(),
            topics,
            instance_id: None,
            delivery: DeliveryMode::ExactlyOnce,
            kafka_properties: Vec::new(),
            batch: BatchLimits::default(),
            metrics_addr: None,
            max_rejected_raw_bytes: 256 * 1024,
            operation_timeout: Duration::from_secs(30),
            revoke_timeout: Duration::from_secs(60),
            maintain_interval: Duration::from_secs(5),
        }
    }

    /// How long a transaction of ours may stay open before the broker aborts
    /// it: twice the operation timeout unless `transaction.timeout.ms` is
    /// passed through (`--kafka-property [producer.]transaction.timeout.ms=`).
    pub fn transaction_timeout(&self) -> Duration {
        self.kafka_properties
            .iter()
            .rev()
            .find(|(k, _)| k == "transaction.timeout.ms" || k == "producer.transaction.timeout.ms")
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .map_or(self.operation_timeout * 2, Duration::from_millis)
    }

    /// How long repair waits for a transaction left open on an output
    /// partition (by a peer that died mid-batch) to end: the peer's
    /// transaction timeout, assumed equal to ours, plus one operation.
    pub fn repair_settle_timeout(&self) -> Duration {
        self.transaction_timeout() + self.operation_timeout
    }

    /// The transactional id: stable for a static member, otherwise unique per
    /// process (fencing then rests on the consumer group generation, KIP-447).
    pub fn transactional_id(&self, process_nonce: u64) -> String {
        match &self.instance_id {
            Some(i) => format!("dedupd-{}-{}", self.group, i),
            None => format!("dedupd-{}-{:016x}", self.group, process_nonce),
        }
    }
}
