//! The simulator: dedupd workers driven through [`crate::pipeline`] against
//! the model broker, under a seeded schedule of faults, in simulated time.
//!
//! One schedule: input producers write usage events with retries,
//! conflicts and malformed records; two workers share the input in one
//! consumer group; the network drops requests and responses, the broker
//! goes down, the coordinator moves, workers crash (the process alone, or
//! with a power loss that takes unsynced writes and directory entries) and
//! restart, or pause past their session (zombies), transaction markers land
//! late, and a worker's disk fails writes or fsyncs or fills up for a while.
//! Most schedules also keep the usage ledger and publish its rollups
//! ([`Rollups`]), checked against the output at the end.
//! After the faults stop the workers must finish all input within a bounded
//! simulated time, and the checks of [`check`] hold; the model broker's own
//! invariants are checked as the schedule runs. Everything is a function of
//! the seed: a failing seed replays exactly and prints its trace.
//!
//! # Membership
//!
//! Half the schedules run dynamic members (no `--instance-id`: a new member
//! and a new transactional id per process), half static ones, as the
//! StatefulSet runs dedupd ([`Membership`]): worker `i` is `worker-i`, a
//! restarted process takes its predecessor's place in the group without a
//! rebalance when the group is settled (KIP-345; see
//! [`crate::sim::broker::group`] for where the model rebalances instead,
//! and why) and its transactional id, so its InitProducerId fences the
//! predecessor's producer and aborts its open transaction. A third of the
//! static exactly-once schedules also start, once, a second process with a
//! live worker's instance id (its own disk; never restarted), as when two
//! pods are given one `--instance-id` by mistake: the process that receives
//! FENCED_INSTANCE_ID stops for good with the real driver's message, its
//! partitions lost, and the schedule must stay clean. The processes cannot
//! fence each other back and forth: a fenced process never comes back, and
//! the duplicate is never restarted. At-least-once schedules get static
//! restarts but no duplicate: nothing fences an idempotent producer, so the
//! old process's batch in flight can land after its successor's repair and
//! be published again (issue #10's guarantee holds in exactly-once mode
//! only).
//!
//! Two divergences. A FENCED_INSTANCE_ID answer to a request sent under a
//! member id the process has since given up itself (it lost its session and
//! joined again with no member id, which replaced its own old member) is
//! ignored; librdkafka stops on any such answer. And a simulated worker
//! calls InitProducerId again after a failed publish, where `dedupd run`
//! aborts and keeps its epoch: with a shared transactional id the old
//! process can then fence the newcomer's producer, the newcomer stops (and
//! is not restarted), the old process stops at its next group request, and
//! the other worker takes every partition once the instance's session
//! expires. Harsher than the real ending, and it must keep every guarantee
//! all the same.
//!
//! What runs for real: the partition life ([`crate::pipeline::PartitionLife`])
//! and transaction endings, batch classification and record formats
//! ([`crate::kafka::batch`], [`crate::kafka::records`]), the classifier and
//! local state with its WAL/segment usage store and recovery, over the
//! faulty disk and key-store model of [`crate::sim::disk`] (see [`engine`]).
//! What is modelled: the broker ([`crate::sim::broker`]), the network, and
//! the client side of librdkafka (group membership, fetch positions, the
//! transactional and idempotent producers), written here from Kafka's
//! protocol, not librdkafka's code: its own bugs are out of reach.

pub mod check;
pub mod engine;
mod worker;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::pipeline::{DeliveryMode, Mutations};
use crate::sim::broker::log::{Record, TopicPartition};
use crate::sim::broker::{Broker, BrokerConfig, ProduceBatch};
use crate::sim::disk::{DiskCounts, DiskFaults};
use crate::sim::net::{Delivery, NetConfig, Network, Outage, OutageKind};
use crate::sim::rng::SimRng;

pub use check::Violation;
use worker::{Timer, Worker};

