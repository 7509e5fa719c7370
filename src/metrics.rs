//! Metrics: the registry of every DESIGN §8 metric, one typed struct per
//! observable event, and the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`).
//!
//! Every label set is bounded: buckets, reasons, tiers, stages and recovery
//! paths are closed enums pre-registered at start (so a dashboard sees zeros,
//! not gaps); partitions are bounded by the topic; tenants are capped at
//! [`MAX_TENANT_LABELS`] distinct values, the rest count under `_other`.
//!
//! The endpoint serves the Prometheus text format 0.0.4. prometheus-client
//! encodes OpenMetrics, whose counter families are named without `_total`
//! and end with `# EOF`; [`Metrics::encode`] rewrites those two details so
//! `promtool check metrics` accepts the page.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::event::RejectReason;

/// Most distinct tenant label values of `dedupd_conflicts_total`.
pub const MAX_TENANT_LABELS: usize = 256;
/// The tenant label for conflicts of tenants beyond the cap.
pub const OTHER_TENANT: &str = "_other";

/// The bucket an input record ends in (DESIGN §1, §5).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Bucket {
    accepted,
    duplicate,
    conflict,
    rejected,
    replayed,
}

impl Bucket {
    pub const ALL: [Bucket; 5] =
        [Bucket::accepted, Bucket::duplicate, Bucket::conflict, Bucket::rejected, Bucket::replayed];
}

/// A stage of the per-batch pipeline (DESIGN §6).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Stage {
    /// Decode, validate, hash and classify.
    classify,
    /// Produce to output and side topics and wait for acknowledgement
    /// (exactly-once: until the transaction commits).
    publish,
    /// Apply the published events to local state.
    apply,
    /// Commit input offsets (at-least-once only; inside the transaction otherwise).
    commit,
    /// Read the output partition back into local state.
    repair,
}

impl Stage {
    pub const ALL: [Stage; 5] = [Stage::classify, Stage::publish, Stage::apply, Stage::commit, Stage::repair];
}

/// A state tier whose remembered window is reported.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum WindowTier {
    hot_cache,
    keystore,
}

