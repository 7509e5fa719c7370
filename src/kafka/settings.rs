//! What `dedupd run` needs to know, already validated by the caller
//! (`crate::config` builds it from flags, environment and TOML).

use std::net::SocketAddr;
use std::time::Duration;

pub use crate::classify::OnMisrouted;
pub use crate::event::Partitioner;
pub use crate::pipeline::{DeliveryMode, OnOutputGap};

/// The four topics of one deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topics {
    pub input: String,
    /// Accepted events; co-partitioned with `input`.
    pub output: String,
    pub conflicts: String,
    pub rejected: String,
    /// Hourly rollups and adjustments of the usage ledger (`--rollups-topic`),
    /// compacted; none published when `None`.
    pub rollups: Option<String>,
    /// The compacted topic of closed and reopened billing periods
    /// (`--periods-topic`), followed so usage into a closed period is
    /// rejected; no period is closed when `None`.
    pub periods: Option<String>,
}

impl Topics {
    /// The four topics, with no rollups or periods topic.
    pub fn of(
        input: impl Into<String>,
        output: impl Into<String>,
        conflicts: impl Into<String>,
        rejected: impl Into<String>,
    ) -> Topics {
        Topics {
            input: input.into(),
            output: output.into(),
            conflicts: conflicts.into(),
            rejected: rejected.into(),
            rollups: None,
            periods: None,
        }
    }
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
    /// Keys of `kafka_properties` whose values came from `--kafka-secret`:
    /// masked wherever settings are shown, like every key
    /// [`is_secret_property`](crate::config::is_secret_property) recognises.
    pub kafka_secret_keys: Vec<String>,
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
    /// A partition with input that makes no progress for this long makes
    /// `/healthz` fail, so an orchestrator restarts the worker.
    pub stall_timeout: Duration,
    /// See [`OnOutputGap`].
    pub on_output_gap: OnOutputGap,
    /// Which input partition each identity belongs on (`--partitioner`).
    pub partitioner: Partitioner,
    /// See [`OnMisrouted`].
    pub on_misrouted: OnMisrouted,
    /// How many other workers keep each partition's local state warm by
    /// following its output (`--standby-replicas`; 0: none). See
    /// `crate::pipeline::standby`.
    pub standby_replicas: u32,
    /// At least once with a rollups topic: how long a published batch's
    /// rollups may wait, while input keeps coming, to be published with
    /// later batches'
    /// (`--rollups-interval`; zero: each batch publishes its own). One
    /// record then carries every change to an hour in the interval. The
    /// input offsets of those batches commit with their rollups, so a
    /// crash replays them and their rollups go out again. Exactly once,
    /// each transaction carries its own batch's rollups, whatever this is.
    pub rollups_interval: Duration,
}

/// The longest `--rollups-interval`: a crash replays up to this much input.
pub const MAX_ROLLUPS_INTERVAL: Duration = Duration::from_secs(60);

