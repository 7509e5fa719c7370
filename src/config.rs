//! Configuration: flags, `DEDUPD_*` environment variables and the TOML file.
//!
//! Precedence, highest first: command-line flag, environment variable, config
//! file key, built-in default. Every value is parsed by one function whatever
//! its source, and every error names the key (`hot_ttl`), its flag
//! (`--hot-ttl`) and its variable (`DEDUPD_HOT_TTL`), so an operator can find
//! it wherever it was set. All of it happens in [`EngineSettings::resolve`]
//! before any file or socket is opened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::event::{ClosedPeriods, Limits, UnknownFields};

/// Invalid configuration. Always names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid `{key}` (flag --{flag}, env DEDUPD_{env}): {why}")]
    Invalid { key: &'static str, flag: String, env: String, why: String },
    #[error("config file {path}: {why}")]
    File { path: PathBuf, why: String },
}

fn invalid(key: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, flag: key.replace('_', "-"), env: key.to_uppercase(), why: why.into() }
}

/// When the WAL (and the offline output file) are fsynced: `always` or
/// `interval:<ms>`. One type for the whole system, defined by the storage
/// layer that honours it.
pub use crate::storage::FsyncPolicy;

/// The tuning flags shared by `run` and `dedupe` (DESIGN §9). Every field is
/// optional here: unset means "take the file's value, or the default".
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TuningArgs {
    /// TOML config file; keys are the flag names with `_` for `-`.
    #[arg(long, env = "DEDUPD_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How long the in-memory hot cache remembers a key after first seen [default: 7d].
    #[arg(long, env = "DEDUPD_HOT_TTL", value_name = "DURATION")]
    pub hot_ttl: Option<String>,
    /// Most keys the hot cache holds per partition [default: 2000000].
    #[arg(long, env = "DEDUPD_HOT_CAPACITY", value_name = "N")]
    pub hot_capacity: Option<String>,
    /// How long the key store remembers a key after first seen [default: 35d].
    #[arg(long, env = "DEDUPD_HORIZON", value_name = "DURATION")]
    pub horizon: Option<String>,
    /// Byte cap of the key store; oldest keys go first [default: none].
    #[arg(long, env = "DEDUPD_KEYSTORE_MAX_BYTES", value_name = "BYTES")]
    pub keystore_max_bytes: Option<String>,
    /// Alert (log an error, set the gauge) when the size cap shrinks the
    /// key store's window below this; with a cap, between the window the
    /// age check needs and a key's lifetime [default: `--max-event-age` +
    /// `--max-future-skew` + 1 ms].
    #[arg(long, env = "DEDUPD_KEYSTORE_WINDOW_FLOOR", value_name = "DURATION")]
    pub keystore_window_floor: Option<String>,
    /// RocksDB block cache size, an upper bound: blocks read before a write
    /// and by scans; lookups read past it [default: 128MiB].
    #[arg(long, env = "DEDUPD_KEYSTORE_BLOCK_CACHE", value_name = "BYTES")]
    pub keystore_block_cache: Option<String>,
    /// Bytes of applied keys the key store holds in memory before writing them into RocksDB as one file; up to twice this is in memory while one such layer is written [default: 64MiB].
    #[arg(long, env = "DEDUPD_KEYSTORE_WRITE_BUFFER", value_name = "BYTES")]
    pub keystore_write_buffer: Option<String>,
    /// RocksDB background flush and compaction threads [default: 2].
    #[arg(long, env = "DEDUPD_KEYSTORE_BACKGROUND_JOBS", value_name = "N")]
    pub keystore_background_jobs: Option<String>,
    /// Threads that read parts of a large key-store lookup beside the
    /// partition that asked (a retry storm of old events is bound by those
    /// reads); 0 keeps each lookup on its partition's thread [default: one
    /// per core beyond the first, at most 3].
    #[arg(long, env = "DEDUPD_KEYSTORE_LOOKUP_THREADS", value_name = "N")]
    pub keystore_lookup_threads: Option<String>,
    /// Keep a revoked partition's keys instead of dropping them [default: true].
    #[arg(long, env = "DEDUPD_KEEP_REVOKED_PARTITIONS", value_name = "BOOL")]
    pub keep_revoked_partitions: Option<String>,
    /// `always` or `interval:<ms>` [default: always].
    #[arg(long, env = "DEDUPD_FSYNC", value_name = "POLICY")]
    pub fsync: Option<String>,
    /// WAL file size at which it rotates [default: 64MiB].
    #[arg(long, env = "DEDUPD_WAL_ROTATE_BYTES", value_name = "BYTES")]
    pub wal_rotate_bytes: Option<String>,
    /// Events buffered in memory before a segment is written [default: 100000].
    #[arg(long, env = "DEDUPD_MEMTABLE_EVENTS", value_name = "N")]
    pub memtable_events: Option<String>,
    /// How long accepted usage is kept in the usage store [default: 400d].
    #[arg(long, env = "DEDUPD_RETENTION", value_name = "DURATION")]
    pub retention: Option<String>,
    /// How far ahead of now an event time may be [default: 1h].
    #[arg(long, env = "DEDUPD_MAX_FUTURE_SKEW", value_name = "DURATION")]
    pub max_future_skew: Option<String>,
    /// How old an event time may be [default: 35d].
    #[arg(long, env = "DEDUPD_MAX_EVENT_AGE", value_name = "DURATION")]
    pub max_event_age: Option<String>,
    /// Largest record accepted [default: 64KiB].
    #[arg(long, env = "DEDUPD_MAX_RECORD_BYTES", value_name = "BYTES")]
    pub max_record_bytes: Option<String>,
    /// Largest canonical output record an accepted event may have; larger
    /// ones are rejected as record_too_large [default: 512KiB].
    #[arg(long, env = "DEDUPD_MAX_OUTPUT_BYTES", value_name = "BYTES")]
    pub max_output_bytes: Option<String>,
    /// Longest identifier field [default: 256].
    #[arg(long, env = "DEDUPD_MAX_ID_BYTES", value_name = "BYTES")]
    pub max_id_bytes: Option<String>,
    /// Longest free-text field [default: 1024].
    #[arg(long, env = "DEDUPD_MAX_FIELD_BYTES", value_name = "BYTES")]
    pub max_field_bytes: Option<String>,
    /// Most dimensions per event [default: 16].
    #[arg(long, env = "DEDUPD_MAX_DIMENSIONS", value_name = "N")]
    pub max_dimensions: Option<String>,
    /// Salt of derived event ids. Must be the same on every instance and
    /// never change, or retries of id-less events stop matching [default: dedupd].
    #[arg(long, env = "DEDUPD_DERIVE_SALT", value_name = "S", hide_env_values = true)]
    pub derive_salt: Option<String>,
    /// A field schema v1 does not define: `reject` the event as unknown_field,
    /// or `ignore` the field (kept out of the payload hash) [default: reject].
    #[arg(long, env = "DEDUPD_UNKNOWN_FIELDS", value_name = "reject|ignore")]
    pub unknown_fields: Option<String>,
    /// How far behind its counter's watermark an event may be and still
    /// update its hour in the usage ledger; a later event becomes an
    /// adjustment (reason `late`). Per-meter overrides: `[meters.NAME]
    /// lateness = "6h"` in the config file [default: 48h].
    #[arg(long, env = "DEDUPD_LATENESS", value_name = "DURATION")]
    pub lateness: Option<String>,
    /// Keep the usage ledger (hourly rollups per customer and meter) in
    /// local state [default: true].
    #[arg(long, env = "DEDUPD_LEDGER", value_name = "BOOL")]
    pub ledger: Option<String>,
    /// Replaced by `dedupd period close` (issue #12); refused with a message
    /// that says so, so an old deployment does not start with its closed
    /// months silently open.
    #[arg(long = "closed-period", env = "DEDUPD_CLOSED_PERIODS", value_delimiter = ',', hide = true)]
    pub closed_periods: Vec<String>,
}