/// Event time of simulated millisecond 0 (the classifier's clock).
pub const EPOCH_MS: i64 = 1_790_000_000_000;
pub const INPUT: &str = "in";
pub const OUTPUT: &str = "out";
pub const CONFLICTS: &str = "conflicts";
pub const REJECTED: &str = "rejected";
/// The usage ledger's topic (issue #12), in schedules that publish rollups
/// ([`Rollups`]).
pub const ROLLUPS: &str = "rollups";
pub const ROLLUPS_PARTITIONS: i32 = 2;
pub const GROUP: &str = "dedupd";
const PARTITIONS: i32 = 2;
/// Every topic of the world, with its partition count.
const SIDE_AND_MAIN_TOPICS: [(&str, i32); 5] =
    [(INPUT, PARTITIONS), (OUTPUT, PARTITIONS), (CONFLICTS, 1), (REJECTED, 1), (ROLLUPS, ROLLUPS_PARTITIONS)];
const WORKERS: usize = 2;
/// Faults happen before this simulated time, never after.
const FAULTS_END_MS: i64 = 40_000;
/// Once faults stop, all input must be processed within this long.
const LIVENESS_MS: i64 = 150_000;
/// How often, in simulated time, the model broker's invariants are checked.
const BROKER_CHECK_EVERY_MS: i64 = 100;

/// What one schedule runs.
#[derive(Clone, Copy, Debug)]
pub struct ScheduleConfig {
    pub seed: u64,
    pub delivery: DeliveryMode,
    pub mutations: Mutations,
    pub membership: Membership,
    pub rollups: Rollups,
}

/// Whether the schedule's workers keep the usage ledger and publish its
/// changes to the rollups topic (issue #12), checked at the end against the
/// output refolded as `dedupd usage verify` refolds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollups {
    /// No ledger and no rollups topic, as the schedules ran before the
    /// ledger was modelled (the regression seeds keep their meaning).
    Off,
    /// The ledger on and every change published. At least once, held back
    /// for up to `hold_ms` while batches keep coming (`--rollups-interval`),
    /// when given; exactly once, always in the transaction of their events.
    Published { hold_ms: Option<u32> },
    /// One of the above, drawn from the seed by a generator of its own.
    Drawn,
}

impl Rollups {
    fn draw(rng: &mut SimRng, delivery: DeliveryMode) -> Rollups {
        if rng.below(3) == 0 {
            return Rollups::Off;
        }
        let held = delivery == DeliveryMode::AtLeastOnce && rng.below(3) != 0;
        Rollups::Published { hold_ms: held.then(|| 200 + rng.below(4_801) as u32) }
    }

    pub fn published(self) -> bool {
        matches!(self, Rollups::Published { .. })
    }
}

/// How the schedule's workers join the group (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Membership {
    /// No `--instance-id`: each process joins as a new member, with a
    /// transactional id of its own.
    Dynamic,
    /// Worker `i` runs with `--instance-id worker-i`.
    Static,
    /// Static, and at `at_ms` a second process starts with worker `of`'s
    /// instance id, on a disk of its own; it is never restarted. Drawn for
    /// exactly-once schedules only.
    Duplicate { of: usize, at_ms: i64 },
    /// One of the above, drawn from the seed by a generator of its own, so
    /// every other fault of a seed is what it was before membership was
    /// drawn (regression seeds keep their meaning).
    Drawn,
}

impl Membership {
    fn draw(rng: &mut SimRng, delivery: DeliveryMode) -> Membership {
        if rng.below(2) == 0 {
            return Membership::Dynamic;
        }
        if delivery == DeliveryMode::ExactlyOnce && rng.below(3) == 0 {
            let of = rng.below(WORKERS as u64) as usize;
            return Membership::Duplicate { of, at_ms: rng.range_i64(1_000, FAULTS_END_MS - 5_000) };
        }
        Membership::Static
    }

    /// `--instance-id` of worker `worker`, if static.
    fn instance_id(self, worker: usize) -> Option<String> {
        match self {
            Membership::Dynamic | Membership::Drawn => None,
            Membership::Static | Membership::Duplicate { .. } => Some(format!("worker-{worker}")),
        }
    }
}

impl std::fmt::Display for Rollups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rollups::Off => write!(f, "no rollups"),
            Rollups::Published { hold_ms: None } => write!(f, "rollups published with their batch"),
            Rollups::Published { hold_ms: Some(ms) } => write!(f, "rollups held back up to {ms} ms"),
            Rollups::Drawn => write!(f, "rollups drawn from the seed"),
        }
    }
}

