//! The `dedupd` binary: parse flags, set up logging, dispatch. Everything
//! else lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{FromArgMatches, Parser, Subcommand};

use dedupd::classify::SystemClock;
use dedupd::config::{EngineSettings, FileConfig, PropertySource, TuningArgs};
use dedupd::kafka::demo::DemoSettings;
use dedupd::kafka::{
    DeliveryMode, OnMisrouted, OnOutputGap, Partitioner, RunSettings, StateEngine, Topics, WorkerParts,
};
use dedupd::metrics::Metrics;
use dedupd::offline::{run_dedupe_with_progress, DedupeOptions, Stdio};
use dedupd::state::LocalState;
use std::sync::Arc;

/// The binary allocates through mimalloc: the hot path makes many small,
/// short-lived allocations per event on several threads at once, and a
/// profile of the durable batch path spent about a sixth of its time in
/// glibc's malloc and free. `benches/engine.rs` declares the same, so it
/// measures what ships; the tests keep the system allocator (one of them
/// counts bytes through its own).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "dedupd", version, about = "Exactly-once deduplication of usage events for billing")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format on standard error: `text` (coloured only on a terminal) or
    /// `json` (one object per line). The filter comes from RUST_LOG (e.g.
    /// `info,rdkafka=warn`); DEDUPD_LOG, when set, overrides it.
    #[arg(long, global = true, env = "DEDUPD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once at start-up; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// The Kafka worker: input topic to output topic, exactly once.
    Run {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Validates a `dedupd run` configuration (flags, environment, file) by
    /// the same code path as `run`, prints the effective settings with
    /// secrets masked, and exits: 0 when valid, 2 naming the bad key.
    CheckConfig {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// The router: consumes a raw topic with any keys and partitioning and
    /// produces each record to the input topic keyed `tenant_id \0 event_id`,
    /// on the partition `--partitioner` gives its identity (exactly once by
    /// default). Records without an identity go to the rejected topic. Give
    /// it its own `--group`, and the workers' `--derive-salt`.
    Route {
        /// The topic producers write to, keyed and partitioned any way.
        #[arg(long, env = "DEDUPD_RAW_TOPIC")]
        raw_topic: Option<String>,
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Offline mode: dedupe NDJSON with the same engine as the Kafka worker.
    Dedupe {
        /// NDJSON input file, or - for standard input.
        #[arg(long, env = "DEDUPD_INPUT")]
        input: Stdio,
        /// Accepted events as canonical NDJSON: a file, or - for standard output
        /// (a pipe or /dev/null works too, and is not fsynced).
        #[arg(long, env = "DEDUPD_OUTPUT")]
        output: Stdio,
        /// Keep state here across runs (the output file is then appended to).
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Write rejected records here, one JSON line each.
        #[arg(long, env = "DEDUPD_REJECTED")]
        rejected: Option<PathBuf>,
        /// Write conflicting records here, one JSON line each.
        #[arg(long, env = "DEDUPD_CONFLICTS")]
        conflicts: Option<PathBuf>,
        /// Records per batch.
        #[arg(long, env = "DEDUPD_BATCH_RECORDS", default_value_t = 1000)]
        batch_records: usize,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Checks every checksum of a state directory; exits 1 on any corruption.
    Verify {
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: PathBuf,
    },
    /// Usage totals from the ledger of a state directory: rollups summed over
    /// the partitions it holds, grouped, with the late events that became
    /// adjustments. Read-only; works beside a running worker. (`--group-by
    /// dimension:KEY` refolds the accepted events instead: from the output
    /// topic, or from a state directory it opens and locks.)
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Usage {
        #[command(subcommand)]
        check: Option<UsageCheck>,
        #[command(flatten)]
        query: UsageArgs,
    },
    /// Billing periods (calendar months, UTC): `close` freezes the month's
    /// totals per customer and meter and rejects further usage into it,
    /// `reopen` discards the snapshot, `show` gives the frozen total, what is
    /// pending on top of it and the net.
    Period {
        /// close, reopen or show.
        #[arg(value_parser = ["close", "reopen", "show"])]
        action: String,
        #[arg(long)]
        tenant: String,
        /// The month, YYYY-MM (UTC).
        #[arg(long)]
        period: String,
        /// The state directory's period book and ledger (`dedupd dedupe`).
        #[arg(
            long,
            env = "DEDUPD_STATE_DIR",
            required_unless_present = "periods_topic",
            conflicts_with = "periods_topic"
        )]
        state_dir: Option<PathBuf>,
        /// The deployment's periods topic (what `dedupd run --periods-topic` follows).
        #[arg(long, env = "DEDUPD_PERIODS_TOPIC", requires_all = ["brokers", "rollups_topic"])]
        periods_topic: Option<String>,
        /// The rollups topic the snapshot is summed from.
        #[arg(long, env = "DEDUPD_ROLLUPS_TOPIC", requires = "periods_topic")]
        rollups_topic: Option<String>,
        #[arg(long, env = "DEDUPD_BROKERS", requires = "periods_topic")]
        brokers: Option<String>,
        /// table or json.
        #[arg(long, default_value = "table")]
        format: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Where and when an event was seen.
    Inspect {
        #[arg(long, env = "DEDUPD_STATE_DIR")]
        state_dir: PathBuf,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        event_id: String,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Sample traffic with retries, conflicts and bad records through the real
    /// worker on an in-process Kafka (librdkafka's mock cluster); prints the buckets.
    Demo {
        /// Distinct events to generate.
        #[arg(long, default_value_t = 20_000)]
        events: u64,
        /// Where to serve metrics during the demo.
        #[arg(long, default_value = "127.0.0.1:0")]
        metrics_addr: std::net::SocketAddr,
        /// Keep the demo's files here (default: a new temporary directory).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Run the offline engine on files instead of the in-process Kafka.
        #[arg(long)]
        offline: bool,
    },
}

/// The security and tuning properties of the operator commands' Kafka
/// clients (`usage`, `usage verify`, `period`): the same forms as `run`'s.
#[derive(clap::Args, Clone, Debug, Default)]
struct ClientArgs {
    /// Extra librdkafka property `key=value` (TLS, SASL); repeatable; merged
    /// over DEDUPD_KAFKA_PROPERTIES (one `key=value` per line).
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    kafka_properties: Vec<String>,
    /// A secret property from a file or a variable: `KEY=file:PATH` or
    /// `KEY=env:VAR`; repeatable.
    #[arg(long = "kafka-secret", value_name = "KEY=file:PATH|env:VAR")]
    kafka_secrets: Vec<String>,
}

/// librdkafka properties, `(key, value)` in order.
type Properties = Vec<(String, String)>;

/// The librdkafka properties of one command, lowest precedence first: the
/// config file's list, DEDUPD_KAFKA_PROPERTIES, the flags, then the
/// secrets (the file's, DEDUPD_KAFKA_SECRETS, one per line, then the
/// flags'); returns them with the names of the secret keys (masked in logs).
fn kafka_properties(
    from_file: &[String],
    flags: &[String],
    (file_secrets, flag_secrets): (&[String], &[String]),
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(Properties, Vec<String>)> {
    let from_env = env("DEDUPD_KAFKA_PROPERTIES").map(|t| dedupd::config::property_lines(&t)).unwrap_or_default();
    let env_secrets = env("DEDUPD_KAFKA_SECRETS").map(|t| dedupd::config::property_lines(&t)).unwrap_or_default();
    let secrets = file_secrets.iter().chain(&env_secrets).chain(flag_secrets);
    let mut properties = dedupd::config::merge_kafka_properties(&[
        PropertySource { name: "config file `kafka_properties`", entries: from_file },
        PropertySource { name: "DEDUPD_KAFKA_PROPERTIES", entries: &from_env },
        PropertySource { name: "--kafka-property", entries: flags },
    ])
    .map_err(|why| anyhow::anyhow!("invalid `kafka_properties`: {why}"))?;
    let mut secret_keys = Vec::new();
    for spec in secrets {
        let (k, v) = dedupd::config::resolve_kafka_secret(spec, env).map_err(|why| {
            anyhow::anyhow!("invalid `kafka_secrets` (flag --kafka-secret, env DEDUPD_KAFKA_SECRETS): {why}")
        })?;
        match properties.iter_mut().find(|(pk, _)| *pk == k) {
            Some(slot) => slot.1 = v,
            None => properties.push((k.clone(), v)),
        }
        secret_keys.push(k);
    }
    Ok((properties, secret_keys))
}

/// `dedupd usage`'s query.
#[derive(clap::Args, Clone, Debug)]
struct UsageArgs {
    /// Answer from this state directory (its partitions' share).
    #[arg(
        long,
        env = "DEDUPD_STATE_DIR",
        required_unless_present_any = ["rollups_topic", "output_topic"],
        conflicts_with_all = ["rollups_topic", "output_topic"]
    )]
    state_dir: Option<PathBuf>,
    /// Answer from the rollups topic (every partition's share).
    #[arg(long, env = "DEDUPD_ROLLUPS_TOPIC", requires = "brokers")]
    rollups_topic: Option<String>,
    /// For `--group-by dimension:KEY` (not kept in rollups): answer from
    /// the output topic's accepted events, every partition's.
    #[arg(long, env = "DEDUPD_OUTPUT_TOPIC", requires = "brokers")]
    output_topic: Option<String>,
    #[arg(long, env = "DEDUPD_BROKERS")]
    brokers: Option<String>,
    #[arg(long, required = true)]
    tenant: Option<String>,
    #[arg(long)]
    customer: Option<String>,
    #[arg(long)]
    meter: Option<String>,
    /// Start, inclusive: YYYY-MM, YYYY-MM-DD (UTC) or RFC 3339.
    #[arg(long, required = true)]
    from: Option<String>,
    /// End, exclusive: YYYY-MM, YYYY-MM-DD (UTC) or RFC 3339.
    #[arg(long, required = true)]
    to: Option<String>,
    /// hour, day, period, customer or meter (default: one total row).
    #[arg(long)]
    group_by: Option<String>,
    /// table or json.
    #[arg(long, default_value = "table")]
    format: String,
    /// `--lateness` and `--config` of the workers, for `dimension:KEY`
    /// (the events are refolded as the workers folded them).
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(clap::Subcommand, Debug)]
enum UsageCheck {
    /// Refolds the accepted events of a state directory's usage store and
    /// compares every rollup and adjustment with its ledger; exits 1 on any
    /// drift. Opens (and locks) the directory: run it on a stopped worker or
    /// a copy, with the worker's `--lateness` and `--config`.
    ///
    /// With `--brokers --output-topic --rollups-topic` instead, refolds the
    /// output topic's accepted events and compares them with the rollups
    /// topic (the whole deployment; run it when the workers are idle).
    Verify {
        #[arg(long, env = "DEDUPD_STATE_DIR", required_unless_present = "rollups_topic")]
        state_dir: Option<PathBuf>,
        #[arg(long, env = "DEDUPD_BROKERS", requires = "rollups_topic")]
        brokers: Option<String>,
        #[arg(long, env = "DEDUPD_OUTPUT_TOPIC", requires = "rollups_topic")]
        output_topic: Option<String>,
        #[arg(long, env = "DEDUPD_ROLLUPS_TOPIC", requires_all = ["brokers", "output_topic"], conflicts_with = "state_dir")]
        rollups_topic: Option<String>,
        #[command(flatten)]
        tuning: TuningArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// The flags of `dedupd run` (DESIGN §9). Each also reads `DEDUPD_<FLAG>` and
/// a key of the TOML file.
#[derive(clap::Args, Clone, Debug, Default)]
struct RunArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "DEDUPD_BROKERS")]
    brokers: Option<String>,
    /// Consumer group id (also the transactional id's prefix).
    #[arg(long, env = "DEDUPD_GROUP")]
    group: Option<String>,
    #[arg(long, env = "DEDUPD_INPUT_TOPIC")]
    input_topic: Option<String>,
    /// Accepted events; must have as many partitions as the input topic.
    #[arg(long, env = "DEDUPD_OUTPUT_TOPIC")]
    output_topic: Option<String>,
    #[arg(long, env = "DEDUPD_CONFLICTS_TOPIC")]
    conflicts_topic: Option<String>,
    #[arg(long, env = "DEDUPD_REJECTED_TOPIC")]
    rejected_topic: Option<String>,
    /// Publish the usage ledger's hourly rollups and late-event adjustments
    /// here, in the same transaction as the accepted events. Create it
    /// compacted (`cleanup.policy=compact`): each key holds its latest total.
    #[arg(long, env = "DEDUPD_ROLLUPS_TOPIC")]
    rollups_topic: Option<String>,
    /// At-least-once: how long a batch's rollups may wait to go out with
    /// later batches' while input keeps coming (one record per hour changed
    /// in the interval, not one per batch); `0s`: with each batch. Input offsets commit with the
    /// rollups, so a crash replays at most this much input. Exactly once,
    /// rollups ride each batch's transaction [default: 5s, at most 60s].
    #[arg(long, env = "DEDUPD_ROLLUPS_INTERVAL")]
    rollups_interval: Option<String>,
    /// Follow the billing periods closed with `dedupd period close` here and
    /// reject usage into them (`closed_period`). Create it compacted; every
    /// worker of the deployment reads the whole topic.
    #[arg(long, env = "DEDUPD_PERIODS_TOPIC")]
    periods_topic: Option<String>,
    /// Durable local state; without it state lives in memory and is rebuilt
    /// from the output topic at every start.
    #[arg(long, env = "DEDUPD_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Serve /metrics, /healthz and /readyz here.
    #[arg(long, env = "DEDUPD_METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// exactly-once (Kafka transactions) or at-least-once [default: exactly-once].
    #[arg(long, env = "DEDUPD_DELIVERY")]
    delivery: Option<String>,
    /// Static group membership (`group.instance.id`), e.g. the pod name.
    #[arg(long, env = "DEDUPD_INSTANCE_ID")]
    instance_id: Option<String>,
    /// Extra librdkafka property `key=value` (TLS, SASL, tuning); repeatable.
    /// Merged key by key over the config file's `kafka_properties` and
    /// DEDUPD_KAFKA_PROPERTIES (one `key=value` per line): a flag replaces
    /// only the keys it names.
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    kafka_properties: Vec<String>,
    /// A secret librdkafka property read from a file or an environment
    /// variable: `KEY=file:PATH` or `KEY=env:VAR` (e.g.
    /// `sasl.password=file:/run/secrets/kafka`); repeatable. Masked in logs.
    #[arg(long = "kafka-secret", value_name = "KEY=file:PATH|env:VAR")]
    kafka_secrets: Vec<String>,
    /// Most records per batch [default: 2000].
    #[arg(long, env = "DEDUPD_BATCH_MAX_RECORDS")]
    batch_max_records: Option<u64>,
    /// Longest wait to fill a batch [default: 20ms].
    #[arg(long, env = "DEDUPD_BATCH_MAX_WAIT")]
    batch_max_wait: Option<String>,
    /// Time allowed for one broker operation (transaction commit, flush,
    /// leaving the group) [default: 30s].
    #[arg(long, env = "DEDUPD_OPERATION_TIMEOUT")]
    operation_timeout: Option<String>,
    /// How long a rebalance or shutdown waits for a partition's in-flight
    /// batch before the process aborts rather than risk two publishers
    /// [default: 60s]. Grace periods must exceed revoke + 2 × operation timeout.
    #[arg(long, env = "DEDUPD_REVOKE_TIMEOUT")]
    revoke_timeout: Option<String>,
    /// A partition with input and no progress for this long fails /healthz [default: 5m].
    #[arg(long, env = "DEDUPD_STALL_TIMEOUT")]
    stall_timeout: Option<String>,
    /// When retention deleted output that local state never applied: `stop`
    /// (name the gap and exit) or `continue` (count it) [default: stop].
    #[arg(long, env = "DEDUPD_ON_OUTPUT_GAP")]
    on_output_gap: Option<String>,
    /// Which input partition each identity belongs on: `dedupd` (what
    /// `dedupd route` writes), `murmur2` (the Java client's default) or
    /// `crc32` (librdkafka's default), both over the key `tenant_id \0
    /// event_id` [default: dedupd].
    #[arg(long, env = "DEDUPD_PARTITIONER")]
    partitioner: Option<String>,
    /// A record on another partition than its identity's: `count` it and
    /// classify it where it is, or `reject` it (`misrouted`) [default: count].
    #[arg(long, env = "DEDUPD_ON_MISROUTED")]
    on_misrouted: Option<String>,
    /// Warm standbys: each partition's output is also followed by this many
    /// other workers of the group, which keep its local state current, so
    /// a worker taking it over repairs seconds of output, not the horizon.
    /// Costs each of them the partition's reads and state [default: 0].
    #[arg(long, env = "DEDUPD_STANDBY_REPLICAS")]
    standby_replicas: Option<u32>,
}

fn need(key: &'static str, flag: Option<&String>, file: Option<&String>) -> anyhow::Result<String> {
    flag.or(file).cloned().ok_or_else(|| {
        anyhow::anyhow!(
            "missing `{key}`: give --{} or DEDUPD_{} or `{key}` in the config file",
            key.replace('_', "-"),
            key.to_uppercase()
        )
    })
}

impl RunArgs {
    /// Merges the flags over the file's run keys; fails naming the key.
    /// `env` reads environment variables (a seam for tests).
    fn resolve(
        &self,
        file: &FileConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> anyhow::Result<(RunSettings, Option<PathBuf>)> {
        let topics = Topics {
            input: need("input_topic", self.input_topic.as_ref(), file.input_topic.as_ref())?,
            output: need("output_topic", self.output_topic.as_ref(), file.output_topic.as_ref())?,
            conflicts: need("conflicts_topic", self.conflicts_topic.as_ref(), file.conflicts_topic.as_ref())?,
            rejected: need("rejected_topic", self.rejected_topic.as_ref(), file.rejected_topic.as_ref())?,
            rollups: self.rollups_topic.clone().or_else(|| file.rollups_topic.clone()),
            periods: self.periods_topic.clone().or_else(|| file.periods_topic.clone()),
        };
        let mut s = RunSettings::new(
            need("brokers", self.brokers.as_ref(), file.brokers.as_ref())?,
            need("group", self.group.as_ref(), file.group.as_ref())?,
            topics,
        );
        if let Some(d) = self.delivery.as_ref().or(file.delivery.as_ref()) {
            s.delivery = DeliveryMode::parse(d).ok_or_else(|| {
                anyhow::anyhow!("invalid `delivery` (flag --delivery, env DEDUPD_DELIVERY): {d:?} is neither exactly-once nor at-least-once")
            })?;
        }
        s.instance_id = self.instance_id.clone().or_else(|| file.instance_id.clone());
        if s.delivery == DeliveryMode::ExactlyOnce && s.instance_id.is_none() {
            // Safe, but slow to restart: without a stable transactional id a
            // restarted instance cannot fence its previous life's open
            // transaction, so repair waits until the broker aborts it.
            tracing::warn!(
                "--delivery exactly-once without --instance-id: after a crash, repair waits up to the \
                 transaction timeout for the previous life's open transaction to be aborted; set \
                 --instance-id (e.g. the pod name) so a restart fences it at once"
            );
        }
        if let Some(a) = self.metrics_addr.as_ref().or(file.metrics_addr.as_ref()) {
            s.metrics_addr = Some(a.parse().map_err(|e| {
                anyhow::anyhow!("invalid `metrics_addr` (flag --metrics-addr, env DEDUPD_METRICS_ADDR): {a:?}: {e}")
            })?);
        }
        (s.kafka_properties, s.kafka_secret_keys) = kafka_properties(
            file.kafka_properties.as_deref().unwrap_or_default(),
            &self.kafka_properties,
            (file.kafka_secrets.as_deref().unwrap_or_default(), &self.kafka_secrets),
            env,
        )?;
        dedupd::config::refuse_properties_dedupd_owns(&s.kafka_properties)
            .map_err(|why| anyhow::anyhow!("invalid `kafka_properties`: {why}"))?;
        if let Some(n) = self.batch_max_records.or(file.batch_max_records) {
            if n == 0 {
                anyhow::bail!("invalid `batch_max_records` (flag --batch-max-records): must be at least 1");
            }
            s.batch.max_records = usize::try_from(n)?;
        }
        // A duration from its flag (or variable), else the file's key; the
        // error names both.
        let duration = |key: &str, flag: &Option<String>, file: &Option<String>| -> anyhow::Result<Option<Duration>> {
            flag.as_ref()
                .or(file.as_ref())
                .map(|w| {
                    dedupd::config::parse_duration(w)
                        .map_err(|why| anyhow::anyhow!("invalid `{key}` (flag --{}): {why}", key.replace('_', "-")))
                })
                .transpose()
        };
        if let Some(d) = duration("batch_max_wait", &self.batch_max_wait, &file.batch_max_wait)? {
            s.batch.max_wait = d;
        }
        // Zero is no timeout a broker call can meet: every call would time
        // out, and a zero revoke timeout aborts the process at any rebalance
        // with a batch in flight.
        let positive = |key: &str, d: Duration| -> anyhow::Result<Duration> {
            // Milliseconds: librdkafka takes them, and 0 ms is no timeout.
            if d.as_millis() == 0 {
                anyhow::bail!("invalid `{key}` (flag --{}): must be at least 1ms", key.replace('_', "-"));
            }
            Ok(d)
        };
        if let Some(d) = duration("operation_timeout", &self.operation_timeout, &file.operation_timeout)? {
            s.operation_timeout = positive("operation_timeout", d)?;
        }
        if let Some(d) = duration("revoke_timeout", &self.revoke_timeout, &file.revoke_timeout)? {
            s.revoke_timeout = positive("revoke_timeout", d)?;
        }
        if let Some(d) = duration("stall_timeout", &self.stall_timeout, &file.stall_timeout)? {
            s.stall_timeout = d;
        }
        if let Some(d) = duration("rollups_interval", &self.rollups_interval, &file.rollups_interval)? {
            if d > dedupd::kafka::settings::MAX_ROLLUPS_INTERVAL {
                anyhow::bail!(
                    "invalid `rollups_interval` (flag --rollups-interval): {} is longer than the {}s allowed: \
                     input offsets commit with the rollups, so a crash would replay that much input",
                    humantime::format_duration(d),
                    dedupd::kafka::settings::MAX_ROLLUPS_INTERVAL.as_secs()
                );
            }
            s.rollups_interval = d;
        }
        if let Some(g) = self.on_output_gap.as_ref().or(file.on_output_gap.as_ref()) {
            s.on_output_gap = OnOutputGap::parse(g).ok_or_else(|| {
                anyhow::anyhow!("invalid `on_output_gap` (flag --on-output-gap, env DEDUPD_ON_OUTPUT_GAP): {g:?} is neither stop nor continue")
            })?;
        }
        if let Some(p) = self.partitioner.as_ref().or(file.partitioner.as_ref()) {
            s.partitioner = Partitioner::parse(p).ok_or_else(|| {
                anyhow::anyhow!("invalid `partitioner` (flag --partitioner, env DEDUPD_PARTITIONER): {p:?} is none of dedupd, murmur2, crc32")
            })?;
        }
        if let Some(m) = self.on_misrouted.as_ref().or(file.on_misrouted.as_ref()) {
            s.on_misrouted = OnMisrouted::parse(m).ok_or_else(|| {
                anyhow::anyhow!("invalid `on_misrouted` (flag --on-misrouted, env DEDUPD_ON_MISROUTED): {m:?} is neither count nor reject")
            })?;
        }
        if let Some(n) = self.standby_replicas.or(file.standby_replicas) {
            s.standby_replicas = n;
        }
        let state_dir = self.state_dir.clone().or_else(|| file.state_dir.clone());
        Ok((s, state_dir))
    }
}

impl RunArgs {
    /// The settings of `dedupd route`: the raw topic is consumed, the input
    /// topic produced to, the rejected topic takes unroutable records; every
    /// other key means what it means for `run`.
    fn resolve_route(
        &self,
        raw_topic: Option<&String>,
        file: &FileConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> anyhow::Result<dedupd::kafka::router::RouteSettings> {
        let raw = need("raw_topic", raw_topic, file.raw_topic.as_ref())?;
        let input = need("input_topic", self.input_topic.as_ref(), file.input_topic.as_ref())?;
        let rejected = need("rejected_topic", self.rejected_topic.as_ref(), file.rejected_topic.as_ref())?;
        let mut args = self.clone();
        args.input_topic = Some(raw);
        args.output_topic = Some(input);
        args.conflicts_topic = Some(rejected.clone());
        args.rejected_topic = Some(rejected);
        // The router places records; the ledger and periods are the workers'.
        args.rollups_topic = None;
        args.periods_topic = None;
        let (run, _) = args.resolve(file, env)?;
        Ok(dedupd::kafka::router::RouteSettings { run })
    }
}

/// Settings that contradict each other, refused before anything starts.
/// Warm standbys keep other owners' partitions in local state; a key store
/// that drops every revoked partition would throw that away at each
/// handover back. A rollups topic is filled by the ledger: with the ledger
/// off the worker would publish no rollups, and billing reading that topic
/// (and `usage`, `period close`) would see no usage at all. Records the
/// limits let in must fit what the producer may send, and the stall
/// timeout must outlast one broker call (`check_record_bounds`). Made
/// before any I/O: `run` opens its state directory only after them, and
/// `check-config` runs the same.
fn check_contradictions(run: &RunSettings, engine: &EngineSettings) -> anyhow::Result<()> {
    let limits = engine.validator().limits().clone();
    run.check_record_bounds(limits.max_output_bytes, limits.max_id_bytes).map_err(|why| anyhow::anyhow!("{why}"))?;
    if let Some(topic) = run.topics.rollups.as_deref().filter(|_| !engine.ledger) {
        anyhow::bail!(
            "--rollups-topic {topic} needs --ledger true: the ledger folds the rollups the topic carries, and with it \
             off the worker would publish none (billing would read no usage)"
        );
    }
    if run.standby_replicas > 0 && !engine.keep_revoked_partitions {
        anyhow::bail!(
            "--standby-replicas {} needs --keep-revoked-partitions true: a standby keeps the state of partitions \
             it does not own, which a key store that drops revoked partitions would discard",
            run.standby_replicas
        );
    }
    Ok(())
}

/// Logs go to stderr. The filter is `DEDUPD_LOG`, else `RUST_LOG` (what
/// every deployment sets), else `default_level`; colour only on a terminal.
fn init_tracing(default_level: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("DEDUPD_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    match format {
        LogFormat::Json => builder.json().with_current_span(false).init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

/// A progress bar on standard error for `dedupd dedupe`, only when standard
/// error is a terminal: a file or a pipe gets the summary line alone. By
/// bytes when the input's size is known, a spinner otherwise.
fn progress_bar(total_bytes: Option<u64>) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let target = indicatif::ProgressDrawTarget::stderr();
    let bar = match total_bytes {
        Some(total) => indicatif::ProgressBar::with_draw_target(Some(total), target).with_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta}) {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        ),
        None => indicatif::ProgressBar::with_draw_target(None, target).with_style(
            indicatif::ProgressStyle::with_template("{spinner} {bytes} read ({bytes_per_sec}) {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        ),
    };
    Some(bar)
}

/// The brokers of the usage commands (plaintext: they take no security
/// properties yet).
/// `--format` of the report commands: `table` or `json`, refused otherwise
/// before any work is done.
fn check_format(format: &str) -> anyhow::Result<()> {
    if format != "table" && format != "json" {
        anyhow::bail!("--format {format:?}: expected table or json");
    }
    Ok(())
}

/// Prints a report as `--format` asks: pretty JSON, or the table.
/// Each side is built only when asked for, and may fail (a total that does
/// not fit an exact decimal): the error, not a wrong number.
fn print_report<E>(
    format: &str,
    json: impl FnOnce() -> Result<serde_json::Value, E>,
    table: impl FnOnce() -> Result<String, E>,
) -> anyhow::Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    if format == "json" {
        println!("{}", serde_json::to_string_pretty(&json()?)?);
    } else {
        print!("{}", table()?);
    }
    Ok(())
}

fn usage_brokers(servers: String, client: &ClientArgs) -> anyhow::Result<dedupd::kafka::usage::Brokers> {
    let env = |k: &str| std::env::var(k).ok();
    let (properties, _) = kafka_properties(&[], &client.kafka_properties, (&[], &client.kafka_secrets), &env)?;
    Ok(dedupd::kafka::usage::Brokers { servers, properties, timeout: std::time::Duration::from_secs(30) })
}

/// The flags that make `usage` and `period` read Kafka topics instead of a
/// state directory.
const TOPIC_MODE_FLAGS: [&str; 4] = ["brokers", "rollups_topic", "output_topic", "periods_topic"];

impl Cli {
    /// The command line's parser, with one exception to "a flag also reads
    /// `DEDUPD_<FLAG>`": `usage` and `period` answer either from a state
    /// directory or from topics, and a worker's environment sets both
    /// kinds (`DEDUPD_STATE_DIR`, `DEDUPD_BROKERS`, `DEDUPD_ROLLUPS_TOPIC`).
    /// When the command line names one kind only, the other kind's
    /// environment is not read: the flags typed win, and the run is not
    /// refused over a variable the user never set on it. Both kinds typed
    /// are still refused.
    fn command_for(args: &[std::ffi::OsString]) -> clap::Command {
        use clap::CommandFactory;
        let typed = |id: &str| {
            let flag = format!("--{}", id.replace('_', "-"));
            args.iter().filter_map(|a| a.to_str()).any(|a| a == flag || a.starts_with(&format!("{flag}=")))
        };
        let state_typed = typed("state_dir");
        let topics_typed = TOPIC_MODE_FLAGS.iter().any(|id| typed(id));
        let unread: &[&str] = match (state_typed, topics_typed) {
            (true, false) => &TOPIC_MODE_FLAGS,
            (false, true) => &["state_dir"],
            _ => &[],
        };
        fn without_env(mut cmd: clap::Command, ids: &[&str]) -> clap::Command {
            for id in ids {
                if cmd.get_arguments().any(|a| a.get_id() == *id) {
                    cmd = cmd.mut_arg(*id, |a| a.env(None::<&'static str>));
                }
            }
            cmd
        }
        Cli::command()
            .mut_subcommand("usage", |usage| {
                without_env(usage, unread).mut_subcommand("verify", |verify| without_env(verify, unread))
            })
            .mut_subcommand("period", |period| without_env(period, unread))
    }
}

fn engine_settings(tuning: &TuningArgs) -> anyhow::Result<(EngineSettings, FileConfig)> {
    let file = match &tuning.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    Ok((EngineSettings::resolve(tuning, &file)?, file))
}

fn main() -> ExitCode {
    let small_pages = dedupd::process::disable_transparent_huge_pages();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::command_for(&args).try_get_matches_from(&args).and_then(|m| Cli::from_arg_matches(&m)) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // The demo prints a table for a person; per-batch logs would bury it.
    init_tracing(if matches!(cli.command, Command::Demo { .. }) { "warn" } else { "info" }, cli.log_format);
    if !small_pages {
        tracing::debug!("transparent huge pages stay as the system sets them (prctl refused or not Linux)");
    }
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dedupd: error: {}", error_chain(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes, joined by ": ". Many of our errors already
/// name their cause in their own message (`cannot write output F: <io
/// error>`); a cause the line so far already ends with, after ": ", is not
/// said twice.
fn error_chain(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.strip_suffix(text.as_str()).is_some_and(|head| head.ends_with(": ")) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Dedupe { input, output, state_dir, rejected, conflicts, batch_records, tuning } => {
            let (settings, file) = engine_settings(&tuning)?;
            // `state_dir` in a file is a worker's key. Ignored, a worker's
            // file reused offline ran on in-memory state, counted every
            // event again and emptied the output; taken, it would point an
            // offline run at a worker's own state. Refused: the flag (or its
            // variable) names an offline run's directory.
            if let (None, Some(dir)) = (&state_dir, &file.state_dir) {
                anyhow::bail!(
                    "the config file sets state_dir = {:?}, a worker's state directory: dedupe takes its own only \
                     from --state-dir (or DEDUPD_STATE_DIR); pass one to keep state across runs, or use a config \
                     file without the key",
                    dir.display().to_string()
                );
            }
            let total_bytes = match &input {
                // A pipe given by path has no length to draw progress against.
                Stdio::File(p) => std::fs::metadata(p).ok().filter(|m| m.is_file()).map(|m| m.len()),
                Stdio::Std => None,
            };
            let opts = DedupeOptions { input, output, state_dir, rejected, conflicts, batch_records };
            let bar = progress_bar(total_bytes);
            let summary = run_dedupe_with_progress(&opts, &settings, &SystemClock, &mut |p| {
                if let Some(bar) = &bar {
                    bar.set_position(p.bytes);
                    bar.set_message(format!(
                        "{} records: {} accepted, {} duplicates, {} conflicts, {} rejected",
                        p.records, p.summary.accepted, p.summary.duplicates, p.summary.conflicts, p.summary.rejected
                    ));
                }
            });
            if let Some(bar) = &bar {
                bar.finish();
            }
            let summary = summary?;
            // The summary is the last line on stderr, machine-readable.
            eprintln!("{}", serde_json::to_string(&summary)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { state_dir } => {
            let (report, clean) = dedupd::state::verify_state_dir(&state_dir)?;
            print!("{report}");
            Ok(if clean { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Usage {
            check: Some(UsageCheck::Verify { state_dir, brokers, output_topic, rollups_topic, tuning, client }),
            ..
        } => {
            let (settings, _) = engine_settings(&tuning)?;
            let (events, hours, adjustments, drift) = match (state_dir, brokers, output_topic, rollups_topic) {
                (_, Some(brokers), Some(output), Some(rollups)) => {
                    let brokers = usage_brokers(brokers, &client)?;
                    let validator = settings.validator();
                    let c = dedupd::kafka::usage::verify_topics(
                        &brokers,
                        &output,
                        &rollups,
                        &validator,
                        &settings.lateness,
                    )?;
                    (c.events, c.hours, c.adjustments, c.drift)
                }
                (Some(dir), ..) => {
                    let c = dedupd::state::verify_ledger(&dir, settings)?;
                    (c.events, c.hours, c.adjustments, c.drift)
                }
                _ => anyhow::bail!("give --state-dir, or --brokers, --output-topic and --rollups-topic"),
            };
            for line in &drift {
                println!("DRIFT {line}");
            }
            println!(
                "usage verify: {events} accepted events refolded, {hours} hours and {adjustments} adjustments compared, {} drifting",
                drift.len()
            );
            Ok(if drift.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Usage { check: None, query: q } => {
            let UsageArgs {
                state_dir,
                rollups_topic,
                output_topic,
                brokers,
                tenant,
                customer,
                meter,
                from,
                to,
                group_by,
                format,
                tuning,
                client,
            } = q;
            let query = dedupd::ledger::UsageQuery::parse(
                tenant,
                customer,
                meter,
                from.as_deref(),
                to.as_deref(),
                group_by.as_deref(),
            )
            .map_err(|why| anyhow::anyhow!(why))?;
            check_format(&format)?;
            let answer = if query.needs_events() {
                // Dimension values are not in the rollups: refold the events.
                let (settings, _) = engine_settings(&tuning)?;
                match (state_dir, output_topic, brokers) {
                    (_, Some(topic), Some(brokers)) => dedupd::kafka::usage::usage_from_output(
                        &usage_brokers(brokers, &client)?,
                        &topic,
                        &settings.validator(),
                        &settings.lateness,
                        &query,
                    )?,
                    (Some(dir), ..) => dedupd::state::usage_from_events(&dir, &query, settings)?,
                    _ => anyhow::bail!(
                        "--group-by dimension:KEY is answered from the accepted events: give --state-dir, or \
                         --brokers and --output-topic"
                    ),
                }
            } else {
                match (state_dir, rollups_topic, brokers) {
                    (_, Some(topic), Some(brokers)) => {
                        dedupd::kafka::usage::usage_from_topic(&usage_brokers(brokers, &client)?, &topic, &query)?
                    }
                    (Some(dir), ..) => dedupd::state::usage(&dir, &query)?,
                    _ => anyhow::bail!("give --state-dir, or --brokers and --rollups-topic"),
                }
            };
            print_report(&format, || answer.to_json(), || answer.to_table())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Period {
            action,
            tenant,
            period,
            state_dir,
            periods_topic,
            rollups_topic,
            brokers,
            format,
            client,
        } => {
            use dedupd::ledger::{Period, PeriodAction};
            let period = Period::parse(&period).map_err(|why| anyhow::anyhow!("--period: {why}"))?;
            check_format(&format)?;
            if tenant.trim().is_empty() {
                anyhow::bail!("--tenant is empty: a period is closed per tenant");
            }
            let action = match action.as_str() {
                "close" => PeriodAction::Close,
                "reopen" => PeriodAction::Reopen,
                _ => PeriodAction::Show,
            };
            let now_ms = dedupd::classify::Clock::now_ms(&SystemClock);
            let report = match (state_dir, periods_topic, rollups_topic, brokers) {
                (_, Some(periods), Some(rollups), Some(brokers)) => dedupd::kafka::periods::act_on_topics(
                    &usage_brokers(brokers, &client)?,
                    &periods,
                    &rollups,
                    action,
                    &tenant,
                    period,
                    now_ms,
                )?,
                (Some(dir), ..) => dedupd::state::period(&dir, action, &tenant, period, now_ms)?,
                _ => anyhow::bail!("give --state-dir, or --brokers, --periods-topic and --rollups-topic"),
            };
            if action == PeriodAction::Close && report.lines.is_empty() {
                // Closed all the same (a month with no usage is invoiced as
                // nothing), but a mistyped tenant id looks just like that.
                tracing::warn!(
                    tenant = %tenant,
                    %period,
                    "closed a month in which this tenant has no usage at all: check the tenant id (ids are exact, \
                     case included)"
                );
            }
            print_report(&format, || report.to_json(), || report.to_table())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { state_dir, tenant, event_id, tuning } => {
            let (settings, _) = engine_settings(&tuning)?;
            let answer = dedupd::state::inspect(&state_dir, &tenant, &event_id, settings)?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { run, tuning } => {
            let (settings, file) = engine_settings(&tuning)?;
            let (run_settings, state_dir) = run.resolve(&file, &|k| std::env::var(k).ok())?;
            check_contradictions(&run_settings, &settings)?;
            println!("dedupd {}: configuration ok", env!("CARGO_PKG_VERSION"));
            println!("run: {}", run_settings.describe());
            println!("state_dir: {}", state_dir.as_deref().map_or("- (in memory)".into(), |p| p.display().to_string()));
            println!("engine: {}", settings.describe());
            Ok(ExitCode::SUCCESS)
        }
        Command::Run { run, tuning } => {
            let (settings, file) = engine_settings(&tuning)?;
            let (run_settings, state_dir) = run.resolve(&file, &|k| std::env::var(k).ok())?;
            check_contradictions(&run_settings, &settings)?;
            tracing::info!(
                version = env!("CARGO_PKG_VERSION"),
                run = %run_settings.describe(),
                state_dir = ?state_dir,
                engine = %settings.describe(),
                "dedupd starting"
            );
            let metrics = Arc::new(Metrics::new());
            let state = LocalState::open_observed(state_dir.as_deref(), settings.clone(), true, metrics.clone())?;
            let parts = WorkerParts {
                validator: settings.validator(),
                engine: Box::new(StateEngine::new(state, settings.validator())),
                clock: Arc::new(SystemClock),
                metrics,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(dedupd::kafka::run(run_settings, parts, dedupd::kafka::shutdown_signal()))?;
            tracing::info!(?report, "dedupd stopped");
            Ok(ExitCode::SUCCESS)
        }
        Command::Route { raw_topic, run, tuning } => {
            let (settings, file) = engine_settings(&tuning)?;
            let route = run.resolve_route(raw_topic.as_ref(), &file, &|k| std::env::var(k).ok())?;
            tracing::info!(
                version = env!("CARGO_PKG_VERSION"),
                route = %route.run.describe(),
                "dedupd route starting (input= is the raw topic, output= the dedupe input topic)"
            );
            let metrics = Arc::new(Metrics::new());
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(dedupd::kafka::router::route(
                route,
                settings.validator(),
                metrics,
                dedupd::kafka::shutdown_signal(),
            ))?;
            tracing::info!(?report, "dedupd route stopped");
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo { events, work_dir, offline: false, metrics_addr } => {
            let _ = work_dir;
            let settings = EngineSettings::default();
            let metrics = Arc::new(Metrics::new());
            let parts = WorkerParts {
                validator: settings.validator(),
                engine: Box::new(StateEngine::new(LocalState::in_memory(settings.clone(), true), settings.validator())),
                clock: Arc::new(SystemClock),
                metrics,
            };
            let demo = DemoSettings {
                events: usize::try_from(events)?,
                metrics_addr: Some(metrics_addr),
                ..DemoSettings::default()
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(dedupd::kafka::demo::demo(demo, parts))?;
            println!("dedupd demo: the real worker on an in-process Kafka (librdkafka mock cluster)");
            print!("{}", report.table());
            if let Some(addr) = report.metrics_addr {
                println!("metrics were served at http://{addr}/metrics");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo { events, work_dir, offline: true, .. } => {
            let dir = match work_dir {
                Some(d) => d,
                None => std::env::temp_dir().join(format!("dedupd-demo-{}", std::process::id())),
            };
            std::fs::create_dir_all(&dir)?;
            let (counts, summary, dir) =
                dedupd::offline::run_offline_demo(events, &dir, &EngineSettings::default(), &SystemClock)?;
            println!("dedupd demo (offline engine): files in {}", dir.display());
            print!("{}", dedupd::offline::bucket_table(&counts, &summary));
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open input in.ndjson: {source}")]
    struct NamesItsCause {
        source: std::io::Error,
    }

    #[test]
    fn an_error_chain_says_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let named = anyhow::Error::new(NamesItsCause { source: io() });
        assert_eq!(error_chain(&named), "cannot open input in.ndjson: no such file");
        let plain = anyhow::Error::new(io()).context("reading the config");
        assert_eq!(error_chain(&plain), "reading the config: no such file");
        // A cause that merely ends like the line is still said.
        let alike = anyhow::anyhow!("file").context("cannot open the file");
        assert_eq!(error_chain(&alike), "cannot open the file: file");
    }
}
