//! Metrics: the registry of every DESIGN §8 metric, one typed struct per
//! observable event, and the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`,
//! `/v1/usage`, `/runbook`).
//!
//! Every label set is bounded: buckets, reasons, tiers, stages and recovery
//! paths are closed enums pre-registered at start (so a dashboard sees zeros,
//! not gaps); partitions are bounded by the topic; tenants are capped at
//! [`MAX_TENANT_LABELS`] distinct values, the rest count under `_other`.
//!
//! Built on the `prometheus` crate, which encodes the Prometheus text format
//! 0.0.4 itself (`promtool check metrics` accepts the page as it is), with
//! its process collector: `process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, `process_max_fds`,
//! `process_start_time_seconds` and the rest, read from `/proc/self` at
//! scrape time, so a dashboard can show the worker's memory against its limit.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    exponential_buckets, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::event::RejectReason;

/// Most distinct tenant label values of `dedupd_conflicts_total`.
pub const MAX_TENANT_LABELS: usize = 256;
/// The tenant label for conflicts of tenants beyond the cap.
pub const OTHER_TENANT: &str = "_other";

/// The bucket an input record ends in (DESIGN §1, §5).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
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

    /// The label value of `dedupd_events_total{bucket}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::accepted => "accepted",
            Bucket::duplicate => "duplicate",
            Bucket::conflict => "conflict",
            Bucket::rejected => "rejected",
            Bucket::replayed => "replayed",
        }
    }
}

/// A stage of the per-batch pipeline (DESIGN §6).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
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

    /// The label value of `dedupd_batch_duration_seconds{stage}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::classify => "classify",
            Stage::publish => "publish",
            Stage::apply => "apply",
            Stage::commit => "commit",
            Stage::repair => "repair",
        }
    }
}

/// A state tier whose remembered window is reported.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum WindowTier {
    hot_cache,
    keystore,
}

impl WindowTier {
    /// The label value of `dedupd_dedupe_window_seconds{tier}`.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowTier::hot_cache => "hot_cache",
            WindowTier::keystore => "keystore",
        }
    }
}

/// Label values of `dedupd_publish_retries_total{reason}`: a closed set.
pub const PUBLISH_RETRY_REASONS: [&str; 5] =
    ["timeout", "broker", "transaction_aborted", "not_group_member", "queue_full"];

/// Label values of `dedupd_recovery_segments_total{path}`.
const RECOVERY_PATHS: [&str; 2] = ["sidecar", "fallback"];

fn duration_buckets() -> Vec<f64> {
    // 100 µs .. ~100 s: fsyncs at the low end, slow transactions at the top.
    // Start, factor and count are fixed and valid, so this cannot fail.
    exponential_buckets(0.0001, 2.0, 21).unwrap_or_default()
}