/// The TOML file. Unknown keys are an error: a misspelt key silently
/// ignored is a setting silently not applied.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// See `--hot-ttl`.
    pub hot_ttl: Option<String>,
    /// See `--hot-capacity`.
    pub hot_capacity: Option<u64>,
    /// See `--horizon`.
    pub horizon: Option<String>,
    /// See `--keystore-max-bytes` (a number, or a string like "10GiB").
    pub keystore_max_bytes: Option<toml::Value>,
    /// See `--keystore-window-floor`.
    pub keystore_window_floor: Option<String>,
    /// See `--keystore-block-cache`.
    pub keystore_block_cache: Option<toml::Value>,
    /// See `--keystore-write-buffer`.
    pub keystore_write_buffer: Option<toml::Value>,
    /// See `--keystore-background-jobs`.
    pub keystore_background_jobs: Option<u64>,
    /// See `--keystore-lookup-threads`.
    pub keystore_lookup_threads: Option<u64>,
    /// See `--keep-revoked-partitions`.
    pub keep_revoked_partitions: Option<bool>,
    /// See `--fsync`.
    pub fsync: Option<String>,
    /// See `--wal-rotate-bytes`.
    pub wal_rotate_bytes: Option<toml::Value>,
    /// See `--memtable-events`.
    pub memtable_events: Option<u64>,
    /// See `--retention`.
    pub retention: Option<String>,
    /// See `--max-future-skew`.
    pub max_future_skew: Option<String>,
    /// See `--max-event-age`.
    pub max_event_age: Option<String>,
    /// See `--max-record-bytes`.
    pub max_record_bytes: Option<toml::Value>,
    /// See `--max-output-bytes`.
    pub max_output_bytes: Option<toml::Value>,
    /// See `--max-id-bytes`.
    pub max_id_bytes: Option<u64>,
    /// See `--max-field-bytes`.
    pub max_field_bytes: Option<u64>,
    /// See `--max-dimensions`.
    pub max_dimensions: Option<u64>,
    /// See `--derive-salt`.
    pub derive_salt: Option<String>,
    /// See `--unknown-fields`.
    pub unknown_fields: Option<String>,
    /// Replaced by `dedupd period close`; refused (see `--closed-period`).
    pub closed_periods: Option<Vec<String>>,
    /// See `--lateness`.
    pub lateness: Option<String>,
    /// See `--ledger`.
    pub ledger: Option<bool>,
    /// Per-meter settings: `[meters.api_calls] lateness = "6h"`.
    pub meters: Option<BTreeMap<String, MeterConfig>>,
    // Keys only `dedupd run` reads; see `dedupd run --help`. They live in
    // this one struct because serde cannot combine `flatten` with
    // `deny_unknown_fields`.
    pub brokers: Option<String>,
    pub group: Option<String>,
    pub input_topic: Option<String>,
    pub output_topic: Option<String>,
    pub conflicts_topic: Option<String>,
    pub rejected_topic: Option<String>,
    pub rollups_topic: Option<String>,
    pub periods_topic: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub metrics_addr: Option<String>,
    pub delivery: Option<String>,
    pub instance_id: Option<String>,
    pub batch_max_records: Option<u64>,
    pub batch_max_wait: Option<String>,
    pub kafka_properties: Option<Vec<String>>,
    /// See `--kafka-secret`.
    pub kafka_secrets: Option<Vec<String>>,
    pub stall_timeout: Option<String>,
    /// See `--rollups-interval`.
    pub rollups_interval: Option<String>,
    pub operation_timeout: Option<String>,
    pub revoke_timeout: Option<String>,
    pub on_output_gap: Option<String>,
    pub partitioner: Option<String>,
    /// `dedupd route` only: the topic of raw records it places.
    pub raw_topic: Option<String>,
    pub on_misrouted: Option<String>,
    /// See `--standby-replicas`.
    pub standby_replicas: Option<u32>,
}

/// Settings of one meter in the config file. Unknown keys are an error,
/// like everywhere in the file.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct MeterConfig {
    /// This meter's lateness window; see `--lateness`.
    pub lateness: Option<String>,
}

impl FileConfig {
    /// Reads and parses the file. The only I/O of configuration, done before
    /// anything else is opened.
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::File { path: path.to_owned(), why: format!("cannot read: {e}") })?;
        FileConfig::parse(&text).map_err(|why| ConfigError::File { path: path.to_owned(), why })
    }

    pub fn parse(text: &str) -> Result<FileConfig, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

