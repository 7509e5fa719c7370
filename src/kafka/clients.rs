//! librdkafka client configurations, and the broker checks made before any
//! record moves: topics exist, input and output are co-partitioned, the
//! broker speaks transactions when exactly-once is asked for.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::kafka::error::KafkaError;
use crate::kafka::settings::{DeliveryMode, RunSettings};

/// Which kind of client a configuration is for (selects the scoped
/// `consumer.`/`producer.` pass-through properties).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClientKind {
    Consumer,
    Producer,
}

pub(crate) fn apply_properties(cfg: &mut ClientConfig, props: &[(String, String)], kind: ClientKind) {
    for (k, v) in props {
        if let Some(k) = k.strip_prefix("consumer.") {
            if kind == ClientKind::Consumer {
                cfg.set(k, v);
            }
        } else if let Some(k) = k.strip_prefix("producer.") {
            if kind == ClientKind::Producer {
                cfg.set(k, v);
            }
        } else {
            cfg.set(k, v);
        }
    }
}

fn base(settings: &RunSettings) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &settings.brokers).set("client.id", "dedupd");
    cfg
}

/// The group consumer of the input topic.
pub fn input_consumer_config(settings: &RunSettings) -> ClientConfig {
    let mut cfg = base(settings);
    cfg.set("group.id", &settings.group)
        // Cooperative: a rebalance moves only the partitions that change
        // owner, so the others keep flowing (and keep their hot caches).
        .set("partition.assignment.strategy", "cooperative-sticky")
        // Offsets are committed by dedupd only, after the publish (at-least-
        // once) or inside the transaction (exactly-once); never ahead.
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        // Input written by transactional producers: never see aborted data.
        .set("isolation.level", "read_committed")
        // Low: some brokers (Tansu) hold every fetch for the full wait.
        .set("fetch.wait.max.ms", "10")
        .set("statistics.interval.ms", "1000")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "1000");
    if let Some(id) = &settings.instance_id {
        cfg.set("group.instance.id", id);
    }
    apply_properties(&mut cfg, &settings.kafka_properties, ClientKind::Consumer);
    cfg
}

/// The consumer repair uses to read an output partition back: assigned, not
/// subscribed, committed data only, reports the end of the partition.
pub fn repair_consumer_config(settings: &RunSettings) -> ClientConfig {
    let mut cfg = base(settings);
    cfg.set("group.id", format!("{}-repair", settings.group))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "5");
    apply_properties(&mut cfg, &settings.kafka_properties, ClientKind::Consumer);
    // Forced after the pass-through: repair is only correct on committed data
    // and only finishes when it sees the end of the partition. A position
    // retention deleted between the probe of the log start and the first
    // fetch (or overtaken during a long read) is an error, never a silent
    // jump to the new log start: the repair retries, finds the log start past
    // its checkpoint, and stops or counts the gap (`--on-output-gap`).
    cfg.set("isolation.level", "read_committed").set("enable.partition.eof", "true").set("auto.offset.reset", "error");
    cfg
}

/// Whether a consumer's error says its position is outside the partition
/// (retention passed it, or the topic was recreated) with
/// `auto.offset.reset=error`: output it had not read is gone, which repair
/// and a standby must never step over silently.
pub(crate) fn position_gone(e: &rdkafka::error::KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(rdkafka::types::RDKafkaErrorCode::OffsetOutOfRange | rdkafka::types::RDKafkaErrorCode::AutoOffsetReset)
    )
}

/// A `read_uncommitted` client of the brokers, for the output's high
/// watermark (a `read_committed` client is answered the last stable offset).
pub fn watermark_probe_config(settings: &RunSettings) -> ClientConfig {
    let mut cfg = base(settings);
    cfg.set("group.id", format!("{}-repair", settings.group)).set("enable.auto.commit", "false");
    apply_properties(&mut cfg, &settings.kafka_properties, ClientKind::Consumer);
    cfg.set("isolation.level", "read_uncommitted");
    cfg
}

/// The producer of output, conflicts and rejected records.
pub fn producer_config(settings: &RunSettings, transactional_id: Option<&str>) -> ClientConfig {
    let mut cfg = base(settings);
    cfg.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "zstd")
        .set("message.timeout.ms", settings.operation_timeout.as_millis().to_string());
    if let Some(id) = transactional_id {
        cfg.set("transactional.id", id)
            .set("transaction.timeout.ms", settings.transaction_timeout().as_millis().to_string());
    }
    apply_properties(&mut cfg, &settings.kafka_properties, ClientKind::Producer);
    if settings.delivery == DeliveryMode::AtLeastOnce {
        // Not negotiable: an idempotent producer is what keeps retried sends
        // from duplicating output within one producer session.
        cfg.set("enable.idempotence", "true");
    }
    cfg
}

/// Partition counts of the four topics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopicLayout {
    pub partitions: usize,
    pub conflicts_partitions: usize,
    pub rejected_partitions: usize,
    /// Of `--rollups-topic`, when set.
    pub rollups_partitions: Option<usize>,
}

/// Checks that every topic exists and input and output are co-partitioned.
/// Blocking: call from `spawn_blocking`.
pub fn check_topics(settings: &RunSettings, timeout: Duration) -> Result<TopicLayout, KafkaError> {
    let count = partition_counter(settings, timeout)?;
    let t = &settings.topics;
    let input = count(&t.input)?;
    let output = count(&t.output)?;
    if input != output {
        return Err(KafkaError::PartitionMismatch {
            input: t.input.clone(),
            input_partitions: input,
            output: t.output.clone(),
            output_partitions: output,
        });
    }
    Ok(TopicLayout {
        partitions: input,
        conflicts_partitions: count(&t.conflicts)?,
        rejected_partitions: count(&t.rejected)?,
        rollups_partitions: t.rollups.as_deref().map(&count).transpose()?,
    })
}