impl std::fmt::Display for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Membership::Dynamic => write!(f, "dynamic members"),
            Membership::Static => write!(f, "static members"),
            Membership::Duplicate { of, at_ms } => {
                write!(f, "static members, a second process with w{of}'s instance id at {at_ms} ms")
            }
            Membership::Drawn => write!(f, "membership drawn from the seed"),
        }
    }
}

/// One input record of the schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned {
    /// A usage event: `id`, and which payload variant (a retry repeats the
    /// variant, a conflict changes it).
    Event { id: u32, variant: u32 },
    /// Not JSON: rejected.
    Malformed { n: u32 },
}

impl Planned {
    pub fn key(&self) -> Vec<u8> {
        match self {
            Planned::Event { id, .. } => format!("t/e{id}").into_bytes(),
            Planned::Malformed { n } => format!("bad{n}").into_bytes(),
        }
    }

    pub fn payload(&self) -> Vec<u8> {
        match self {
            Planned::Event { id, variant } => format!(
                r#"{{"event_id":"e{id}","tenant_id":"t","customer_id":"c{}","meter":"m","quantity":"{}","timestamp":{}}}"#,
                id % 3,
                variant + 1,
                Planned::event_ms(*id)
            )
            .into_bytes(),
            Planned::Malformed { n } => format!("not json {n}").into_bytes(),
        }
    }

    /// Event `id`'s time: one of the last three hours, or, for every fifth
    /// id, three days back. Those are late (their hour is not rewritten, an
    /// adjustment is published) when an event of the same customer and
    /// partition three days newer was folded first: it depends on the order
    /// the output holds them in. Every time has 13 digits, so payloads are
    /// as long as they were when all events had one time (the simulated
    /// disk's WAL rotations and flushes, and so the regression seeds, are
    /// unchanged).
    fn event_ms(id: u32) -> i64 {
        let back_ms = if id % 5 == 4 { 3 * 86_400_000 } else { i64::from(id / 3 % 3) * 3_600_000 };
        EPOCH_MS - 60_000 - back_ms
    }

    fn partition(&self) -> i32 {
        match self {
            Planned::Event { id, .. } => (*id as i32) % PARTITIONS,
            Planned::Malformed { n } => (*n as i32) % PARTITIONS,
        }
    }
}

/// The faults of one schedule, drawn from its seed.
#[derive(Clone, Debug)]
pub struct Faults {
    pub net: NetConfig,
    pub outages: Vec<Outage>,
    /// (worker, at, down for)
    pub crashes: Vec<(usize, i64, i64)>,
    /// (worker, at, paused for): no heartbeats, no progress; a pause past
    /// the session timeout makes the worker a zombie when it resumes.
    pub pauses: Vec<(usize, i64, i64)>,
    pub marker_delay_ms: i64,
    /// 1: the usage store runs with `--fsync always`; otherwise its WAL is
    /// synced only when a file is sealed, flushed or closed.
    pub sync_every: u32,
    pub batch_records: usize,
    /// (worker, from, until, faults): a disk failing for a while. A full
    /// disk is `capacity_bytes` of headroom over what it holds at `from`.
    pub disk: Vec<(usize, i64, i64, DiskFaults)>,
    /// The schedule's membership, never [`Membership::Drawn`].
    pub membership: Membership,
    /// Whether rollups are published, never [`Rollups::Drawn`].
    pub rollups: Rollups,
}

impl Faults {
    /// Disk faults come from their own generator, so adding them left every
    /// other fault of a seed as it was (regression seeds keep their meaning).
    fn draw_disk(&mut self, rng: &mut SimRng) {
        if rng.below(3) != 0 {
            return;
        }
        let worker = rng.below(WORKERS as u64) as usize;
        let from = rng.range_i64(500, FAULTS_END_MS - 6_000);
        let until = from + rng.range_i64(500, 6_000);
        let faults = match rng.below(3) {
            0 => DiskFaults { write_error_per_million: 50_000 + rng.below(500_000) as u32, ..DiskFaults::default() },
            1 => DiskFaults { fsync_error_per_million: 50_000 + rng.below(500_000) as u32, ..DiskFaults::default() },
            _ => DiskFaults { capacity_bytes: Some(rng.below(2_048)), ..DiskFaults::default() },
        };
        self.disk.push((worker, from, until, faults));
    }