/// How a usage-store segment was recovered at start (DESIGN §7).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum RecoveryPath {
    sidecar,
    fallback,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BucketLabels {
    bucket: Bucket,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

/// Label values of `dedupd_publish_retries_total{reason}`: a closed set.
pub const PUBLISH_RETRY_REASONS: [&str; 5] =
    ["timeout", "broker", "transaction_aborted", "not_group_member", "queue_full"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: WindowTier,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    stage: Stage,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: RecoveryPath,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    partition: i32,
}

fn duration_histogram() -> Histogram {
    // 100 µs .. ~100 s: fsyncs at the low end, slow transactions at the top.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

/// Every metric of DESIGN §8 plus `dedupd_unkeyed_records_total`.
///
/// Cheap to share: every field is an `Arc`ed atomic; clone the `Arc<Metrics>`.
pub struct Metrics {
    registry: Registry,
    events: Family<BucketLabels, Counter>,
    conflicts: Family<TenantLabels, Counter>,
    /// Tenants that already own a label value. A std `Mutex`: held for one
    /// set lookup per conflict-carrying batch, never across an await.
    conflict_tenants: Mutex<HashSet<String>>,
    rejected: Family<ReasonLabels, Counter>,
    dedupe_window: Family<TierLabels, Gauge<f64, AtomicU64>>,
    hot_cache_entries: Gauge,
    keystore_bytes: Gauge,
    /// 1 while the key store's size cap holds its window below the floor.
    dedupe_window_below_floor: Gauge,
    batch_duration: Family<StageLabels, Histogram, fn() -> Histogram>,
    wal_fsync_duration: Histogram,
    repair_records: Counter,
    recovery_segments: Family<PathLabels, Counter>,
    consumer_lag: Family<PartitionLabels, Gauge>,
    assigned_partitions: Gauge,
    unkeyed_records: Counter,
    publish_retries: Family<ReasonLabels, Counter>,
    transactions: Family<OutcomeLabels, Counter>,
    transaction_resumes: Counter,
    repair_gap_records: Counter,
    stalled_partitions: Gauge,
    consumer_lag_seconds: Family<PartitionLabels, Gauge<f64, AtomicU64>>,
    unowned_lag: Gauge,
    hot_cache_evictions: Family<CauseLabels, Counter>,
    repair_remaining: Family<PartitionLabels, Gauge>,
    rebalances: Family<KindLabels, Counter>,
    healthy: AtomicBool,
    ready: AtomicBool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("dedupd");
        let events = Family::<BucketLabels, Counter>::default();
        let conflicts = Family::<TenantLabels, Counter>::default();
        let rejected = Family::<ReasonLabels, Counter>::default();
        let dedupe_window = Family::<TierLabels, Gauge<f64, AtomicU64>>::default();
        let hot_cache_entries = Gauge::default();
        let keystore_bytes = Gauge::default();
        let dedupe_window_below_floor = Gauge::default();
        let batch_duration =
            Family::<StageLabels, Histogram, fn() -> Histogram>::new_with_constructor(duration_histogram);
        let wal_fsync_duration = duration_histogram();
        let repair_records = Counter::default();
        let recovery_segments = Family::<PathLabels, Counter>::default();
        let consumer_lag = Family::<PartitionLabels, Gauge>::default();
        let assigned_partitions = Gauge::default();
        let unkeyed_records = Counter::default();
        let publish_retries = Family::<ReasonLabels, Counter>::default();
        let transactions = Family::<OutcomeLabels, Counter>::default();
        let transaction_resumes = Counter::default();
        let repair_gap_records = Counter::default();
        let stalled_partitions = Gauge::default();
        let consumer_lag_seconds = Family::<PartitionLabels, Gauge<f64, AtomicU64>>::default();
        let unowned_lag = Gauge::default();
        let hot_cache_evictions = Family::<CauseLabels, Counter>::default();
        let repair_remaining = Family::<PartitionLabels, Gauge>::default();
        let rebalances = Family::<KindLabels, Counter>::default();

        registry.register("events", "Input records by bucket", events.clone());
        registry.register("conflicts", "Conflicts (same id, different payload) by tenant", conflicts.clone());
        registry.register("rejected", "Rejected records by reason code", rejected.clone());
        registry.register(
            "dedupe_window_seconds",
            "Age of the oldest key still remembered, by tier",
            dedupe_window.clone(),
        );
        registry.register(
            "hot_cache_entries",
            "Keys in the hot caches of assigned partitions",
            hot_cache_entries.clone(),
        );
        registry.register("keystore_bytes", "Approximate size of the key store on disk", keystore_bytes.clone());
        registry.register(
            "dedupe_window_below_floor",
            "1 while the key store's size cap holds its dedupe window below the configured floor",
            dedupe_window_below_floor.clone(),
        );
        registry.register("batch_duration_seconds", "Time per batch, by pipeline stage", batch_duration.clone());
        registry.register("wal_fsync_duration_seconds", "Usage-store WAL fsync time", wal_fsync_duration.clone());
        registry.register(
            "repair_records",
            "Output records read back into local state by repair",
            repair_records.clone(),
        );
        registry.register(
            "recovery_segments",
            "Usage-store segments recovered at start, by path",
            recovery_segments.clone(),
        );
        registry.register(
            "consumer_lag_records",
            "Records between the consumer position and the high watermark, by input partition",
            consumer_lag.clone(),
        );
        registry.register(
            "assigned_partitions",
            "Input partitions owned by this instance",
            assigned_partitions.clone(),
        );
        registry.register(
            "unkeyed_records",
            "Input records without a key (retries of them may land on other partitions)",
            unkeyed_records.clone(),
        );

        registry.register(
            "publish_retries",
            "Batches published again after a transient failure, by reason",
            publish_retries.clone(),
        );
        registry.register("transactions", "Kafka transactions ended, by outcome", transactions.clone());
        registry.register(
            "transaction_resumes",
            "Transaction commits or aborts repeated after they timed out with their outcome unknown",
            transaction_resumes.clone(),
        );
        registry.register(
            "repair_gap_records",
            "Output records deleted by retention before local state applied them (--on-output-gap continue)",
            repair_gap_records.clone(),
        );
        registry.register(
            "stalled_partitions",
            "Owned partitions with input that made no progress for --stall-timeout (/healthz fails)",
            stalled_partitions.clone(),
        );
        registry.register(
            "consumer_lag_seconds",
            "Age of the oldest unprocessed input record's time, by input partition",
            consumer_lag_seconds.clone(),
        );
        registry.register(
            "unowned_input_lag_records",
            "Input records the group has not processed while this instance owns no partition",
            unowned_lag.clone(),
        );

        registry.register(
            "hot_cache_evictions",
            "Keys the hot caches dropped, by cause: expired (past the TTL) or capacity (still within it)",
            hot_cache_evictions.clone(),
        );
        for cause in ["expired", "capacity"] {
            let _ = hot_cache_evictions.get_or_create(&CauseLabels { cause });
        }
        registry.register(
            "repair_records_remaining",
            "Output records a running repair has still to read, by partition (0 when none runs)",
            repair_remaining.clone(),
        );
        registry.register(
            "rebalances",
            "Partition moves to or from this instance: assign, revoke, lost (revoked after the session expired)",
            rebalances.clone(),
        );
        for kind in ["assign", "revoke", "lost"] {
            let _ = rebalances.get_or_create(&KindLabels { kind });
        }

        // Pre-register every closed label value so series exist from the start.
        for reason in PUBLISH_RETRY_REASONS {
            let _ = publish_retries.get_or_create(&ReasonLabels { reason: reason.to_owned() });
        }
        for outcome in ["committed", "aborted"] {
            let _ = transactions.get_or_create(&OutcomeLabels { outcome: outcome.to_owned() });
        }
        for bucket in Bucket::ALL {
            let _ = events.get_or_create(&BucketLabels { bucket });
        }
        for reason in RejectReason::ALL {
            let _ = rejected.get_or_create(&ReasonLabels { reason: reason.as_str().to_owned() });
        }
        for tier in [WindowTier::hot_cache, WindowTier::keystore] {
            let _ = dedupe_window.get_or_create(&TierLabels { tier });
        }
        for stage in Stage::ALL {
            let _ = batch_duration.get_or_create(&StageLabels { stage });
        }
        for path in [RecoveryPath::sidecar, RecoveryPath::fallback] {
            let _ = recovery_segments.get_or_create(&PathLabels { path });
        }

        Metrics {
            registry,
            events,
            conflicts,
            conflict_tenants: Mutex::new(HashSet::new()),
            rejected,
            dedupe_window,
            hot_cache_entries,
            keystore_bytes,
            dedupe_window_below_floor,
            batch_duration,
            wal_fsync_duration,
            repair_records,
            recovery_segments,
            consumer_lag,
            assigned_partitions,
            unkeyed_records,
            publish_retries,
            transactions,
            transaction_resumes,
            repair_gap_records,
            stalled_partitions,
            consumer_lag_seconds,
            unowned_lag,
            hot_cache_evictions,
            repair_remaining,
            rebalances,
            healthy: AtomicBool::new(true),
            ready: AtomicBool::new(false),
        }
    }

    /// The page served on `/metrics`: Prometheus text format 0.0.4.
    pub fn encode(&self) -> String {
        let mut open_metrics = String::with_capacity(16 * 1024);
        if prometheus_client::encoding::text::encode(&mut open_metrics, &self.registry).is_err() {
            // Encoding into a String cannot fail; an empty page is the honest
            // answer if it ever does.
            return String::new();
        }
        let mut page = to_prometheus_text(&open_metrics);
        write_process_metrics(&mut page);
        page
    }

    /// Count of `bucket` so far (tests and the demo's table).
    pub fn events(&self, bucket: Bucket) -> u64 {
        self.events.get_or_create(&BucketLabels { bucket }).get()
    }

    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected.get_or_create(&ReasonLabels { reason: reason.as_str().to_owned() }).get()
    }

    pub fn repair_records(&self) -> u64 {
        self.repair_records.get()
    }

    pub fn unkeyed_records(&self) -> u64 {
        self.unkeyed_records.get()
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Marks the worker unhealthy (a fatal error is being handled).
    pub fn set_unhealthy(&self) {
        self.healthy.store(false, Ordering::SeqCst);
    }

    /// Healthy: no fatal error, and no owned partition stalled with input.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst) && self.stalled_partitions.get() == 0
    }

    /// Publish retries so far with `reason` (tests).
    pub fn publish_retries(&self, reason: &str) -> u64 {
        self.publish_retries.get_or_create(&ReasonLabels { reason: reason.to_owned() }).get()
    }

    /// Transactions ended so far, committed or aborted (tests).
    pub fn transactions(&self, committed: bool) -> u64 {
        let outcome = if committed { "committed" } else { "aborted" };
        self.transactions.get_or_create(&OutcomeLabels { outcome: outcome.to_owned() }).get()
    }

    pub fn transaction_resumes(&self) -> u64 {
        self.transaction_resumes.get()
    }

    pub fn repair_gap_records(&self) -> u64 {
        self.repair_gap_records.get()
    }

    pub fn stalled_partitions(&self) -> i64 {
        self.stalled_partitions.get()
    }

    /// The lag gauge of `partition`, `None` while it has never been set.
    pub fn consumer_lag(&self, partition: i32) -> Option<i64> {
        self.consumer_lag.get(&PartitionLabels { partition }).map(|g| g.get())
    }

    fn tenant_label(&self, tenant: &str) -> String {
        let mut known = match self.conflict_tenants.lock() {
            Ok(g) => g,
            // The set only ever grows; a panic mid-insert leaves it usable.
            Err(poisoned) => poisoned.into_inner(),
        };
        if known.contains(tenant) {
            return tenant.to_owned();
        }
        if known.len() < MAX_TENANT_LABELS {
            known.insert(tenant.to_owned());
            return tenant.to_owned();
        }
        OTHER_TENANT.to_owned()
    }
}