/// A function from topic name to its partition count, failing with
/// [`KafkaError::TopicMissing`] for a topic that does not exist. Blocking.
pub fn partition_counter(
    settings: &RunSettings,
    timeout: Duration,
) -> Result<impl Fn(&str) -> Result<usize, KafkaError> + '_, KafkaError> {
    let consumer: BaseConsumer =
        repair_consumer_config(settings).create().map_err(KafkaError::client("creating the metadata client"))?;
    Ok(move |topic: &str| {
        let md =
            consumer.fetch_metadata(Some(topic), timeout).map_err(KafkaError::client("fetching topic metadata"))?;
        let t = md.topics().iter().find(|t| t.name() == topic);
        match t {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(t.partitions().len()),
            _ => Err(KafkaError::TopicMissing { topic: topic.to_owned(), brokers: settings.brokers.clone() }),
        }
    })
}

/// Kafka API keys a transactional producer needs.
const TXN_APIS: [(i16, &str); 5] = [
    (22, "InitProducerId"),
    (24, "AddPartitionsToTxn"),
    (25, "AddOffsetsToTxn"),
    (26, "EndTxn"),
    (28, "TxnOffsetCommit"),
];

/// Asks the first bootstrap broker which APIs it serves (ApiVersions v0 over
/// plain TCP) and names the transaction APIs it lacks. `Ok(None)` when the
/// check does not apply (TLS or SASL: librdkafka's own errors then speak).
///
/// librdkafka cannot be asked this directly, and a broker without `EndTxn`
/// would only fail at the first commit, after records were produced.
/// Blocking: call from `spawn_blocking`.
pub fn missing_transaction_apis(
    settings: &RunSettings,
    timeout: Duration,
) -> Result<Option<Vec<&'static str>>, String> {
    let plaintext = settings
        .kafka_properties
        .iter()
        .filter(|(k, _)| k == "security.protocol" || k == "producer.security.protocol")
        .all(|(_, v)| v.eq_ignore_ascii_case("plaintext"));
    if !plaintext {
        return Ok(None);
    }
    let first = settings.brokers.split(',').next().unwrap_or("").trim();
    let first = first.split_once("://").map_or(first, |(_, rest)| rest);
    let addr = first
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {first}: {e}"))?
        .next()
        .ok_or_else(|| format!("{first} resolves to no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let client_id = b"dedupd-probe";
    let mut req = Vec::with_capacity(32);
    req.extend_from_slice(&18i16.to_be_bytes()); // ApiVersions
    req.extend_from_slice(&0i16.to_be_bytes()); // v0
    req.extend_from_slice(&1i32.to_be_bytes()); // correlation id
    req.extend_from_slice(&(client_id.len() as i16).to_be_bytes());
    req.extend_from_slice(client_id);
    let mut frame = (req.len() as i32).to_be_bytes().to_vec();
    frame.extend_from_slice(&req);
    s.write_all(&frame).map_err(|e| format!("ApiVersions request to {addr}: {e}"))?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| format!("ApiVersions response from {addr}: {e}"))?;
    let len = i32::from_be_bytes(len);
    if !(0..=1_000_000).contains(&len) {
        return Err(format!("ApiVersions response from {addr} has length {len}"));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).map_err(|e| format!("ApiVersions response from {addr}: {e}"))?;
    let apis = parse_api_versions_v0(&body).ok_or_else(|| format!("ApiVersions response from {addr} is malformed"))?;
    Ok(Some(TXN_APIS.iter().filter(|(key, _)| !apis.contains(key)).map(|(_, name)| *name).collect()))
}

/// Parses an ApiVersions v0 response body (after the length): correlation id,
/// error code, then `[api_key min max]`. Returns the keys served.
fn parse_api_versions_v0(body: &[u8]) -> Option<Vec<i16>> {
    let i16_at = |o: usize| body.get(o..o + 2).map(|b| i16::from_be_bytes([b[0], b[1]]));
    let error = i16_at(4)?;
    if error != 0 {
        return None;
    }
    let n = body.get(6..10).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))?;
    let mut keys = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        keys.push(i16_at(10 + i * 6)?);
    }
    Some(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_versions_body_lists_its_keys() {
        let mut body = vec![0, 0, 0, 1, 0, 0, 0, 0, 0, 2];
        body.extend_from_slice(&[0, 22, 0, 0, 0, 4, 0, 26, 0, 0, 0, 3]);
        assert_eq!(parse_api_versions_v0(&body), Some(vec![22, 26]));
        assert_eq!(parse_api_versions_v0(&body[..14]), None);
    }

    #[test]
    fn scoped_properties_reach_only_their_client_kind() {
        let mut s = RunSettings::new("127.0.0.1:9", "g", crate::kafka::Topics::of("i", "o", "c", "r"));
        s.kafka_properties = vec![
            ("consumer.fetch.wait.max.ms".into(), "77".into()),
            ("producer.linger.ms".into(), "9".into()),
            ("client.id".into(), "x".into()),
        ];
        let c = input_consumer_config(&s);
        let p = producer_config(&s, None);
        assert_eq!(c.get("fetch.wait.max.ms"), Some("77"));
        // Repair never jumps over output it did not apply, whatever is passed.
        s.kafka_properties.push(("consumer.auto.offset.reset".into(), "earliest".into()));
        assert_eq!(repair_consumer_config(&s).get("auto.offset.reset"), Some("error"));
        assert_eq!(c.get("linger.ms"), None);
        assert_eq!(p.get("linger.ms"), Some("9"));
        assert_eq!(p.get("client.id"), Some("x"));
    }
}