/// Kafka's default `transaction.abort.timed.out.transaction.cleanup.interval.ms`:
/// how often a broker aborts transactions past their timeout.
pub const BROKER_TRANSACTION_ABORT_CHECK: Duration = Duration::from_secs(10);

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
            kafka_secret_keys: Vec::new(),
            batch: BatchLimits::default(),
            metrics_addr: None,
            max_rejected_raw_bytes: 256 * 1024,
            operation_timeout: Duration::from_secs(30),
            revoke_timeout: Duration::from_secs(60),
            maintain_interval: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(300),
            on_output_gap: OnOutputGap::Stop,
            partitioner: Partitioner::Dedupd,
            on_misrouted: OnMisrouted::Count,
            standby_replicas: 0,
            rollups_interval: Duration::from_secs(5),
        }
    }

    /// The effective settings on one line, for the start-up log and
    /// `dedupd check-config`, with every secret property shown as `***`.
    pub fn describe(&self) -> String {
        let props: Vec<String> = self
            .kafka_properties
            .iter()
            .map(|(k, v)| {
                let secret = crate::config::is_secret_property(k) || self.kafka_secret_keys.contains(k);
                format!("{k}={}", if secret { "***" } else { v.as_str() })
            })
            .collect();
        let d = |d: Duration| humantime::format_duration(d).to_string();
        format!(
            "brokers={} group={} instance_id={} delivery={:?} input={} output={} conflicts={} rejected={} \
             rollups={} periods={} batch_max_records={} batch_max_wait={} operation_timeout={} revoke_timeout={} stall_timeout={} \
             on_output_gap={:?} partitioner={} on_misrouted={} standby_replicas={} rollups_interval={} metrics_addr={} kafka_properties=[{}]",
            self.brokers,
            self.group,
            self.instance_id.as_deref().unwrap_or("-"),
            self.delivery,
            self.topics.input,
            self.topics.output,
            self.topics.conflicts,
            self.topics.rejected,
            self.topics.rollups.as_deref().unwrap_or("-"),
            self.topics.periods.as_deref().unwrap_or("-"),
            self.batch.max_records,
            d(self.batch.max_wait),
            d(self.operation_timeout),
            d(self.revoke_timeout),
            d(self.stall_timeout),
            self.on_output_gap,
            self.partitioner,
            self.on_misrouted.as_str(),
            self.standby_replicas,
            d(self.rollups_interval),
            self.metrics_addr.map_or_else(|| "-".to_owned(), |a| a.to_string()),
            props.join(", "),
        )
    }

    /// The longest an orderly shutdown (SIGTERM) can take: every partition's
    /// in-flight batch finishes or is abandoned within the revoke timeout,
    /// then the producer flush and the consumer's leaving the group each
    /// take at most one operation timeout. Orchestrator grace periods must
    /// exceed it, or a slow shutdown is SIGKILLed half way (safe, but the
    /// next start repairs and the group rebalances twice).
    pub fn shutdown_budget(&self) -> Duration {
        self.revoke_timeout + 2 * self.operation_timeout
    }

    /// The producer's `message.max.bytes`: the largest record it sends
    /// (librdkafka's default unless passed through).
    pub fn producer_message_max_bytes(&self) -> Result<usize, String> {
        match self
            .kafka_properties
            .iter()
            .rev()
            .find(|(k, _)| k == "message.max.bytes" || k == "producer.message.max.bytes")
        {
            Some((_, v)) => v.parse::<usize>().map_err(|_| format!("message.max.bytes={v:?} is not a number")),
            None => Ok(1_000_000),
        }
    }

    /// Checks, before any I/O, that every record dedupd may write fits the
    /// producer's `message.max.bytes`; otherwise such a record would be
    /// refused for ever and its partition would stall. Names both values.
    pub fn check_record_bounds(&self, max_output_bytes: usize, max_id_bytes: usize) -> Result<(), String> {
        use crate::kafka::records::{MAX_SIDE_KEY_BYTES, RECORD_OVERHEAD_BYTES};
        let limit = self.producer_message_max_bytes()?;
        let output = max_output_bytes + 2 * max_id_bytes + 1 + RECORD_OVERHEAD_BYTES;
        if output > limit {
            return Err(format!(
                "max_output_bytes {max_output_bytes} (plus key and headers: {output}) exceeds the producer's \
                 message.max.bytes {limit}: lower max_output_bytes or raise message.max.bytes (and the topics' \
                 max.message.bytes)"
            ));
        }
        let rejected = self.max_rejected_raw_bytes + MAX_SIDE_KEY_BYTES + RECORD_OVERHEAD_BYTES;
        if rejected > limit {
            return Err(format!(
                "max_rejected_raw_bytes {} (plus key and headers: {rejected}) exceeds the producer's \
                 message.max.bytes {limit}",
                self.max_rejected_raw_bytes
            ));
        }
        if self.stall_timeout < self.operation_timeout {
            return Err(format!(
                "stall_timeout {:?} is shorter than the operation timeout {:?}: one slow broker call would \
                 already count as a stall",
                self.stall_timeout, self.operation_timeout
            ));
        }
        Ok(())
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

    /// How long repair waits for a dead peer's open transaction before it
    /// gives up and stops the worker: [`repair_settle_timeout`], plus the
    /// interval at which a Kafka broker looks for timed-out transactions to
    /// abort (`transaction.abort.timed.out.transaction.cleanup.interval.ms`,
    /// 10 s by default): a transaction is aborted up to that long after its
    /// timeout. Without it, an `--operation-timeout` under about 10 s made
    /// repair give up before the broker's abort, and the worker restarted
    /// until the abort came.
    ///
    /// [`repair_settle_timeout`]: Self::repair_settle_timeout
    pub fn repair_open_transaction_wait(&self) -> Duration {
        self.repair_settle_timeout() + BROKER_TRANSACTION_ABORT_CHECK
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Repair waits for a dead peer's transaction past the moment a broker
    /// aborts it: its timeout plus the broker's abort check, plus one call.
    /// With a 5 s operation timeout (transaction timeout 10 s) the broker
    /// may abort at 20 s; the wait was 15 s.
    #[test]
    fn repair_outwaits_the_brokers_abort_of_a_dead_peers_transaction() {
        let mut s = RunSettings::new("b", "g", Topics::of("i", "o", "c", "r"));
        for secs in [5, 30] {
            s.operation_timeout = Duration::from_secs(secs);
            let aborted_by = s.transaction_timeout() + BROKER_TRANSACTION_ABORT_CHECK;
            assert!(s.repair_open_transaction_wait() >= aborted_by + s.operation_timeout, "{secs}s");
        }
    }
}