/// Rewrites prometheus-client's OpenMetrics text into the 0.0.4 text format:
/// counter families take their `_total` sample name in `# HELP`/`# TYPE`,
/// `# UNIT` and `# EOF` lines go.
/// The standard process metrics (the names every Prometheus client library
/// exports, so dashboards can show memory against the pod's limit) and
/// `dedupd_build_info`, read at scrape time from `/proc/self`. On a system
/// without `/proc` only the build info is written.
fn write_process_metrics(page: &mut String) {
    use std::fmt::Write;
    let stat = ProcessStat::read();
    let stat = stat.as_ref();
    let open_fds = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as f64);
    let process = [
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            stat.map(|s| s.cpu_seconds),
        ),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", stat.map(|s| s.resident_bytes)),
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", stat.map(|s| s.virtual_bytes)),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            stat.and_then(|s| s.start_time_seconds),
        ),
        ("process_open_fds", "gauge", "Number of open file descriptors.", open_fds),
        ("process_max_fds", "gauge", "Maximum number of open file descriptors.", max_fds()),
    ];
    for (name, kind, help, value) in process {
        if let Some(v) = value {
            let _ = write!(page, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n");
        }
    }
    let _ = write!(
        page,
        "# HELP dedupd_build_info The running dedupd's version (value 1).\n# TYPE dedupd_build_info gauge\n\
         dedupd_build_info{{version=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    );
}

/// What `/proc/self/stat` says about this process, in Prometheus units.
struct ProcessStat {
    cpu_seconds: f64,
    resident_bytes: f64,
    virtual_bytes: f64,
    start_time_seconds: Option<f64>,
}

impl ProcessStat {
    fn read() -> Option<ProcessStat> {
        let text = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name (field 2) may hold spaces and parentheses: the
        // fields we need come after its last `)`.
        let rest = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // `rest` starts at field 3 (state); field n is fields[n - 3].
        let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
        // SAFETY: sysconf only reads a system constant.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
        if ticks <= 0.0 || page <= 0.0 {
            return None;
        }
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<f64>().ok())));
        Some(ProcessStat {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * page,
            start_time_seconds: boot.zip(field(22)).map(|(b, start)| b + start / ticks),
        })
    }
}