/// Every engine setting, resolved and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSettings {
    pub hot_ttl: Duration,
    pub hot_capacity: usize,
    pub horizon: Duration,
    pub keystore_max_bytes: Option<u64>,
    pub keystore_window_floor: Duration,
    pub keystore_block_cache_bytes: u64,
    pub keystore_write_buffer_bytes: u64,
    pub keystore_background_jobs: u32,
    pub keystore_lookup_threads: u32,
    pub keep_revoked_partitions: bool,
    pub fsync: FsyncPolicy,
    pub wal_rotate_bytes: u64,
    pub memtable_events: usize,
    pub retention: Duration,
    pub limits: Limits,
    pub derive_salt: String,
    /// The periods closed for usage right now: a shared set the periods
    /// reader keeps current (empty until it has read them).
    pub closed_periods: ClosedPeriods,
    pub unknown_fields: UnknownFields,
    /// How late an event may be behind its counter's watermark and still
    /// update its hour (`--lateness`, per-meter overrides in the file).
    pub lateness: crate::ledger::Lateness,
    /// Keep the usage ledger (rollups, watermarks, adjustments) as a tier
    /// of local state.
    pub ledger: bool,
}

impl Default for EngineSettings {
    fn default() -> EngineSettings {
        EngineSettings {
            hot_ttl: Duration::from_secs(7 * 86_400),
            hot_capacity: 2_000_000,
            horizon: Duration::from_secs(35 * 86_400),
            keystore_max_bytes: None,
            // The window the default limits need (max event age 35 days,
            // future skew an hour, a millisecond).
            keystore_window_floor: Duration::from_millis(
                u64::try_from(Limits::default().window_needed_ms()).unwrap_or(0),
            ),
            keystore_block_cache_bytes: 128 << 20,
            keystore_write_buffer_bytes: 64 << 20,
            keystore_background_jobs: 2,
            keystore_lookup_threads: u32::try_from(crate::keystore::default_lookup_helpers()).unwrap_or(0),
            keep_revoked_partitions: true,
            fsync: FsyncPolicy::Always,
            wal_rotate_bytes: 64 << 20,
            memtable_events: 100_000,
            retention: Duration::from_secs(400 * 86_400),
            limits: Limits::default(),
            derive_salt: "dedupd".to_owned(),
            closed_periods: ClosedPeriods::default(),
            unknown_fields: UnknownFields::Reject,
            lateness: crate::ledger::Lateness::default(),
            ledger: true,
        }
    }
}

/// One source of librdkafka properties, by name (for error messages) and
/// its `key=value` entries in order.
pub struct PropertySource<'a> {
    pub name: &'a str,
    pub entries: &'a [String],
}

/// Merges librdkafka properties from several sources, lowest precedence
/// first (config file, `DEDUPD_KAFKA_PROPERTIES`, `--kafka-property`), key by
/// key: a later source replaces a key's value, every other key is kept. So a
/// flag that adds `sasl.password` keeps the file's `security.protocol` and
/// buffer caps. Keys keep the order they first appeared in.
pub fn merge_kafka_properties(sources: &[PropertySource<'_>]) -> Result<Vec<(String, String)>, String> {
    let mut merged: Vec<(String, String)> = Vec::new();
    for source in sources {
        for (n, entry) in source.entries.iter().enumerate() {
            let (k, v) = entry.split_once('=').ok_or_else(|| {
                // The entry may hold a secret: name its key part only, and
                // only when it looks like a property name (letters, digits,
                // `_`, `-` and at least one `.`): what follows it
                // (`:hunter2`) may be the value, and a line without a `.`
                // may be a secret itself (a multi-line PEM's next line).
                let name: String = entry
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
                    .take(60)
                    .collect();
                let shown = if name.contains('.') { format!(" ({name:?}…)") } else { String::new() };
                format!("{}: entry {}{shown} is not key=value", source.name, n + 1)
            })?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() {
                return Err(format!("{}: an entry has an empty key", source.name));
            }
            match merged.iter_mut().find(|(mk, _)| mk == k) {
                Some(slot) => slot.1 = v.to_owned(),
                None => merged.push((k.to_owned(), v.to_owned())),
            }
        }
    }
    Ok(merged)
}

/// librdkafka properties the worker and the router set themselves because
/// a guarantee rests on them: each with the only value a pass-through may
/// repeat (`None`: set by a flag, never passed through) and what it
/// protects. Applied last, as pass-throughs are, another value would
/// quietly turn the guarantee off: auto-committed input offsets run ahead
/// of the publish, so a crash loses the events in between; a
/// `read_uncommitted` consumer bills aborted records; `latest` skips a new
/// group's backlog.
const PROPERTIES_DEDUPD_OWNS: [(&str, Option<&str>, &str); 9] = [
    ("enable.auto.commit", Some("false"), "input offsets are committed by dedupd only, after the publish"),
    ("enable.auto.offset.store", Some("false"), "input offsets are committed by dedupd only, after the publish"),
    ("isolation.level", Some("read_committed"), "aborted records are never billed"),
    ("auto.offset.reset", Some("earliest"), "a new group reads its input from the start"),
    ("group.id", None, "set by --group"),
    ("group.instance.id", None, "set by --instance-id"),
    ("transactional.id", None, "derived per worker, so a worker fences only its own zombies"),
    ("enable.idempotence", Some("true"), "retried sends must not duplicate output"),
    (
        "partition.assignment.strategy",
        Some("cooperative-sticky"),
        "a rebalance must move only the partitions that change owner",
    ),
];

/// Refuses, for `run`, `route` and `check-config`, a pass-through property
/// the worker sets itself (see [`PROPERTIES_DEDUPD_OWNS`]) with another
/// value than its own, scoped (`consumer.`, `producer.`) or not; the error
/// names the key and why. Repeating dedupd's value (hardening checklists
/// do) is allowed. The operator commands' readers (`usage`, `period`) take
/// any: they force what they rely on and have no `--group` of their own.
pub fn refuse_properties_dedupd_owns(properties: &[(String, String)]) -> Result<(), String> {
    for (key, value) in properties {
        let bare = key.strip_prefix("consumer.").or_else(|| key.strip_prefix("producer.")).unwrap_or(key);
        let Some((_, own, why)) = PROPERTIES_DEDUPD_OWNS.iter().find(|(owned, _, _)| *owned == bare) else {
            continue;
        };
        if own.is_none_or(|own| !value.eq_ignore_ascii_case(own)) {
            let only = own.map_or_else(String::new, |own| format!(", and only as {own}"));
            return Err(format!("`{key}` cannot be passed through{only}: dedupd sets it ({why})"));
        }
    }
    Ok(())
}

/// `DEDUPD_KAFKA_PROPERTIES`: one `key=value` per line (blank lines and `#`
/// comments skipped). Lines, not commas: values such as `sasl.jaas.config`
/// or a broker list contain commas.
pub fn property_lines(text: &str) -> Vec<String> {
    text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_owned).collect()
}