    fn draw(rng: &mut SimRng, delivery: DeliveryMode) -> Faults {
        let lossy = rng.below(3) > 0;
        let net = NetConfig {
            min_latency_ms: 1,
            max_latency_ms: 1 + rng.range_i64(0, 20),
            request_timeout_ms: 2_000,
            drop_request_per_million: if lossy { rng.below(30_000) as u32 } else { 0 },
            drop_response_per_million: if lossy { rng.below(30_000) as u32 } else { 0 },
        };
        let mut outages = Vec::new();
        for _ in 0..rng.below(3) {
            let from_ms = rng.range_i64(0, FAULTS_END_MS - 5_000);
            // At-least-once cannot fence a member that outlives its session
            // while still publishing (no transactions): keep its outages
            // shorter than the session timeout. Exactly-once gets the long ones.
            let longest = if delivery == DeliveryMode::ExactlyOnce { 9_000 } else { 3_000 };
            let kind = if rng.below(3) == 0 { OutageKind::CoordinatorMoving } else { OutageKind::BrokerDown };
            outages.push(Outage { from_ms, until_ms: from_ms + rng.range_i64(200, longest), kind });
        }
        let mut crashes = Vec::new();
        for _ in 0..rng.below(4) {
            crashes.push((
                rng.below(WORKERS as u64) as usize,
                rng.range_i64(500, FAULTS_END_MS),
                rng.range_i64(100, 3_000),
            ));
        }
        let mut pauses = Vec::new();
        if delivery == DeliveryMode::ExactlyOnce && rng.below(2) == 0 {
            pauses.push((
                rng.below(WORKERS as u64) as usize,
                rng.range_i64(1_000, FAULTS_END_MS - 12_000),
                rng.range_i64(4_000, 12_000),
            ));
        }
        Faults {
            net,
            outages,
            crashes,
            pauses,
            marker_delay_ms: match rng.below(3) {
                0 => 0,
                1 => rng.range_i64(1, 50),
                _ => rng.range_i64(500, 3_000),
            },
            sync_every: if rng.below(2) == 0 { 1 } else { 1 + rng.below(4) as u32 },
            batch_records: 1 + rng.below(6) as usize,
            disk: Vec::new(),
            membership: Membership::Dynamic,
            rollups: Rollups::Off,
        }
    }
}

/// What a schedule did, for the test's summary.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub input_records: usize,
    pub output_records: usize,
    pub crashes: usize,
    pub lost_assignments: usize,
    pub aborted_transactions: usize,
    pub finished_ms: i64,
    /// What the workers' disks did, summed.
    pub disk: DiskCounts,
    /// The workers ran with `--instance-id`.
    pub static_members: bool,
    /// 1 when a second process with a worker's instance id started.
    pub duplicates: usize,
    /// 1 when that process joined or took partitions while the worker whose
    /// instance id it shares was alive and still held partitions.
    pub duplicate_overlaps: usize,
    /// Processes stopped for good by FENCED_INSTANCE_ID.
    pub fenced_exits: usize,
    /// Times the schedule moved a usage store flush or compaction on after
    /// an apply (wrote it, installed it, or both): a job written by one
    /// apply and installed by a later one counts twice.
    pub store_job_steps: usize,
    /// Processes that ended (a crash, a stop on an error, a fenced exit)
    /// with one of them started and not installed: it is lost with them.
    pub ends_with_a_store_job_out: usize,
    /// Of those, the ones whose job had written its segment and not
    /// installed it: recovery finds a segment no manifest names.
    pub ends_with_a_segment_not_installed: usize,
    /// Rollups published: the counter-hours and the late events' adjustments
    /// the final check compared with the output.
    pub rollup_hours: usize,
    pub adjustments: usize,
    /// At least once: publishes sent by a member for an input partition the
    /// group had already given to another (a zombie; nothing fences it).
    pub zombie_publishes: usize,
    /// At least once: what went wrong only because of such a publish (an
    /// event published twice, one copy placed by the zombie; the rollups
    /// that disagree with the output only by the zombie's copies); the
    /// schedule passes with these recorded. Never in exactly-once
    /// schedules.
    pub excused: Vec<Violation>,
}