fn max_fds() -> Option<f64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as f64)
}

fn to_prometheus_text(open_metrics: &str) -> String {
    let mut counters: HashSet<&str> = HashSet::new();
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.insert(name);
            }
        }
    }
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(name) && !name.ends_with("_total") {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(tail);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------
// Observable events: one struct per thing that happens, emitted once per
// batch (never once per record), so logs and metrics move together.
// ---------------------------------------------------------------------------

/// The buckets of one classified and published batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchClassified {
    pub partition: i32,
    pub accepted: u64,
    pub duplicate: u64,
    pub conflict: u64,
    pub rejected: u64,
    pub replayed: u64,
    pub unkeyed: u64,
    /// Rejections by reason.
    pub rejected_by_reason: Vec<(RejectReason, u64)>,
    /// Conflicts by tenant.
    pub conflicts_by_tenant: Vec<(String, u64)>,
}

impl BatchClassified {
    pub fn emit(&self, m: &Metrics) {
        for (bucket, n) in [
            (Bucket::accepted, self.accepted),
            (Bucket::duplicate, self.duplicate),
            (Bucket::conflict, self.conflict),
            (Bucket::rejected, self.rejected),
            (Bucket::replayed, self.replayed),
        ] {
            if n > 0 {
                m.events.get_or_create(&BucketLabels { bucket }).inc_by(n);
            }
        }
        for (reason, n) in &self.rejected_by_reason {
            m.rejected.get_or_create(&ReasonLabels { reason: reason.as_str().to_owned() }).inc_by(*n);
        }
        for (tenant, n) in &self.conflicts_by_tenant {
            let tenant = m.tenant_label(tenant);
            m.conflicts.get_or_create(&TenantLabels { tenant }).inc_by(*n);
        }
        if self.unkeyed > 0 {
            m.unkeyed_records.inc_by(self.unkeyed);
        }
        if self.conflict > 0 || self.rejected > 0 {
            tracing::info!(
                partition = self.partition,
                accepted = self.accepted,
                duplicate = self.duplicate,
                conflict = self.conflict,
                rejected = self.rejected,
                replayed = self.replayed,
                "batch had conflicts or rejects"
            );
        } else {
            tracing::debug!(
                partition = self.partition,
                accepted = self.accepted,
                duplicate = self.duplicate,
                replayed = self.replayed,
                "batch published"
            );
        }
    }
}