/// Resolves `--kafka-secret KEY=file:PATH` or `KEY=env:VAR` to the property
/// `(KEY, value)`: the value comes from the file (one trailing newline
/// dropped, as `echo` and Kubernetes secret volumes write it) or the
/// variable. Errors name the key and the source, never a value.
pub fn resolve_kafka_secret(spec: &str, env: impl Fn(&str) -> Option<String>) -> Result<(String, String), String> {
    let (key, source) =
        spec.split_once('=').ok_or_else(|| "a --kafka-secret is KEY=file:PATH or KEY=env:VAR".to_owned())?;
    let key = key.trim();
    if key.is_empty() {
        return Err("a --kafka-secret has an empty key".into());
    }
    let value = if let Some(path) = source.strip_prefix("file:") {
        let mut v = std::fs::read_to_string(path).map_err(|e| format!("secret for {key}: cannot read {path}: {e}"))?;
        if v.ends_with('\n') {
            v.pop();
            if v.ends_with('\r') {
                v.pop();
            }
        }
        v
    } else if let Some(var) = source.strip_prefix("env:") {
        env(var).ok_or_else(|| format!("secret for {key}: environment variable {var} is not set"))?
    } else {
        return Err(format!("secret for {key}: the source must be file:PATH or env:VAR"));
    };
    if value.is_empty() {
        return Err(format!("secret for {key}: {source} is empty"));
    }
    Ok((key.to_owned(), value))
}

/// Whether a librdkafka property holds a secret, by its name: passwords,
/// secrets, private keys, JAAS and OAuth configurations. Such values are
/// shown as `***` in logs and in `check-config`.
pub fn is_secret_property(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    let k = k.strip_prefix("consumer.").or_else(|| k.strip_prefix("producer.")).unwrap_or(&k);
    k.contains("password")
        || k.contains("secret")
        || k.contains("passphrase")
        // `ssl.key.pem`, `sasl.oauthbearer.assertion.private.key.pem`.
        || k.ends_with("key.pem")
        || matches!(k, "sasl.jaas.config" | "sasl.oauthbearer.config" | "ssl.key.pem" | "ssl_key" | "ssl.keystore.key")
}

/// Parses `7d`, `90s`, `1h 30m` (humantime).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?} is not a duration like 90s or 7d: {e}"))
}

/// Parses `1048576`, `64KiB`, `10MiB`, `2GiB`, `1GB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a byte size like 1048576 or 64MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} overflows"))
}

fn toml_bytes(v: &toml::Value) -> Result<u64, String> {
    match v {
        toml::Value::Integer(i) if *i >= 0 => Ok(*i as u64),
        toml::Value::String(s) => parse_bytes(s),
        other => Err(format!("{other} is not a byte size")),
    }
}

fn pick<T>(
    key: &'static str,
    flag: &Option<String>,
    file: Option<T>,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    match flag {
        Some(s) => parse(s).map(Some).map_err(|why| invalid(key, why)),
        None => Ok(file),
    }
}