/// Every metric of DESIGN §8 plus `dedupd_unkeyed_records_total`.
///
/// Cheap to share: every field is an `Arc`ed atomic; clone the `Arc<Metrics>`.
pub struct Metrics {
    registry: Registry,
    events: IntCounterVec,
    conflicts: IntCounterVec,
    /// Tenants that already own a label value. A std `Mutex`: held for one
    /// set lookup per conflict-carrying batch, never across an await.
    conflict_tenants: Mutex<HashSet<String>>,
    rejected: IntCounterVec,
    dedupe_window: GaugeVec,
    hot_cache_entries: IntGauge,
    keystore_bytes: IntGauge,
    /// 1 while the key store's size cap holds its window below the floor.
    dedupe_window_below_floor: IntGauge,
    batch_duration: HistogramVec,
    wal_fsync_duration: Histogram,
    repair_records: IntCounter,
    recovery_segments: IntCounterVec,
    consumer_lag: IntGaugeVec,
    assigned_partitions: IntGauge,
    unkeyed_records: IntCounter,
    misrouted_records: IntCounter,
    late_events: IntCounter,
    republished_rollups: IntCounter,
    closed_periods: IntGauge,
    routed_records: IntCounterVec,
    publish_retries: IntCounterVec,
    transactions: IntCounterVec,
    transaction_resumes: IntCounter,
    repair_gap_records: IntCounter,
    stalled_partitions: IntGauge,
    consumer_lag_seconds: GaugeVec,
    unowned_lag: IntGauge,
    hot_cache_evictions: IntCounterVec,
    repair_remaining: IntGaugeVec,
    repair_last_records: IntGaugeVec,
    repair_last_seconds: GaugeVec,
    standby_partitions: IntGauge,
    standby_records: IntCounter,
    rebalances: IntCounterVec,
    healthy: AtomicBool,
    /// See [`GroupStuck`].
    group_stuck: AtomicBool,
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

/// Builds and registers the metrics. Every name, help text, label and bucket
/// here is a constant, so the only ways to fail are programming errors (an
/// invalid or duplicate name) that the unit tests of this module hit first.
struct Builder {
    registry: Registry,
}

const DEFINITIONS_ARE_VALID: &str = "metric definitions are constants checked by the metrics tests";

impl Builder {
    fn add<M: prometheus::core::Collector + Clone + 'static>(&self, m: M) -> M {
        self.registry.register(Box::new(m.clone())).expect(DEFINITIONS_ARE_VALID);
        m
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help).expect(DEFINITIONS_ARE_VALID))
    }

    fn counters(&self, name: &str, help: &str, label: &str) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), &[label]).expect(DEFINITIONS_ARE_VALID))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help).expect(DEFINITIONS_ARE_VALID))
    }

    fn gauges(&self, name: &str, help: &str, label: &str) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), &[label]).expect(DEFINITIONS_ARE_VALID))
    }

    fn float_gauges(&self, name: &str, help: &str, label: &str) -> GaugeVec {
        self.add(GaugeVec::new(Opts::new(name, help), &[label]).expect(DEFINITIONS_ARE_VALID))
    }

    fn histogram_opts(name: &str, help: &str) -> HistogramOpts {
        HistogramOpts::new(name, help).buckets(duration_buckets())
    }
}