/// One pipeline stage of one batch took `duration`.
#[derive(Clone, Copy, Debug)]
pub struct StageTimed {
    pub stage: Stage,
    pub duration: Duration,
}

impl StageTimed {
    pub fn emit(&self, m: &Metrics) {
        m.batch_duration.get_or_create(&StageLabels { stage: self.stage }).observe(self.duration.as_secs_f64());
    }
}

/// A running repair of `partition` has `remaining` output records left to
/// read (0 once it ends or is abandoned).
#[derive(Clone, Copy, Debug)]
pub struct RepairProgressed {
    pub partition: i32,
    pub remaining: i64,
}

impl RepairProgressed {
    pub fn emit(&self, m: &Metrics) {
        m.repair_remaining.get_or_create(&PartitionLabels { partition: self.partition }).set(self.remaining.max(0));
    }
}

/// The consumer group moved partitions to or from this instance.
#[derive(Clone, Copy, Debug)]
pub enum Rebalanced {
    Assigned,
    Revoked,
    /// Revoked with the assignment already lost (session timeout, fencing).
    Lost,
}

impl Rebalanced {
    pub fn emit(&self, m: &Metrics) {
        let kind = match self {
            Rebalanced::Assigned => "assign",
            Rebalanced::Revoked => "revoke",
            Rebalanced::Lost => "lost",
        };
        m.rebalances.get_or_create(&KindLabels { kind }).inc();
    }

    /// Count of `kind` (`assign`, `revoke`, `lost`) so far.
    pub fn count(m: &Metrics, kind: &'static str) -> u64 {
        m.rebalances.get_or_create(&KindLabels { kind }).get()
    }
}

/// Repair read `records` output records of `partition` into local state.
#[derive(Clone, Copy, Debug)]
pub struct RepairCompleted {
    pub partition: i32,
    pub from_offset: i64,
    pub records: u64,
    pub duration: Duration,
}

impl RepairCompleted {
    pub fn emit(&self, m: &Metrics) {
        m.repair_records.inc_by(self.records);
        m.repair_remaining.get_or_create(&PartitionLabels { partition: self.partition }).set(0);
        StageTimed { stage: Stage::repair, duration: self.duration }.emit(m);
        tracing::info!(
            partition = self.partition,
            from_offset = self.from_offset,
            records = self.records,
            millis = self.duration.as_millis() as u64,
            "repair done"
        );
    }
}

/// The instance's assignment changed.
#[derive(Clone, Debug)]
pub struct AssignmentChanged {
    pub assigned: Vec<i32>,
    pub revoked: Vec<i32>,
    pub owned_now: usize,
}

impl AssignmentChanged {
    pub fn emit(&self, m: &Metrics) {
        m.assigned_partitions.set(self.owned_now as i64);
        for p in &self.revoked {
            m.consumer_lag.remove(&PartitionLabels { partition: *p });
            m.consumer_lag_seconds.remove(&PartitionLabels { partition: *p });
        }
        tracing::info!(assigned = ?self.assigned, revoked = ?self.revoked, owned = self.owned_now, "assignment changed");
    }
}

/// Consumer lag of one input partition, from librdkafka statistics.
#[derive(Clone, Copy, Debug)]
pub struct LagObserved {
    pub partition: i32,
    pub lag_records: i64,
}

impl LagObserved {
    pub fn emit(&self, m: &Metrics) {
        m.consumer_lag.get_or_create(&PartitionLabels { partition: self.partition }).set(self.lag_records.max(0));
    }
}