fn parse_u64(s: &str) -> Result<u64, String> {
    s.trim().parse::<u64>().map_err(|_| format!("{s:?} is not a whole number"))
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        other => Err(format!("{other:?} is not true or false")),
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EngineSettings {
    /// Merges flags/env over the file over the defaults, then checks the
    /// result as a whole.
    pub fn resolve(args: &TuningArgs, file: &FileConfig) -> Result<EngineSettings, ConfigError> {
        let d = EngineSettings::default();
        let file_dur = |key: &'static str, v: &Option<String>| -> Result<Option<Duration>, ConfigError> {
            v.as_deref().map(parse_duration).transpose().map_err(|why| invalid(key, why))
        };
        let file_bytes = |key: &'static str, v: &Option<toml::Value>| -> Result<Option<u64>, ConfigError> {
            v.as_ref().map(toml_bytes).transpose().map_err(|why| invalid(key, why))
        };

        let hot_ttl =
            pick("hot_ttl", &args.hot_ttl, file_dur("hot_ttl", &file.hot_ttl)?, parse_duration)?.unwrap_or(d.hot_ttl);
        let hot_capacity =
            pick("hot_capacity", &args.hot_capacity, file.hot_capacity, parse_u64)?.unwrap_or(d.hot_capacity as u64);
        let horizon =
            pick("horizon", &args.horizon, file_dur("horizon", &file.horizon)?, parse_duration)?.unwrap_or(d.horizon);
        let keystore_max_bytes = pick(
            "keystore_max_bytes",
            &args.keystore_max_bytes,
            file_bytes("keystore_max_bytes", &file.keystore_max_bytes)?,
            parse_bytes,
        )?;
        let keystore_window_floor = pick(
            "keystore_window_floor",
            &args.keystore_window_floor,
            file_dur("keystore_window_floor", &file.keystore_window_floor)?,
            parse_duration,
        )?;
        let keystore_block_cache_bytes = pick(
            "keystore_block_cache",
            &args.keystore_block_cache,
            file_bytes("keystore_block_cache", &file.keystore_block_cache)?,
            parse_bytes,
        )?
        .unwrap_or(d.keystore_block_cache_bytes);
        let keystore_write_buffer_bytes = pick(
            "keystore_write_buffer",
            &args.keystore_write_buffer,
            file_bytes("keystore_write_buffer", &file.keystore_write_buffer)?,
            parse_bytes,
        )?
        .unwrap_or(d.keystore_write_buffer_bytes);
        let keystore_background_jobs =
            pick("keystore_background_jobs", &args.keystore_background_jobs, file.keystore_background_jobs, parse_u64)?
                .unwrap_or(u64::from(d.keystore_background_jobs));
        let keystore_lookup_threads =
            pick("keystore_lookup_threads", &args.keystore_lookup_threads, file.keystore_lookup_threads, parse_u64)?
                .unwrap_or(u64::from(d.keystore_lookup_threads));
        let keep_revoked_partitions =
            pick("keep_revoked_partitions", &args.keep_revoked_partitions, file.keep_revoked_partitions, parse_bool)?
                .unwrap_or(d.keep_revoked_partitions);
        let fsync = match (&args.fsync, &file.fsync) {
            (Some(s), _) | (None, Some(s)) => {
                s.parse::<FsyncPolicy>().map_err(|why| invalid("fsync", why.to_string()))?
            }
            (None, None) => d.fsync.clone(),
        };
        let wal_rotate_bytes = pick(
            "wal_rotate_bytes",
            &args.wal_rotate_bytes,
            file_bytes("wal_rotate_bytes", &file.wal_rotate_bytes)?,
            parse_bytes,
        )?
        .unwrap_or(d.wal_rotate_bytes);
        let memtable_events = pick("memtable_events", &args.memtable_events, file.memtable_events, parse_u64)?
            .unwrap_or(d.memtable_events as u64);
        let retention = pick("retention", &args.retention, file_dur("retention", &file.retention)?, parse_duration)?
            .unwrap_or(d.retention);
        let max_future_skew = pick(
            "max_future_skew",
            &args.max_future_skew,
            file_dur("max_future_skew", &file.max_future_skew)?,
            parse_duration,
        )?;
        let max_event_age = pick(
            "max_event_age",
            &args.max_event_age,
            file_dur("max_event_age", &file.max_event_age)?,
            parse_duration,
        )?;
        let max_record_bytes = pick(
            "max_record_bytes",
            &args.max_record_bytes,
            file_bytes("max_record_bytes", &file.max_record_bytes)?,
            parse_bytes,
        )?;
        let max_output_bytes = pick(
            "max_output_bytes",
            &args.max_output_bytes,
            file_bytes("max_output_bytes", &file.max_output_bytes)?,
            parse_bytes,
        )?;
        let max_id_bytes = pick("max_id_bytes", &args.max_id_bytes, file.max_id_bytes, parse_u64)?;
        let max_field_bytes = pick("max_field_bytes", &args.max_field_bytes, file.max_field_bytes, parse_u64)?;
        let max_dimensions = pick("max_dimensions", &args.max_dimensions, file.max_dimensions, parse_u64)?;
        let derive_salt = args.derive_salt.clone().or_else(|| file.derive_salt.clone()).unwrap_or(d.derive_salt);
        if !args.closed_periods.is_empty() || file.closed_periods.is_some() {
            // The flag is singular (`--closed-period`, repeatable), the key
            // and variable plural: named as typed.
            return Err(ConfigError::Invalid {
                key: "closed_periods",
                flag: "closed-period".to_owned(),
                env: "CLOSED_PERIODS".to_owned(),
                why: "the fixed list of closed periods was replaced by `dedupd period close --tenant T --period \
                      YYYY-MM`: periods now live in the periods topic (`--periods-topic`) or the state directory, \
                      shared by every worker; remove the setting and close each period once with the command"
                    .to_owned(),
            });
        }
        let closed_periods = ClosedPeriods::default();

        let unknown_fields = pick(
            "unknown_fields",
            &args.unknown_fields,
            file.unknown_fields
                .as_deref()
                .map(UnknownFields::parse)
                .transpose()
                .map_err(|why| invalid("unknown_fields", why))?,
            UnknownFields::parse,
        )?
        .unwrap_or(d.unknown_fields);

        let lateness_default = pick("lateness", &args.lateness, file_dur("lateness", &file.lateness)?, parse_duration)?;
        let mut lateness = crate::ledger::Lateness {
            default_ms: lateness_default.map_or(d.lateness.default_ms, ms),
            per_meter: BTreeMap::new(),
        };
        for (meter, m) in file.meters.iter().flatten() {
            if let Some(text) = &m.lateness {
                let window = parse_duration(text)
                    .map_err(|why| invalid("meters", format!("[meters.{meter}] lateness {text:?}: {why}")))?;
                lateness.per_meter.insert(meter.clone(), ms(window));
            }
        }
        let ledger = pick("ledger", &args.ledger, file.ledger, parse_bool)?.unwrap_or(d.ledger);

        let dl = Limits::default();
        let limits = Limits {
            max_record_bytes: max_record_bytes.map_or(dl.max_record_bytes, |v| v as usize),
            max_id_bytes: max_id_bytes.map_or(dl.max_id_bytes, |v| v as usize),
            max_field_bytes: max_field_bytes.map_or(dl.max_field_bytes, |v| v as usize),
            max_dimensions: max_dimensions.map_or(dl.max_dimensions, |v| v as usize),
            max_future_skew_ms: max_future_skew.map_or(dl.max_future_skew_ms, ms),
            max_event_age_ms: max_event_age.map_or(dl.max_event_age_ms, ms),
            max_output_bytes: max_output_bytes.map_or(dl.max_output_bytes, |v| v as usize),
        };
        let s = EngineSettings {
            hot_ttl,
            hot_capacity: usize::try_from(hot_capacity).map_err(|_| invalid("hot_capacity", "too large"))?,
            horizon,
            keystore_max_bytes,
            // Unset, the floor is the window the age check needs: any
            // shorter lets a retry of an older event through as new.
            keystore_window_floor: keystore_window_floor
                .unwrap_or_else(|| Duration::from_millis(u64::try_from(limits.window_needed_ms()).unwrap_or(0))),
            keystore_block_cache_bytes,
            keystore_write_buffer_bytes,
            keystore_background_jobs: u32::try_from(keystore_background_jobs)
                .map_err(|_| invalid("keystore_background_jobs", "too large"))?,
            keystore_lookup_threads: u32::try_from(keystore_lookup_threads)
                .map_err(|_| invalid("keystore_lookup_threads", "too large"))?,
            keep_revoked_partitions,
            fsync,
            wal_rotate_bytes,
            memtable_events: usize::try_from(memtable_events).map_err(|_| invalid("memtable_events", "too large"))?,
            retention,
            limits,
            derive_salt,
            closed_periods,
            unknown_fields,
            lateness,
            ledger,
        };
        s.validate()?;
        Ok(s)
    }

    /// The effective settings for the start-up log and `dedupd check-config`;
    /// the derive salt, which keys every derived event id, is masked.
    pub fn describe(&self) -> String {
        let masked = EngineSettings { derive_salt: "***".into(), ..self.clone() };
        format!("{masked:?}")
    }

    /// Checks the settings as a whole.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.hot_ttl.is_zero() {
            return Err(invalid("hot_ttl", "must be positive"));
        }
        if self.hot_capacity == 0 {
            return Err(invalid("hot_capacity", "must be at least 1"));
        }
        if self.hot_capacity > crate::classify::MAX_HOT_CACHE_KEYS {
            return Err(invalid(
                "hot_capacity",
                format!(
                    "must be at most {}: a partition's hot cache numbers its keys in 32 bits",
                    crate::classify::MAX_HOT_CACHE_KEYS
                ),
            ));
        }
        let d = |d: Duration| humantime::format_duration(d).to_string();
        let ms_d = |ms: i64| d(Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        if self.horizon < self.hot_ttl {
            return Err(invalid(
                "horizon",
                format!(
                    "horizon {} is shorter than hot_ttl {}: the key store must remember at least as long as the cache",
                    d(self.horizon),
                    d(self.hot_ttl)
                ),
            ));
        }
        // An event may arrive up to max_event_age after its own time, and its
        // first delivery up to that long before a retry: a horizon shorter
        // than the age window forgets keys whose retries are still accepted,
        // and each such retry is billed again.
        if self.horizon_ms() < self.limits.max_event_age_ms {
            return Err(invalid(
                "horizon",
                format!(
                    "horizon {} is shorter than max_event_age {}: retries of events that old are still \
                     accepted, but their keys would be forgotten, so they would be billed twice",
                    d(self.horizon),
                    ms_d(self.limits.max_event_age_ms)
                ),
            ));
        }
        // The floor guards what a size cap leaves of the window: with no
        // cap the window is a key's lifetime and the alert fires only for a
        // while after the horizon grew (or the clock stepped back), so no
        // floor typed is checked then.
        let floor_ms = self.keystore_window_floor.as_millis();
        if self.keystore_max_bytes.is_some() && floor_ms > self.key_lifetime_ms() as u128 {
            return Err(invalid(
                "keystore_window_floor",
                format!(
                    "keystore_window_floor {} is longer than a key's lifetime {} (horizon plus max_future_skew): with \
                     keystore_max_bytes set the alert would fire whenever the cap binds; set the floor to at most \
                     that",
                    d(self.keystore_window_floor),
                    ms_d(self.key_lifetime_ms())
                ),
            ));
        }
        // Below the window the age check needs, a window the cap shrank
        // would let a retry of an older event through as new, billed twice,
        // with no alert.
        if self.keystore_max_bytes.is_some() && floor_ms < self.limits.window_needed_ms() as u128 {
            return Err(invalid(
                "keystore_window_floor",
                format!(
                    "keystore_window_floor {} is shorter than the window max_event_age {} and max_future_skew {} \
                     need ({}): with keystore_max_bytes set, a window the cap shrank below that would let retries \
                     of events that old be billed again with no alert; leave the floor unset (it is that window) or \
                     raise it",
                    d(self.keystore_window_floor),
                    ms_d(self.limits.max_event_age_ms),
                    ms_d(self.limits.max_future_skew_ms),
                    ms_d(self.limits.window_needed_ms())
                ),
            ));
        }
        if self.keystore_max_bytes == Some(0) {
            return Err(invalid("keystore_max_bytes", "must be positive (leave unset for no cap)"));
        }
        if usize::try_from(self.keystore_lookup_threads).unwrap_or(usize::MAX) > crate::keystore::MAX_LOOKUP_HELPERS {
            return Err(invalid(
                "keystore_lookup_threads",
                format!("must be at most {}", crate::keystore::MAX_LOOKUP_HELPERS),
            ));
        }
        // The key store refuses a smaller layer too, but only when it opens,
        // after the state directory is made, naming its own option.
        if self.keystore_write_buffer_bytes < (1 << 20) {
            return Err(invalid("keystore_write_buffer", "must be at least 1MiB"));
        }
        if self.keystore_background_jobs == 0 {
            return Err(invalid("keystore_background_jobs", "must be at least 1"));
        }
        if self.wal_rotate_bytes < 4096 {
            return Err(invalid("wal_rotate_bytes", "must be at least 4KiB"));
        }
        if self.memtable_events == 0 {
            return Err(invalid("memtable_events", "must be at least 1"));
        }
        if self.retention < self.horizon {
            return Err(invalid(
                "retention",
                format!(
                    "retention {} is shorter than horizon {}: the usage store backs the key store's answers within it",
                    d(self.retention),
                    d(self.horizon)
                ),
            ));
        }
        let l = &self.limits;
        if l.max_record_bytes < 64 {
            return Err(invalid("max_record_bytes", "must be at least 64"));
        }
        if l.max_output_bytes < 1024 || l.max_output_bytes > crate::event::OUTPUT_READ_CEILING_BYTES {
            return Err(invalid(
                "max_output_bytes",
                format!(
                    "{} is outside 1KiB..={} bytes (the most dedupd reads back from its output)",
                    l.max_output_bytes,
                    crate::event::OUTPUT_READ_CEILING_BYTES
                ),
            ));
        }
        if l.max_id_bytes == 0 {
            return Err(invalid("max_id_bytes", "must be positive"));
        }
        if l.max_field_bytes == 0 {
            return Err(invalid("max_field_bytes", "must be positive"));
        }
        if l.max_event_age_ms <= 0 {
            return Err(invalid("max_event_age", "must be positive"));
        }
        if self.derive_salt.is_empty() {
            return Err(invalid("derive_salt", "must not be empty"));
        }
        Ok(())
    }

    pub fn hot_ttl_ms(&self) -> i64 {
        ms(self.hot_ttl)
    }

    pub fn horizon_ms(&self) -> i64 {
        ms(self.horizon)
    }

    /// How long a key is remembered after it is first seen: the horizon,
    /// plus `max_future_skew`, plus a millisecond.
    ///
    /// Keys expire by first-seen time, but the age check measures from the
    /// event's own stamp, which may be up to the skew ahead of its first
    /// arrival. A key kept for the horizon alone would be forgotten while a
    /// retry of an event stamped ahead still passed the age check (it is
    /// accepted until `max_event_age` after its stamp, inclusive, hence the
    /// millisecond), and that retry would be billed twice. Everything that
    /// keeps or reads back keys uses this: the classifier, the key store's
    /// ageing, repair of a partition with no checkpoint, and the usage
    /// store's retention (which backs a conflict's original).
    pub fn key_lifetime_ms(&self) -> i64 {
        self.horizon_ms().saturating_add(self.limits.max_future_skew_ms.max(0)).saturating_add(1)
    }

    /// [`key_lifetime_ms`](Self::key_lifetime_ms) as a duration.
    pub fn key_lifetime(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.key_lifetime_ms()).unwrap_or(0))
    }

    /// How long the usage store keeps accepted events: `retention`, but
    /// never less than a key's life ([`key_lifetime_ms`](Self::key_lifetime_ms)),
    /// since it holds the original a conflict with a remembered key is
    /// reported against (`retention` may equal the horizon).
    pub fn retention_ms(&self) -> i64 {
        ms(self.retention).max(self.key_lifetime_ms())
    }

    /// Classifier settings for one partition.
    pub fn classifier(&self, detect_replays: bool) -> crate::classify::ClassifierSettings {
        crate::classify::ClassifierSettings {
            hot_ttl_ms: self.hot_ttl_ms(),
            hot_capacity: self.hot_capacity,
            horizon_ms: self.key_lifetime_ms(),
            detect_replays,
        }
    }

    pub fn validator(&self) -> crate::event::Validator {
        crate::event::Validator::sharing(self.limits.clone(), self.closed_periods.clone(), &self.derive_salt)
            .with_unknown_fields(self.unknown_fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(args: TuningArgs, file: &str) -> Result<EngineSettings, ConfigError> {
        let file = FileConfig::parse(file).map_err(|why| ConfigError::File { path: "t.toml".into(), why })?;
        EngineSettings::resolve(&args, &file)
    }

    #[test]
    fn defaults_are_documented_values() {
        let s = resolve(TuningArgs::default(), "").expect("defaults are valid");
        assert_eq!(s, EngineSettings::default());
        assert_eq!(s.hot_ttl, Duration::from_secs(7 * 86_400));
        assert_eq!(s.horizon, Duration::from_secs(35 * 86_400));
        assert_eq!(s.limits.max_future_skew_ms, 3_600_000);
        assert_eq!(s.limits.max_dimensions, 16);
    }

    #[test]
    fn flag_beats_file_beats_default() {
        let args = TuningArgs { hot_ttl: Some("2d".into()), ..Default::default() };
        let s = resolve(args, "hot_ttl = \"3d\"\nhorizon = \"40d\"\nkeystore_max_bytes = \"1GiB\"").expect("valid");
        assert_eq!(s.hot_ttl, Duration::from_secs(2 * 86_400));
        assert_eq!(s.horizon, Duration::from_secs(40 * 86_400));
        assert_eq!(s.keystore_max_bytes, Some(1 << 30));
    }

    #[test]
    fn errors_name_the_key() {
        let e = resolve(TuningArgs { hot_ttl: Some("7 parsecs".into()), ..Default::default() }, "")
            .expect_err("bad duration");
        let msg = e.to_string();
        assert!(msg.contains("`hot_ttl`") && msg.contains("--hot-ttl") && msg.contains("DEDUPD_HOT_TTL"), "{msg}");

        let e = resolve(TuningArgs::default(), "fsync = \"sometimes\"").expect_err("bad fsync");
        assert!(e.to_string().contains("`fsync`"), "{e}");

        let e = resolve(TuningArgs::default(), "hot_tll = \"1d\"").expect_err("unknown key");
        assert!(e.to_string().contains("hot_tll"), "{e}");

        let e = resolve(TuningArgs::default(), "keystore_lookup_threads = 65").expect_err("too many helpers");
        assert!(e.to_string().contains("`keystore_lookup_threads`") && e.to_string().contains("at most 64"), "{e}");
        let s = resolve(TuningArgs { keystore_lookup_threads: Some("0".into()), ..Default::default() }, "")
            .expect("no helpers is valid");
        assert_eq!(s.keystore_lookup_threads, 0);

        let e = resolve(TuningArgs::default(), "hot_capacity = 4294967296").expect_err("beyond 32 bits");
        assert!(e.to_string().contains("`hot_capacity`") && e.to_string().contains("at most 4294967295"), "{e}");
        resolve(TuningArgs::default(), "hot_capacity = 4294967295").expect("the largest cache is valid");

        let e = resolve(TuningArgs { horizon: Some("1d".into()), ..Default::default() }, "").expect_err("short");
        assert!(e.to_string().contains("`horizon`"), "{e}");

        let e = resolve(TuningArgs { closed_periods: vec!["acme:2026-13".into()], ..Default::default() }, "")
            .expect_err("bad month");
        assert!(e.to_string().contains("closed_periods") && e.to_string().contains("dedupd period close"), "{e}");
        assert!(e.to_string().contains("(flag --closed-period, env DEDUPD_CLOSED_PERIODS)"), "the flag as typed: {e}");
    }

    /// What the key store would refuse only once its directory is made is
    /// refused here, named as the operator types it.
    #[test]
    fn a_layer_smaller_than_a_mebibyte_is_refused_with_its_own_name() {
        let e = resolve(TuningArgs::default(), r#"keystore_write_buffer = "512KiB""#).expect_err("too small");
        assert!(
            e.to_string()
                .contains("`keystore_write_buffer` (flag --keystore-write-buffer, env DEDUPD_KEYSTORE_WRITE_BUFFER)"),
            "{e}"
        );
        resolve(TuningArgs::default(), r#"keystore_write_buffer = "1MiB""#).expect("the smallest layer");
    }

    /// The window floor guards what a size cap leaves of the window: unset,
    /// it is the window the age check needs (max event age plus future
    /// skew plus a millisecond); beside a cap it lies between that window
    /// (a shorter one bills old retries again with no alert) and a key's
    /// lifetime (a longer one alerts whenever the cap binds).
    #[test]
    fn the_window_floor_beside_a_size_cap_lies_between_the_window_retries_need_and_a_keys_lifetime() {
        let floor = |extra: &str| resolve(TuningArgs::default(), extra).map(|s| s.keystore_window_floor);
        let cap = "keystore_max_bytes = \"1GiB\"\n";
        let needed = |days: u64| Duration::from_millis(days * 86_400_000 + 3_600_000 + 1);
        assert_eq!(floor("").expect("defaults"), needed(35));
        assert_eq!(floor("").expect("defaults"), EngineSettings::default().keystore_window_floor);
        assert_eq!(floor(cap).expect("a cap, the defaults"), needed(35));
        let short = "horizon = \"14d\"\nmax_event_age = \"14d\"\n";
        assert_eq!(floor(&format!("{short}{cap}")).expect("unset: the window needed"), needed(14));
        for below in ["30d", "35d", "35d 59m"] {
            let e = floor(&format!("{cap}keystore_window_floor = \"{below}\"\n")).expect_err("below the window needed");
            assert!(
                e.to_string().contains("`keystore_window_floor`") && e.to_string().contains("max_future_skew"),
                "{e}"
            );
            floor(&format!("keystore_window_floor = \"{below}\"\n")).expect("no cap: the alert cannot fire");
        }
        let e = floor(&format!("{short}{cap}keystore_window_floor = \"20d\"\n")).expect_err("above a key's lifetime");
        assert!(e.to_string().contains("`keystore_window_floor`") && e.to_string().contains("lifetime"), "{e}");
        floor(&format!("{short}{cap}keystore_window_floor = \"14d 1h 1ms\"\n")).expect("the window needed itself");
    }

    #[test]
    fn fsync_forms() {
        assert!(matches!("always".parse::<FsyncPolicy>(), Ok(FsyncPolicy::Always)));
        assert!(
            matches!("interval:250".parse::<FsyncPolicy>(), Ok(FsyncPolicy::Interval(d)) if d == Duration::from_millis(250))
        );
        assert!("interval:".parse::<FsyncPolicy>().is_err());
        assert!("interval:0".parse::<FsyncPolicy>().is_err());
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("-1").is_err());
    }

    #[test]
    fn kafka_properties_merge_key_by_key_later_sources_winning() {
        let file: Vec<String> =
            ["security.protocol=SASL_SSL", "queued.max.messages.kbytes=16384", "sasl.mechanism=PLAIN"]
                .map(String::from)
                .to_vec();
        let env = property_lines("# from the pod spec\nsasl.mechanism=SCRAM-SHA-512\n\nsasl.jaas.config=a b, c=d;\n");
        let flags: Vec<String> =
            ["sasl.password=hunter2", "queued.max.messages.kbytes=8192"].map(String::from).to_vec();
        let merged = merge_kafka_properties(&[
            PropertySource { name: "config file", entries: &file },
            PropertySource { name: "DEDUPD_KAFKA_PROPERTIES", entries: &env },
            PropertySource { name: "--kafka-property", entries: &flags },
        ])
        .expect("merge");
        let want = [
            ("security.protocol", "SASL_SSL"),
            ("queued.max.messages.kbytes", "8192"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.jaas.config", "a b, c=d;"),
            ("sasl.password", "hunter2"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        assert_eq!(merged, want.to_vec());

        let bad = ["sasl.password:hunter2 and more".to_owned()];
        let err = merge_kafka_properties(&[PropertySource { name: "--kafka-property", entries: &bad }])
            .expect_err("not key=value");
        assert!(err.contains("--kafka-property") && !err.contains("and more"), "{err}");
        assert!(err.contains("sasl.password") && !err.contains("hunter2"), "the value was echoed: {err}");
        // A multi-line PEM in DEDUPD_KAFKA_PROPERTIES: its next line is no
        // property, and none of it is shown.
        let pem = property_lines("ssl.key.pem=-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n");
        let err = merge_kafka_properties(&[PropertySource { name: "DEDUPD_KAFKA_PROPERTIES", entries: &pem }])
            .expect_err("a line without =");
        assert!(err.contains("entry 2") && !err.contains("MIIE"), "a secret was echoed: {err}");
    }

    #[test]
    fn kafka_secrets_come_from_files_or_variables_and_are_recognised_for_masking() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("pw");
        std::fs::write(&path, "s3cret\n").expect("write");
        let env = |v: &str| (v == "KAFKA_PW").then(|| "from-env".to_owned());
        let spec = format!("sasl.password=file:{}", path.display());
        assert_eq!(resolve_kafka_secret(&spec, env), Ok(("sasl.password".into(), "s3cret".into())));
        assert_eq!(
            resolve_kafka_secret("ssl.key.password=env:KAFKA_PW", env),
            Ok(("ssl.key.password".into(), "from-env".into()))
        );
        let missing = resolve_kafka_secret("sasl.password=env:NOPE", env).expect_err("unset");
        assert!(missing.contains("NOPE") && missing.contains("sasl.password"), "{missing}");
        assert!(resolve_kafka_secret("sasl.password=hunter2", env).expect_err("inline").contains("file:PATH"));
        for key in [
            "sasl.password",
            "producer.ssl.key.password",
            "sasl.oauthbearer.client.secret",
            "sasl.jaas.config",
            "ssl.key.pem",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.oauthbearer.assertion.private.key.passphrase",
        ] {
            assert!(is_secret_property(key), "{key}");
        }
        for key in ["security.protocol", "sasl.mechanism", "sasl.username", "queued.max.messages.kbytes", "ssl.ca.pem"]
        {
            assert!(!is_secret_property(key), "{key}");
        }
    }

    #[test]
    fn unknown_fields_policy_is_read_from_flag_or_file() {
        assert_eq!(resolve(TuningArgs::default(), "").expect("default").unknown_fields, UnknownFields::Reject);
        let s = resolve(TuningArgs::default(), "unknown_fields = \"ignore\"").expect("file");
        assert_eq!(s.unknown_fields, UnknownFields::Ignore);
        let args = TuningArgs { unknown_fields: Some("reject".into()), ..TuningArgs::default() };
        assert_eq!(resolve(args, "unknown_fields = \"ignore\"").expect("flag").unknown_fields, UnknownFields::Reject);
        let err = resolve(TuningArgs::default(), "unknown_fields = \"drop\"").expect_err("bad").to_string();
        assert!(err.contains("unknown_fields") && err.contains("drop"), "{err}");
    }
}