/// A schedule that failed: the seed, what broke, and the trace.
#[derive(Debug)]
pub struct Failure {
    pub config: ScheduleConfig,
    /// The membership the schedule ran (drawn, when the config says so).
    pub membership: Membership,
    /// Whether it published rollups (drawn, when the config says so).
    pub rollups: Rollups,
    pub violations: Vec<Violation>,
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "schedule failed: seed {} ({}, {}, {}), reproduce with SIM_SEED={} SIM_SCHEDULES=1",
            self.config.seed, self.config.delivery, self.membership, self.rollups, self.config.seed
        )?;
        for v in &self.violations {
            writeln!(f, "  violation: {v}")?;
        }
        // The whole trace with SIM_FULL_TRACE=1, else its end.
        let shown = if std::env::var_os("SIM_FULL_TRACE").is_some() { self.trace.len() } else { 200 };
        writeln!(f, "trace ({} lines, last {}):", self.trace.len(), shown.min(self.trace.len()))?;
        for line in self.trace.iter().rev().take(shown).rev() {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// The simulated world of one schedule.
pub struct World {
    pub config: ScheduleConfig,
    pub faults: Faults,
    pub(crate) now_ms: i64,
    pub(crate) net: Network,
    pub(crate) timers: BTreeMap<(i64, u64), Timer>,
    timer_seq: u64,
    pub(crate) workers: Vec<Worker>,
    /// Input records in the order they are produced, with their times.
    pub plan: Vec<(i64, Planned)>,
    /// Where each produced input record landed: (partition, offset) → plan.
    pub produced: BTreeMap<(i32, i64), Planned>,
    pub(crate) trace: Vec<String>,
    pub(crate) violations: Vec<Violation>,
    pub(crate) report: Report,
    next_request_owner: BTreeMap<u64, (usize, u32)>,
    /// Disk-side randomness (what a crash takes), apart from the rest.
    pub(crate) disk_rng: SimRng,
    /// When the usage store's flushes and compactions are written, apart
    /// from the rest.
    pub(crate) jobs_rng: SimRng,
    /// At least once: the output positions of records a zombie published
    /// (see [`Report::zombie_publishes`]).
    pub(crate) zombie_output: std::collections::BTreeSet<(i32, i64)>,
    /// Of those, the copies of events published twice that an excused
    /// schedule's checks leave out.
    excused_copies: std::collections::BTreeSet<(i32, i64)>,
    next_broker_check_ms: i64,
}

impl World {
    pub fn new(config: ScheduleConfig) -> World {
        let mut rng = SimRng::new(config.seed);
        let mut faults = Faults::draw(&mut rng, config.delivery);
        let mut disk_rng = SimRng::new(config.seed ^ 0xD15C_5EED_0000_0000);
        faults.draw_disk(&mut disk_rng);
        // Membership and the duplicate's disk come from a generator of their
        // own, so drawing them changes no other fault of the seed.
        let mut membership_rng = SimRng::new(config.seed ^ 0x57A7_1C1D_0000_0000);
        faults.membership = match config.membership {
            Membership::Drawn => Membership::draw(&mut membership_rng, config.delivery),
            chosen => chosen,
        };
        // So is whether rollups are published.
        faults.rollups = match config.rollups {
            Rollups::Drawn => Rollups::draw(&mut SimRng::new(config.seed ^ 0x1ED6_E500_0000_0000), config.delivery),
            chosen => chosen,
        };
        let broker_config = BrokerConfig { marker_delay_ms: faults.marker_delay_ms, ..BrokerConfig::default() };
        let mut broker = Broker::new(broker_config);
        for (topic, n) in SIDE_AND_MAIN_TOPICS {
            broker.create_topic(topic, n).expect("topic");
        }
        let mut net = Network::new(broker, faults.net.clone(), rng.next_u64());
        for o in &faults.outages {
            net.add_outage(*o);
        }
        let plan = plan_input(&mut rng);
        let mut world = World {
            config,
            faults,
            now_ms: 0,
            net,
            timers: BTreeMap::new(),
            timer_seq: 0,
            workers: Vec::new(),
            plan,
            produced: BTreeMap::new(),
            trace: Vec::new(),
            violations: Vec::new(),
            report: Report::default(),
            next_request_owner: BTreeMap::new(),
            disk_rng,
            jobs_rng: SimRng::new(config.seed ^ 0x0B5E_55ED_0000_0000),
            zombie_output: std::collections::BTreeSet::new(),
            excused_copies: std::collections::BTreeSet::new(),
            next_broker_check_ms: 0,
        };
        let membership = world.faults.membership;
        let always = world.faults.sync_every == 1;
        let ledger = world.faults.rollups.published();
        for i in 0..WORKERS {
            let state = engine::SimState::new(i, &mut world.disk_rng, always, ledger, world.config.mutations);
            world.workers.push(Worker::new(i, &world.faults, state, membership.instance_id(i), None));
            world.at(0, Timer::Start { worker: i });
        }
        world.report.static_members = membership.instance_id(0).is_some();
        if let Membership::Duplicate { of, at_ms } = membership {
            let i = world.workers.len();
            let state = engine::SimState::new(i, &mut membership_rng, always, ledger, world.config.mutations);
            world.workers.push(Worker::new(i, &world.faults, state, membership.instance_id(of), Some(of)));
            world.at(at_ms, Timer::Start { worker: i });
            world.report.duplicates = 1;
        }
        for &(worker, from, until, faults) in &world.faults.disk.clone() {
            world.at(from, Timer::Disk { worker, faults });
            world.at(until, Timer::Disk { worker, faults: DiskFaults::default() });
        }
        for (i, (at, _)) in world.plan.iter().enumerate() {
            world.timers.insert((*at, u64::MAX - i as u64), Timer::Produce { index: i });
        }
        for &(worker, at, down) in &world.faults.crashes.clone() {
            world.at(at, Timer::Crash { worker, down_ms: down });
        }
        for &(worker, at, len) in &world.faults.pauses.clone() {
            world.at(at, Timer::Pause { worker, until_ms: at + len });
        }
        world.at(FAULTS_END_MS, Timer::CheckDone);
        world
    }

    pub(crate) fn at(&mut self, at_ms: i64, timer: Timer) {
        self.timer_seq += 1;
        self.timers.insert((at_ms.max(self.now_ms), self.timer_seq), timer);
    }

    pub(crate) fn log(&mut self, line: String) {
        self.trace.push(format!("{:>7} {line}", self.now_ms));
    }

    /// Runs the schedule to its end and checks it.
    pub fn run(self) -> Result<Report, Box<Failure>> {
        self.run_with_trace().map(|(report, _)| report)
    }

    /// As [`World::run`], and the trace of a schedule that passed.
    pub fn run_with_trace(mut self) -> Result<(Report, Vec<String>), Box<Failure>> {
        let deadline = FAULTS_END_MS + LIVENESS_MS;
        let mut done = false;
        while !done {
            let next_timer = self.timers.keys().next().map(|(t, _)| *t);
            let next_net = self.net.next_event_ms();
            let Some(next) = [next_timer, next_net].into_iter().flatten().min() else { break };
            if next > deadline {
                break;
            }
            self.now_ms = next.max(self.now_ms);
            for d in self.net.poll(self.now_ms) {
                self.deliver(d);
            }
            while let Some(entry) = self.timers.first_entry() {
                if entry.key().0 > self.now_ms {
                    break;
                }
                let timer = entry.remove();
                if let Timer::CheckDone = timer {
                    // Faults stop here, slow transaction markers with them:
                    // a coordinator that takes seconds per commit for ever
                    // is a broken cluster, not a liveness test of dedupd.
                    self.net.broker_mut().set_marker_delay_ms(0);
                    if self.all_input_processed() {
                        done = true;
                        break;
                    }
                    self.at(self.now_ms + 1_000, Timer::CheckDone);
                    continue;
                }
                self.fire(timer);
            }
            // Every step would cost a quarter more time per schedule (the
            // log checks walk every entry); a tenth of a simulated second
            // still sees any state that outlives a round trip.
            if self.now_ms >= self.next_broker_check_ms {
                self.next_broker_check_ms = self.now_ms + BROKER_CHECK_EVERY_MS;
                self.check_broker();
            }
            if !self.violations.is_empty() {
                break;
            }
        }
        if self.violations.is_empty() {
            self.check_broker();
        }
        if !done && self.violations.is_empty() {
            let detail = self.progress_summary();
            self.violations.push(Violation::Stalled { deadline_ms: deadline, detail });
        }
        self.report.finished_ms = self.now_ms;
        for w in &self.workers {
            self.report.disk += w.state.disk.counts();
        }
        if self.violations.is_empty() {
            self.violations = check::final_checks(&self);
            self.excuse_zombie_publishes();
        }
        if self.violations.is_empty() {
            self.violations = self.reopen_every_state();
        }
        if self.violations.is_empty() {
            let mut report = self.report.clone();
            if self.faults.rollups.published() {
                if let Ok(compared) = check::rollups_topic(&self, &self.excused_copies) {
                    report.rollup_hours = compared.hours;
                    report.adjustments = compared.adjustments;
                }
            }
            report.input_records = self.produced.len();
            report.output_records = check::output_records(&self.net, OUTPUT).len();
            Ok((report, self.trace))
        } else {
            let (membership, rollups) = (self.faults.membership, self.faults.rollups);
            Err(Box::new(Failure {
                config: self.config,
                membership,
                rollups,
                violations: self.violations,
                trace: self.trace,
            }))
        }
    }

    /// At least once, a zombie's publish (see [`Report::zombie_publishes`])
    /// can put an event on the output twice, and the rollups then disagree
    /// with the output about it: the limitation of at-least-once that the
    /// README states. A schedule is recorded, not failed, when every one of
    /// its violations is explained by the output records zombies placed:
    /// each event published twice has at most one copy that no zombie
    /// placed, and the rollups topic is the output refolded without the
    /// zombies' copies. The run's test bounds how many there are. Any other
    /// violation fails it as before.
    fn excuse_zombie_publishes(&mut self) {
        if self.config.delivery != DeliveryMode::AtLeastOnce || self.zombie_output.is_empty() {
            return;
        }
        let zombies = &self.zombie_output;
        // The zombies' copies of events published twice.
        let copies: std::collections::BTreeSet<(i32, i64)> = self
            .violations
            .iter()
            .flat_map(|v| match v {
                Violation::BilledTwice { offsets, .. } => offsets.as_slice(),
                _ => &[],
            })
            .filter(|o| zombies.contains(o))
            .copied()
            .collect();
        let explained = |v: &Violation| match v {
            Violation::BilledTwice { offsets, .. } => offsets.iter().filter(|o| !copies.contains(o)).count() == 1,
            Violation::RollupsDiffer { .. } => check::rollups_topic(self, &copies).is_ok(),
            _ => false,
        };
        if self.violations.iter().all(explained) {
            self.report.excused = std::mem::take(&mut self.violations);
            self.excused_copies = copies;
        }
    }

    /// The model broker's own invariants (one owner per partition among
    /// synced members, logs, transactions), as a violation with the seed
    /// and trace rather than a bare panic.
    fn check_broker(&mut self) {
        let broker = self.net.broker();
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| broker.check_invariants()));
        if let Err(panic) = checked {
            let detail = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            self.violations.push(Violation::BrokerInvariant { detail });
        }
    }

    /// After the schedule: every worker's process stops, its disk loses
    /// power, and its local state must open again on the healthy disk. A
    /// worker whose recovery fails would otherwise go unnoticed whenever
    /// the other worker finished its partitions.
    fn reopen_every_state(&mut self) -> Vec<Violation> {
        let mut v = Vec::new();
        for (i, w) in self.workers.iter_mut().enumerate() {
            w.stop_process();
            w.state.set_faults(DiskFaults::default());
            w.state.power_loss();
            if let Err(detail) = w.state.open() {
                v.push(Violation::StateUnreadable { worker: i, detail });
            }
        }
        v
    }

    fn produce_input(&mut self, index: usize) {
        let planned = self.plan[index].1.clone();
        let p = planned.partition();
        let record = Record {
            key: Some(planned.key()),
            value: Some(planned.payload()),
            headers: Vec::new(),
            timestamp_ms: EPOCH_MS + self.now_ms,
        };
        let batch = ProduceBatch {
            producer_id: -1,
            producer_epoch: -1,
            base_sequence: -1,
            transactional: false,
            records: vec![record],
        };
        let now = self.now_ms;
        let appended =
            self.net.broker_mut().produce(now, &TopicPartition::new(INPUT, p), batch).expect("input produce");
        self.produced.insert((p, appended.base_offset), planned);
    }

    fn all_input_processed(&mut self) -> bool {
        if self.produced.len() < self.plan.len() {
            return false;
        }
        let now = self.now_ms;
        let parts: Vec<TopicPartition> = (0..PARTITIONS).map(|p| TopicPartition::new(INPUT, p)).collect();
        let committed = self.net.broker_mut().offset_fetch(now, GROUP, &parts, true);
        let consumed = committed.iter().all(|(tp, c)| {
            let end = self.net.broker().partition(tp).map_or(0, |l| l.high_watermark());
            matches!(c, Ok(Some(o)) if *o >= end)
        });
        // And readable: a crashed process's transaction stays open until its
        // timeout and holds the last stable offset of every partition it
        // wrote to, so records committed after it are not yet visible to
        // read_committed readers (billing's view) until it ends.
        let settled = SIDE_AND_MAIN_TOPICS[1..].iter().all(|&(topic, n)| {
            (0..n).all(|p| {
                self.net
                    .broker()
                    .partition(&TopicPartition::new(topic, p))
                    .is_none_or(|l| l.last_stable_offset() == l.high_watermark())
            })
        });
        consumed && settled
    }

    fn progress_summary(&mut self) -> String {
        let now = self.now_ms;
        let parts: Vec<TopicPartition> = (0..PARTITIONS).map(|p| TopicPartition::new(INPUT, p)).collect();
        let committed = self.net.broker_mut().offset_fetch(now, GROUP, &parts, false);
        let ends: Vec<i64> =
            parts.iter().map(|tp| self.net.broker().partition(tp).map_or(0, |l| l.high_watermark())).collect();
        let workers: Vec<String> = self.workers.iter().map(|w| w.describe()).collect();
        format!("committed {committed:?}, input ends {ends:?}; workers: {}", workers.join(" | "))
    }

    /// Registers the owner of a request sent for `worker`'s current life.
    pub(crate) fn own(&mut self, request: u64, worker: usize) {
        let incarnation = self.workers[worker].incarnation;
        self.next_request_owner.insert(request, (worker, incarnation));
    }

    fn deliver(&mut self, d: Delivery) {
        let Some((worker, incarnation)) = self.next_request_owner.remove(&d.request_id) else { return };
        if self.workers[worker].incarnation != incarnation {
            return; // the process that sent it is gone
        }
        if self.workers[worker].paused_until > self.now_ms {
            self.workers[worker].deferred.push(d);
            return;
        }
        worker::on_delivery(self, worker, d);
    }

    fn fire(&mut self, timer: Timer) {
        match timer {
            Timer::Produce { index } => self.produce_input(index),
            Timer::CheckDone => {}
            other => worker::on_timer(self, other),
        }
    }
}

/// The input of one schedule: events with retries and conflicts, and some
/// malformed records, spread over the fault window.
fn plan_input(rng: &mut SimRng) -> Vec<(i64, Planned)> {
    let mut plan = Vec::new();
    let ids = 8 + rng.below(16) as u32;
    for id in 0..ids {
        let first = rng.range_i64(0, FAULTS_END_MS);
        plan.push((first, Planned::Event { id, variant: 0 }));
        for _ in 0..rng.below(3) {
            plan.push((rng.range_i64(first, FAULTS_END_MS + 5_000), Planned::Event { id, variant: 0 }));
        }
        if rng.below(4) == 0 {
            plan.push((rng.range_i64(first, FAULTS_END_MS + 5_000), Planned::Event { id, variant: 1 }));
        }
    }
    for n in 0..rng.below(3) as u32 {
        plan.push((rng.range_i64(0, FAULTS_END_MS), Planned::Malformed { n }));
    }
    plan.sort_by_key(|(t, _)| *t);
    plan
}