/// A batch failed to publish for a transient reason and will be retried.
#[derive(Clone, Copy, Debug)]
pub struct PublishRetried {
    /// One of [`PUBLISH_RETRY_REASONS`].
    pub reason: &'static str,
}

impl PublishRetried {
    pub fn emit(&self, m: &Metrics) {
        m.publish_retries.get_or_create(&ReasonLabels { reason: self.reason.to_owned() }).inc();
    }
}

/// A Kafka transaction ended.
#[derive(Clone, Copy, Debug)]
pub struct TransactionEnded {
    pub committed: bool,
}

impl TransactionEnded {
    pub fn emit(&self, m: &Metrics) {
        let outcome = if self.committed { "committed" } else { "aborted" };
        m.transactions.get_or_create(&OutcomeLabels { outcome: outcome.to_owned() }).inc();
    }
}

/// A transaction's commit or abort timed out and is being called again.
#[derive(Clone, Copy, Debug)]
pub struct TransactionResumed {
    /// `commit` or `abort`.
    pub operation: &'static str,
    pub attempt: u32,
}

impl TransactionResumed {
    pub fn emit(&self, m: &Metrics) {
        m.transaction_resumes.inc();
        tracing::warn!(
            operation = self.operation,
            attempt = self.attempt,
            "transaction {} timed out with its outcome unknown; resuming the same call",
            self.operation
        );
    }
}

/// Repair found output deleted by retention before local state applied it,
/// and went on past it (`--on-output-gap continue`).
#[derive(Clone, Copy, Debug)]
pub struct RepairGapFound {
    pub partition: i32,
    pub records: u64,
}

impl RepairGapFound {
    pub fn emit(&self, m: &Metrics) {
        m.repair_gap_records.inc_by(self.records);
        tracing::error!(
            partition = self.partition,
            records = self.records,
            "output records were deleted by retention before local state applied them; retries of those events \
             can no longer be recognised (continuing: --on-output-gap continue)"
        );
    }
}

/// How many owned partitions have input but made no progress for the
/// stall timeout. Non-zero fails `/healthz`.
#[derive(Clone, Copy, Debug)]
pub struct PartitionsStalled {
    pub count: usize,
}

impl PartitionsStalled {
    pub fn emit(&self, m: &Metrics) {
        let before = m.stalled_partitions.set(i64::try_from(self.count).unwrap_or(i64::MAX));
        if self.count > 0 && before == 0 {
            tracing::error!(
                stalled = self.count,
                "partitions with input made no progress for the stall timeout; /healthz now fails"
            );
        }
    }
}

/// Age of the event time at the head of one partition's unprocessed input.
#[derive(Clone, Copy, Debug)]
pub struct HeadAgeObserved {
    pub partition: i32,
    pub seconds: f64,
}

impl HeadAgeObserved {
    pub fn emit(&self, m: &Metrics) {
        m.consumer_lag_seconds.get_or_create(&PartitionLabels { partition: self.partition }).set(self.seconds.max(0.0));
    }
}

/// Input lag of the whole group while this instance owns no partition.
#[derive(Clone, Copy, Debug)]
pub struct UnownedLagObserved {
    pub lag_records: i64,
}

impl UnownedLagObserved {
    pub fn emit(&self, m: &Metrics) {
        m.unowned_lag.set(self.lag_records.max(0));
        if self.lag_records > 0 {
            tracing::warn!(
                lag_records = self.lag_records,
                "this instance owns no input partition while the group's input has lag; \
                 if no other instance is consuming, the group is stuck"
            );
        }
    }
}

/// A snapshot of the local state's size and memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct StateObserved {
    pub hot_cache_entries: u64,
    pub keystore_bytes: u64,
    /// Age of the oldest hot-cache key, if any.
    pub hot_window: Option<Duration>,
    /// Age of the oldest key-store key, if any.
    pub keystore_window: Option<Duration>,
    /// The size cap holds the key store's window below its floor.
    pub window_below_floor: bool,
    /// Hot-cache evictions since the process started (cumulative).
    pub hot_evictions: crate::classify::HotEvictions,
}