impl Metrics {
    /// # Panics
    ///
    /// Only on an invalid or duplicate metric definition, a programming
    /// error every test that builds `Metrics` would show.
    pub fn new() -> Metrics {
        let b = Builder { registry: Registry::new() };
        let events = b.counters("dedupd_events_total", "Input records by bucket", "bucket");
        let conflicts =
            b.counters("dedupd_conflicts_total", "Conflicts (same id, different payload) by tenant", "tenant");
        let rejected = b.counters("dedupd_rejected_total", "Rejected records by reason code", "reason");
        let dedupe_window =
            b.float_gauges("dedupd_dedupe_window_seconds", "Age of the oldest key still remembered, by tier", "tier");
        let hot_cache_entries = b.gauge("dedupd_hot_cache_entries", "Keys in the hot caches of assigned partitions");
        let keystore_bytes = b.gauge("dedupd_keystore_bytes", "Approximate size of the key store on disk");
        let dedupe_window_below_floor = b.gauge(
            "dedupd_dedupe_window_below_floor",
            "1 while the key store's size cap holds its dedupe window below the configured floor",
        );
        let batch_duration = b.add(
            HistogramVec::new(
                Builder::histogram_opts("dedupd_batch_duration_seconds", "Time per batch, by pipeline stage"),
                &["stage"],
            )
            .expect(DEFINITIONS_ARE_VALID),
        );
        let wal_fsync_duration = b.add(
            Histogram::with_opts(Builder::histogram_opts(
                "dedupd_wal_fsync_duration_seconds",
                "Usage-store WAL fsync time",
            ))
            .expect(DEFINITIONS_ARE_VALID),
        );
        let repair_records =
            b.counter("dedupd_repair_records_total", "Output records read back into local state by repair");
        let recovery_segments =
            b.counters("dedupd_recovery_segments_total", "Usage-store segments recovered at start, by path", "path");
        let consumer_lag = b.gauges(
            "dedupd_consumer_lag_records",
            "Records between the consumer position and the high watermark, by input partition",
            "partition",
        );
        let assigned_partitions = b.gauge("dedupd_assigned_partitions", "Input partitions owned by this instance");
        let unkeyed_records = b.counter(
            "dedupd_unkeyed_records_total",
            "Input records without a key (retries of them may land on other partitions)",
        );
        let misrouted_records = b.counter(
            "dedupd_misrouted_records_total",
            "Valid input records on a partition other than the one --partitioner assigns their identity",
        );
        let closed_periods = b.gauge(
            "dedupd_closed_periods",
            "Billing periods (tenant, month) this worker knows are closed, from the periods topic: usage into them is rejected",
        );
        let late_events = b.counter(
            "dedupd_late_events_total",
            "Accepted events later than the lateness window behind their counter's watermark: \
             published as adjustments (reason late), their hours left as they were",
        );
        let republished_rollups = b.counter(
            "dedupd_republished_rollups_total",
            "Rollup and adjustment records published again for replayed events (at least once: a \
             redelivered batch whose events were already on the output, after a failed publish or a crash)",
        );
        let routed_records = b.counters(
            "dedupd_routed_records_total",
            "Raw records `dedupd route` keyed and placed by identity (routed) or sent to the rejected topic",
            "result",
        );
        let publish_retries = b.counters(
            "dedupd_publish_retries_total",
            "Batches published again after a transient failure, by reason",
            "reason",
        );
        let transactions = b.counters("dedupd_transactions_total", "Kafka transactions ended, by outcome", "outcome");
        let transaction_resumes = b.counter(
            "dedupd_transaction_resumes_total",
            "Transaction commits or aborts repeated after they timed out with their outcome unknown",
        );
        let repair_gap_records = b.counter(
            "dedupd_repair_gap_records_total",
            "Output records deleted by retention before local state applied them (--on-output-gap continue)",
        );
        let stalled_partitions = b.gauge(
            "dedupd_stalled_partitions",
            "Owned partitions with input that made no progress for --stall-timeout (/healthz fails)",
        );
        let consumer_lag_seconds = b.float_gauges(
            "dedupd_consumer_lag_seconds",
            "Age of the oldest unprocessed input record's time, by input partition",
            "partition",
        );
        let unowned_lag = b.gauge(
            "dedupd_unowned_input_lag_records",
            "Input records the group has not processed while this instance owns no partition",
        );
        let hot_cache_evictions = b.counters(
            "dedupd_hot_cache_evictions_total",
            "Keys the hot caches dropped, by cause: expired (past the TTL) or capacity (still within it)",
            "cause",
        );
        let repair_remaining = b.gauges(
            "dedupd_repair_records_remaining",
            "Output records a running repair has still to read, by partition (0 when none runs)",
            "partition",
        );
        let repair_last_records = b.gauges(
            "dedupd_repair_last_records",
            "Output records the last finished repair of a partition applied, by partition",
            "partition",
        );
        let standby_partitions = b.gauge(
            "dedupd_standby_partitions",
            "Output partitions of other owners this worker follows as a warm standby (--standby-replicas)",
        );
        let standby_records = b.counter(
            "dedupd_standby_records_total",
            "Output records of other owners' partitions applied to local state by standbys",
        );
        let repair_last_seconds = b.float_gauges(
            "dedupd_repair_last_seconds",
            "How long the last finished repair of a partition took, by partition",
            "partition",
        );
        let rebalances = b.counters(
            "dedupd_rebalances_total",
            "Partition moves to or from this instance: assign, revoke, lost (revoked after the session expired)",
            "kind",
        );
        let build_info = b.add(
            IntGaugeVec::new(Opts::new("dedupd_build_info", "The running dedupd's version (value 1)."), &["version"])
                .expect(DEFINITIONS_ARE_VALID),
        );
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        // The standard process metrics, read from /proc at scrape time.
        #[cfg(target_os = "linux")]
        b.add_process_collector();

        // Pre-register every closed label value so series exist from the start.
        let closed: [(&IntCounterVec, &[&str]); 8] = [
            (&events, &Bucket::ALL.map(Bucket::as_str)),
            (&rejected, &RejectReason::ALL.map(RejectReason::as_str)),
            (&publish_retries, &PUBLISH_RETRY_REASONS),
            (&transactions, &["committed", "aborted"]),
            (&recovery_segments, &RECOVERY_PATHS),
            (&hot_cache_evictions, &["expired", "capacity"]),
            (&rebalances, &["assign", "revoke", "lost"]),
            (&routed_records, &["routed", "rejected"]),
        ];
        for (family, values) in closed {
            for v in values {
                let _ = family.with_label_values(&[v]);
            }
        }
        for tier in [WindowTier::hot_cache, WindowTier::keystore] {
            let _ = dedupe_window.with_label_values(&[tier.as_str()]);
        }
        for stage in Stage::ALL {
            let _ = batch_duration.with_label_values(&[stage.as_str()]);
        }

        Metrics {
            registry: b.registry,
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
            misrouted_records,
            late_events,
            republished_rollups,
            closed_periods,
            routed_records,
            publish_retries,
            transactions,
            transaction_resumes,
            repair_gap_records,
            stalled_partitions,
            consumer_lag_seconds,
            unowned_lag,
            hot_cache_evictions,
            repair_remaining,
            repair_last_records,
            repair_last_seconds,
            standby_partitions,
            standby_records,
            rebalances,
            healthy: AtomicBool::new(true),
            group_stuck: AtomicBool::new(false),
            ready: AtomicBool::new(false),
        }
    }