impl StateObserved {
    pub fn emit(&self, m: &Metrics) {
        m.hot_cache_entries.set(i64::try_from(self.hot_cache_entries).unwrap_or(i64::MAX));
        m.keystore_bytes.set(i64::try_from(self.keystore_bytes).unwrap_or(i64::MAX));
        m.dedupe_window_below_floor.set(i64::from(self.window_below_floor));
        // Cumulative counts in, counter increments out.
        for (cause, total) in [("expired", self.hot_evictions.expired), ("capacity", self.hot_evictions.at_capacity)] {
            let c = m.hot_cache_evictions.get_or_create(&CauseLabels { cause });
            c.inc_by(total.saturating_sub(c.get()));
        }
        for (tier, w) in [(WindowTier::hot_cache, self.hot_window), (WindowTier::keystore, self.keystore_window)] {
            m.dedupe_window.get_or_create(&TierLabels { tier }).set(w.map_or(0.0, |d| d.as_secs_f64()));
        }
    }
}

/// One WAL fsync of the usage store.
#[derive(Clone, Copy, Debug)]
pub struct WalFsynced {
    pub duration: Duration,
}

impl WalFsynced {
    pub fn emit(&self, m: &Metrics) {
        m.wal_fsync_duration.observe(self.duration.as_secs_f64());
    }
}

/// Usage-store recovery at start.
#[derive(Clone, Copy, Debug)]
pub struct SegmentsRecovered {
    pub sidecar: u64,
    pub fallback: u64,
}

impl SegmentsRecovered {
    pub fn emit(&self, m: &Metrics) {
        m.recovery_segments.get_or_create(&PathLabels { path: RecoveryPath::sidecar }).inc_by(self.sidecar);
        m.recovery_segments.get_or_create(&PathLabels { path: RecoveryPath::fallback }).inc_by(self.fallback);
        if self.fallback > 0 {
            tracing::warn!(fallback = self.fallback, "segments recovered by scan: sidecar missing or corrupt");
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP endpoint
// ---------------------------------------------------------------------------

/// Failure to serve the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot bind the metrics endpoint on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("metrics endpoint on {addr} failed: {source}")]
    Serve { addr: SocketAddr, source: std::io::Error },
}

/// A bound metrics endpoint; [`MetricsServer::serve`] runs it.
#[derive(Debug)]
pub struct MetricsServer {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    metrics: Arc<Metrics>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port; see [`MetricsServer::local_addr`]).
    pub async fn bind(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<MetricsServer, MetricsError> {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|source| MetricsError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| MetricsError::Bind { addr, source })?;
        Ok(MetricsServer { listener, addr, metrics })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), MetricsError> {
        use axum::http::{header, StatusCode};
        use axum::routing::get;

        let m = self.metrics.clone();
        let metrics_route = get(move || {
            let m = m.clone();
            async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], m.encode()) }
        });
        let m = self.metrics.clone();
        let healthz = get(move || {
            let m = m.clone();
            async move {
                if m.is_healthy() {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "unhealthy\n")
                }
            }
        });
        let m = self.metrics.clone();
        let readyz = get(move || {
            let m = m.clone();
            async move {
                if m.is_ready() {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready: repair in progress or no assignment yet\n")
                }
            }
        });
        let app =
            axum::Router::new().route("/metrics", metrics_route).route("/healthz", healthz).route("/readyz", readyz);
        let addr = self.addr;
        axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|source| MetricsError::Serve { addr, source })
    }
}

/// The usage store reports fsync latency and recovery paths here, so the
/// storage layer never depends on the metrics layer.
impl crate::storage::StorageObserver for Metrics {
    fn wal_fsync(&self, took: std::time::Duration) {
        self.wal_fsync_duration.observe(took.as_secs_f64());
    }

    fn recovery_segment(&self, path: crate::storage::RecoveryPath) {
        let path = match path {
            crate::storage::RecoveryPath::Sidecar => RecoveryPath::sidecar,
            crate::storage::RecoveryPath::Fallback => RecoveryPath::fallback,
        };
        self.recovery_segments.get_or_create(&PathLabels { path }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn families(page: &str) -> (HashSet<String>, Vec<String>) {
        let mut typed = HashSet::new();
        let mut samples = Vec::new();
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap_or("").to_owned());
            } else if !line.starts_with('#') && !line.is_empty() {
                let name = line.split(['{', ' ']).next().unwrap_or("").to_owned();
                samples.push(name);
            }
        }
        (typed, samples)
    }

    #[test]
    fn page_names_every_design_metric() {
        let m = Metrics::new();
        let page = m.encode();
        for name in [
            "dedupd_events_total",
            "dedupd_conflicts_total",
            "dedupd_rejected_total",
            "dedupd_dedupe_window_seconds",
            "dedupd_hot_cache_entries",
            "dedupd_keystore_bytes",
            "dedupd_dedupe_window_below_floor",
            "dedupd_batch_duration_seconds",
            "dedupd_wal_fsync_duration_seconds",
            "dedupd_repair_records_total",
            "dedupd_recovery_segments_total",
            "dedupd_consumer_lag_records",
            "dedupd_assigned_partitions",
            "dedupd_unkeyed_records_total",
        ] {
            assert!(page.contains(&format!("# TYPE {name} ")), "{name} missing from\n{page}");
        }
        assert!(!page.contains("# EOF"));
    }

    #[test]
    fn repair_progress_shows_records_remaining_until_the_repair_ends() {
        let m = Metrics::new();
        RepairProgressed { partition: 2, remaining: 500 }.emit(&m);
        assert!(m.encode().contains("dedupd_repair_records_remaining{partition=\"2\"} 500"));
        RepairCompleted { partition: 2, from_offset: 0, records: 500, duration: Duration::from_secs(1) }.emit(&m);
        assert!(m.encode().contains("dedupd_repair_records_remaining{partition=\"2\"} 0"));
        Rebalanced::Lost.emit(&m);
        assert!(m.encode().contains("dedupd_rebalances_total{kind=\"lost\"} 1"));
    }

    #[test]
    fn page_carries_the_process_metrics_and_the_build_info() {
        let page = Metrics::new().encode();
        let value = |name: &str| -> f64 {
            let line = page.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}"));
            line[name.len() + 1..].parse().expect("a number")
        };
        // This test process has memory, file descriptors and a start time.
        assert!(value("process_resident_memory_bytes") > 1e5);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_start_time_seconds") > 1.6e9);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(page.contains("# TYPE process_cpu_seconds_total counter"));
        let build = format!("dedupd_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
        assert!(page.contains(&build), "{page}");
    }

    #[test]
    fn every_sample_belongs_to_a_typed_family() {
        let m = Metrics::new();
        BatchClassified { conflict: 1, conflicts_by_tenant: vec![("acme".into(), 1)], ..Default::default() }.emit(&m);
        LagObserved { partition: 3, lag_records: 7 }.emit(&m);
        let (typed, samples) = families(&m.encode());
        assert!(!samples.is_empty());
        for s in samples {
            let family_ok = typed.contains(&s)
                || ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suf| s.strip_suffix(suf).is_some_and(|b| typed.contains(b)));
            assert!(family_ok, "sample {s} has no # TYPE line");
        }
    }

    #[test]
    fn batch_event_moves_bucket_and_reason_counters() {
        let m = Metrics::new();
        BatchClassified {
            accepted: 5,
            duplicate: 2,
            rejected: 1,
            unkeyed: 3,
            rejected_by_reason: vec![(RejectReason::MalformedJson, 1)],
            ..Default::default()
        }
        .emit(&m);
        assert_eq!(m.events(Bucket::accepted), 5);
        assert_eq!(m.events(Bucket::duplicate), 2);
        assert_eq!(m.rejected(RejectReason::MalformedJson), 1);
        assert_eq!(m.unkeyed_records(), 3);
        assert!(m.encode().contains("dedupd_events_total{bucket=\"accepted\"} 5"));
    }

    #[test]
    fn tenant_labels_are_capped() {
        let m = Metrics::new();
        let many: Vec<(String, u64)> = (0..MAX_TENANT_LABELS + 10).map(|i| (format!("t{i}"), 1)).collect();
        BatchClassified { conflicts_by_tenant: many, ..Default::default() }.emit(&m);
        let page = m.encode();
        let series = page.lines().filter(|l| l.starts_with("dedupd_conflicts_total{")).count();
        assert_eq!(series, MAX_TENANT_LABELS + 1);
        assert!(page.contains("dedupd_conflicts_total{tenant=\"_other\"} 10"));
    }

    #[tokio::test]
    async fn readyz_answers_503_until_ready() {
        let m = Arc::new(Metrics::new());
        let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), m.clone()).await.expect("bind");
        let addr = server.local_addr();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = rx.await;
        }));
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut buf = String::new();
            s.read_to_string(&mut buf).await.expect("read");
            buf
        };
        assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        m.set_ready(true);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        assert!(get("/metrics").await.contains("dedupd_events_total"));
        let _ = tx.send(());
        task.await.expect("join").expect("serve");
    }
}