    /// The page served on `/metrics`: Prometheus text format 0.0.4.
    pub fn encode(&self) -> String {
        let mut page = Vec::with_capacity(16 * 1024);
        if TextEncoder::new().encode(&self.registry.gather(), &mut page).is_err() {
            // Encoding into memory cannot fail; an empty page is the honest
            // answer if it ever does.
            return String::new();
        }
        String::from_utf8(page).unwrap_or_default()
    }

    /// Count of `bucket` so far (tests and the demo's table).
    pub fn events(&self, bucket: Bucket) -> u64 {
        self.events.with_label_values(&[bucket.as_str()]).get()
    }

    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected.with_label_values(&[reason.as_str()]).get()
    }

    pub fn repair_records(&self) -> u64 {
        self.repair_records.get()
    }

    pub fn unkeyed_records(&self) -> u64 {
        self.unkeyed_records.get()
    }

    pub fn misrouted_records(&self) -> u64 {
        self.misrouted_records.get()
    }

    pub fn late_events(&self) -> u64 {
        self.late_events.get()
    }

    pub fn republished_rollups(&self) -> u64 {
        self.republished_rollups.get()
    }

    /// How many periods the periods reader last found closed.
    pub fn set_closed_periods(&self, n: usize) {
        self.closed_periods.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Raw records the router handled, `result` one of routed, rejected.
    pub fn routed_records(&self, result: &str) -> u64 {
        self.routed_records.with_label_values(&[result]).get()
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

    /// `dedupd_assigned_partitions`: input partitions this instance owns.
    pub fn assigned_partitions(&self) -> i64 {
        self.assigned_partitions.get()
    }

    /// Healthy: no fatal error, and no owned partition stalled with input.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
            && self.stalled_partitions.get() == 0
            && !self.group_stuck.load(Ordering::SeqCst)
    }

    /// Publish retries so far with `reason` (tests).
    pub fn publish_retries(&self, reason: &str) -> u64 {
        self.publish_retries.with_label_values(&[reason]).get()
    }

    /// Transactions ended so far, committed or aborted (tests).
    pub fn transactions(&self, committed: bool) -> u64 {
        let outcome = if committed { "committed" } else { "aborted" };
        self.transactions.with_label_values(&[outcome]).get()
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
        use prometheus::core::Collector;
        let label = partition.to_string();
        self.consumer_lag.collect().iter().flat_map(|family| family.get_metric()).find_map(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == "partition" && l.value() == label)
                .then(|| m.get_gauge().get_value() as i64)
        })
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

impl Builder {
    #[cfg(target_os = "linux")]
    fn add_process_collector(&self) {
        self.registry
            .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
            .expect(DEFINITIONS_ARE_VALID);
    }
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
    /// Valid records whose identity belongs on another partition (rejected
    /// with `misrouted` or not, as `--on-misrouted` says).
    pub misrouted: u64,
    /// Accepted events the ledger made adjustments (reason `late`).
    pub late: u64,
    /// Rollup and adjustment records published again for replays.
    pub republished: u64,
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
                m.events.with_label_values(&[bucket.as_str()]).inc_by(n);
            }
        }
        for (reason, n) in &self.rejected_by_reason {
            m.rejected.with_label_values(&[reason.as_str()]).inc_by(*n);
        }
        for (tenant, n) in &self.conflicts_by_tenant {
            let tenant = m.tenant_label(tenant);
            m.conflicts.with_label_values(&[tenant.as_str()]).inc_by(*n);
        }
        if self.unkeyed > 0 {
            m.unkeyed_records.inc_by(self.unkeyed);
        }
        if self.misrouted > 0 {
            m.misrouted_records.inc_by(self.misrouted);
        }
        if self.late > 0 {
            m.late_events.inc_by(self.late);
        }
        if self.republished > 0 {
            m.republished_rollups.inc_by(self.republished);
        }
        if self.conflict > 0 || self.rejected > 0 || self.misrouted > 0 {
            tracing::info!(
                partition = self.partition,
                accepted = self.accepted,
                duplicate = self.duplicate,
                conflict = self.conflict,
                rejected = self.rejected,
                replayed = self.replayed,
                misrouted = self.misrouted,
                "batch had conflicts, rejects or misrouted records"
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
        m.batch_duration.with_label_values(&[self.stage.as_str()]).observe(self.duration.as_secs_f64());
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
        m.repair_remaining.with_label_values(&[self.partition.to_string().as_str()]).set(self.remaining.max(0));
    }
}

/// What the warm standbys did: how many partitions they follow now, and
/// records they applied since the last report.
#[derive(Clone, Copy, Debug)]
pub struct StandbyProgressed {
    pub following: usize,
    pub applied: u64,
}

impl StandbyProgressed {
    pub fn emit(&self, m: &Metrics) {
        m.standby_partitions.set(i64::try_from(self.following).unwrap_or(i64::MAX));
        m.standby_records.inc_by(self.applied);
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
        m.rebalances.with_label_values(&[kind]).inc();
    }

    /// Count of `kind` (`assign`, `revoke`, `lost`) so far.
    pub fn count(m: &Metrics, kind: &'static str) -> u64 {
        m.rebalances.with_label_values(&[kind]).get()
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
        let partition = self.partition.to_string();
        m.repair_records.inc_by(self.records);
        m.repair_remaining.with_label_values(&[partition.as_str()]).set(0);
        m.repair_last_records
            .with_label_values(&[partition.as_str()])
            .set(i64::try_from(self.records).unwrap_or(i64::MAX));
        m.repair_last_seconds.with_label_values(&[partition.as_str()]).set(self.duration.as_secs_f64());
        StageTimed { stage: Stage::repair, duration: self.duration }.emit(m);
        let secs = self.duration.as_secs_f64();
        tracing::info!(
            partition = self.partition,
            from_offset = self.from_offset,
            records = self.records,
            millis = self.duration.as_millis() as u64,
            records_per_second = if secs > 0.0 { (self.records as f64 / secs) as u64 } else { 0 },
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
            // A series that was never set is already absent: nothing to remove.
            let _ = m.consumer_lag.remove_label_values(&[p.to_string().as_str()]);
            let _ = m.consumer_lag_seconds.remove_label_values(&[p.to_string().as_str()]);
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
        m.consumer_lag.with_label_values(&[self.partition.to_string().as_str()]).set(self.lag_records.max(0));
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
        m.publish_retries.with_label_values(&[self.reason]).inc();
    }
}

/// The router published one batch of raw records.
#[derive(Clone, Copy, Debug)]
pub struct RouteBatchPublished {
    pub routed: u64,
    pub rejected: u64,
}

impl RouteBatchPublished {
    pub fn emit(&self, m: &Metrics) {
        m.routed_records.with_label_values(&["routed"]).inc_by(self.routed);
        m.routed_records.with_label_values(&["rejected"]).inc_by(self.rejected);
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
        m.transactions.with_label_values(&[outcome]).inc();
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
        let before = m.stalled_partitions.get();
        m.stalled_partitions.set(i64::try_from(self.count).unwrap_or(i64::MAX));
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
        m.consumer_lag_seconds.with_label_values(&[self.partition.to_string().as_str()]).set(self.seconds.max(0.0));
    }
}

/// Whether the group looks stuck to this instance, which owns nothing: lag,
/// and committed offsets that have not moved for the stall timeout. Fails
/// `/healthz` while it lasts, so an orchestrator restarts the instance.
#[derive(Clone, Copy, Debug)]
pub struct GroupStuck {
    pub stuck: bool,
}

impl GroupStuck {
    pub fn emit(&self, m: &Metrics) {
        let was = m.group_stuck.swap(self.stuck, Ordering::SeqCst);
        if self.stuck && !was {
            tracing::error!(
                "this instance owns no input partition, the group's input has lag and its committed offsets \
                 have not moved for the stall timeout: the group is stuck; /healthz now fails so this \
                 instance is restarted and joins again"
            );
        }
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
            let c = m.hot_cache_evictions.with_label_values(&[cause]);
            c.inc_by(total.saturating_sub(c.get()));
        }
        for (tier, w) in [(WindowTier::hot_cache, self.hot_window), (WindowTier::keystore, self.keystore_window)] {
            m.dedupe_window.with_label_values(&[tier.as_str()]).set(w.map_or(0.0, |d| d.as_secs_f64()));
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
        m.recovery_segments.with_label_values(&["sidecar"]).inc_by(self.sidecar);
        m.recovery_segments.with_label_values(&["fallback"]).inc_by(self.fallback);
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
pub struct MetricsServer {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    usage: Option<UsageSource>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer").field("addr", &self.addr).field("usage", &self.usage.is_some()).finish()
    }
}

/// Answers `GET /v1/usage` (blocking: it reads local state). `Ok(None)`:
/// no ledger is kept; `Err`: the query could not be answered.
pub type UsageSource =
    Arc<dyn Fn(&crate::ledger::UsageQuery) -> Result<Option<serde_json::Value>, String> + Send + Sync>;

/// The query string's `name=value` pairs, percent-decoded (`+` is a space).
fn query_pairs(query: &str) -> Vec<(String, String)> {
    fn decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < b.len() => {
                    match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                        Ok(v) => {
                            out.push(v);
                            i += 2;
                        }
                        Err(_) => out.push(b'%'),
                    }
                }
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(kv), String::new()),
        })
        .collect()
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port; see [`MetricsServer::local_addr`]).
    pub async fn bind(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<MetricsServer, MetricsError> {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|source| MetricsError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| MetricsError::Bind { addr, source })?;
        Ok(MetricsServer { listener, addr, metrics, usage: None })
    }

    /// Serves `GET /v1/usage?tenant=T&from=…&to=…[&customer=C][&meter=M][&group_by=G]`
    /// from `source`: the same query as `dedupd usage`, answered as JSON.
    pub fn with_usage(mut self, source: UsageSource) -> MetricsServer {
        self.usage = Some(source);
        self
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
        let source = self.usage.clone();
        let usage = get(move |uri: axum::http::Uri| {
            let source = source.clone();
            async move {
                let json = |status: StatusCode, body: serde_json::Value| {
                    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string() + "\n")
                };
                let Some(source) = source else {
                    return json(
                        StatusCode::NOT_FOUND,
                        serde_json::json!({"error": "no usage ledger in this process"}),
                    );
                };
                let pairs = query_pairs(uri.query().unwrap_or(""));
                let get = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
                let query = match crate::ledger::UsageQuery::parse(
                    get("tenant"),
                    get("customer"),
                    get("meter"),
                    get("from").as_deref(),
                    get("to").as_deref(),
                    get("group_by").as_deref(),
                ) {
                    Ok(q) if q.needs_events() => {
                        let why = "group_by=dimension:KEY is answered from the accepted events, which a worker \
                                   does not scan while it serves: use `dedupd usage --group-by dimension:KEY` with \
                                   --brokers --output-topic (the deployment) or --state-dir (a stopped worker)";
                        return json(StatusCode::BAD_REQUEST, serde_json::json!({"error": why}));
                    }
                    Ok(q) => q,
                    Err(why) => return json(StatusCode::BAD_REQUEST, serde_json::json!({"error": why})),
                };
                match tokio::task::spawn_blocking(move || source(&query)).await {
                    Ok(Ok(Some(answer))) => json(StatusCode::OK, answer),
                    Ok(Ok(None)) => {
                        json(StatusCode::NOT_FOUND, serde_json::json!({"error": "the ledger is off (--ledger false)"}))
                    }
                    Ok(Err(why)) => json(StatusCode::INTERNAL_SERVER_ERROR, serde_json::json!({"error": why})),
                    Err(e) => json(StatusCode::INTERNAL_SERVER_ERROR, serde_json::json!({"error": e.to_string()})),
                }
            }
        });
        // Rendered once: the page is the same for the life of the process.
        let runbook_page = std::sync::Arc::new(crate::runbook::html_page());
        let runbook = get(move || {
            let page = runbook_page.clone();
            async move { ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], page.as_str().to_owned()) }
        });
        let app = axum::Router::new()
            .route("/metrics", metrics_route)
            .route("/healthz", healthz)
            .route("/readyz", readyz)
            .route("/v1/usage", usage)
            .route("/runbook", runbook);
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
        self.recovery_segments.with_label_values(&[path.as_str()]).inc();
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
        // Families labelled by tenant or partition have no series until
        // something is observed (the `prometheus` crate, like Go's client,
        // writes no empty family); every other family is there from start.
        BatchClassified { conflict: 1, conflicts_by_tenant: vec![("acme".into(), 1)], ..BatchClassified::default() }
            .emit(&m);
        LagObserved { partition: 0, lag_records: 3 }.emit(&m);
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
            "dedupd_misrouted_records_total",
            "dedupd_late_events_total",
            "dedupd_republished_rollups_total",
            "dedupd_closed_periods",
            "dedupd_standby_partitions",
            "dedupd_standby_records_total",
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
        assert!(m.encode().contains("dedupd_repair_last_records{partition=\"2\"} 500"));
        assert!(m.encode().contains("dedupd_repair_last_seconds{partition=\"2\"} 1"));
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
            misrouted: 4,
            rejected_by_reason: vec![(RejectReason::MalformedJson, 1)],
            ..Default::default()
        }
        .emit(&m);
        assert_eq!(m.events(Bucket::accepted), 5);
        assert_eq!(m.events(Bucket::duplicate), 2);
        assert_eq!(m.rejected(RejectReason::MalformedJson), 1);
        assert_eq!(m.unkeyed_records(), 3);
        assert_eq!(m.misrouted_records(), 4);
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

    /// One HTTP/1.1 GET of `path`, the whole response as text.
    async fn http_get(addr: SocketAddr, path: String) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.expect("read");
        buf
    }

    #[tokio::test]
    async fn usage_is_served_from_local_state_and_bad_queries_get_400() {
        use crate::storage::testutil::sample_event_at;
        let now = 1_700_000_000_000;
        let mut state = crate::state::LocalState::in_memory(crate::config::EngineSettings::default(), true);
        state.assign(0, now).expect("assign");
        let batch: Vec<crate::state::StoredEvent> = (0..5)
            .map(|i| {
                let mut e = sample_event_at(i, 0, i as i64, now);
                e.event.tenant_id = "acme co".into();
                e.event.kind = crate::event::EventKind::Usage;
                e.event.quantity = rust_decimal::Decimal::from(2);
                e
            })
            .collect();
        state.apply_published(0, &batch, now).expect("apply");
        let state = Arc::new(std::sync::Mutex::new(state));
        let source: UsageSource = Arc::new(move |q| {
            let s = state.lock().map_err(|e| e.to_string())?;
            s.usage(q).map_err(|e| e.to_string())?.map(|a| a.to_json()).transpose().map_err(|e| e.to_string())
        });
        let m = Arc::new(Metrics::new());
        let server =
            MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), m).await.expect("bind").with_usage(source);
        let addr = server.local_addr();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = rx.await;
        }));
        let get = |path: String| http_get(addr, path);
        // A tenant with a space, RFC 3339 bounds with an encoded offset.
        let ok = get("/v1/usage?tenant=acme+co&from=2023-11-01&to=2023-11-20T00%3A00%3A00%2B00%3A00".into()).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        let body: serde_json::Value = serde_json::from_str(ok.split("\r\n\r\n").nth(1).expect("body")).expect("json");
        assert_eq!(body["rolled_up"], "10", "{body}");
        let bad = get("/v1/usage?tenant=acme+co&from=2023-12&to=2023-11".into()).await;
        assert!(bad.starts_with("HTTP/1.1 400") && bad.contains("backwards"), "{bad}");
        let missing = get("/v1/usage?from=2023-11&to=2023-12".into()).await;
        assert!(missing.starts_with("HTTP/1.1 400") && missing.contains("tenant is required"), "{missing}");
        // Dimension values are not in the worker's rollups: refused with the way to ask.
        let dims = get("/v1/usage?tenant=acme&from=2023-11&to=2023-12&group_by=dimension%3Aregion".into()).await;
        assert!(dims.starts_with("HTTP/1.1 400") && dims.contains("--output-topic"), "{dims}");
        let _ = tx.send(());
        task.await.expect("join").expect("serve");
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
        let get = |path: &'static str| http_get(addr, path.to_owned());
        assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        m.set_ready(true);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        assert!(get("/metrics").await.contains("dedupd_events_total"));
        // The alerts' links land here, on the section of the alert.
        let runbook = get("/runbook").await;
        assert!(runbook.starts_with("HTTP/1.1 200") && runbook.contains("text/html"), "{runbook}");
        assert!(runbook.contains("id=\"dedupdconflictdetected\""), "no anchor for DedupdConflictDetected");
        let _ = tx.send(());
        task.await.expect("join").expect("serve");
    }
}
