//! One simulated dedupd process: group membership, partition lives driven
//! through the core, and the transactional (or idempotent) producer, as
//! request/response state machines over the model network.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::EngineSettings;
use crate::event::Position;
use crate::kafka::batch::{classify_batch, BatchInput, BatchLayout, DeferredRollups, Prepared};
use crate::kafka::engine::{Engine, StateEngine};
use crate::kafka::records::{parse_output, Destination, OutRecord};
use crate::pipeline::{
    BatchFailure, DeliveryMode, EndAttempt, EndDecision, Ending, Event, LifeSettings, PartitionLife, Step,
    TransactionEnding,
};
use crate::sim::broker::api::{Request, Response};
use crate::sim::broker::group::{GroupMetadata, JoinGroupRequest, JoinOutcome};
use crate::sim::broker::log::{read_committed_records, Isolation, Record, TopicPartition};
use crate::sim::broker::{OffsetSpec, ProduceBatch, ProducerIdAndEpoch};
use crate::sim::disk::DiskFaults;
use crate::sim::error::ErrorCode;
use crate::sim::net::{Delivery, Outcome};
use crate::sim::world::check::{self, Violation};
use crate::sim::world::engine::{held_by_state, SimState};
use crate::sim::world::{
    Faults, Rollups, World, CONFLICTS, EPOCH_MS, GROUP, INPUT, OUTPUT, REJECTED, ROLLUPS, ROLLUPS_PARTITIONS,
};

const SESSION_MS: i64 = 6_000;
const HEARTBEAT_MS: i64 = 500;
const TXN_TIMEOUT_MS: i64 = 10_000;
const IDLE_MS: i64 = 200;
const RETRY_MS: i64 = 100;

/// Scheduled happenings.
#[derive(Clone, Debug)]
pub enum Timer {
    Produce {
        index: usize,
    },
    CheckDone,
    Start {
        worker: usize,
    },
    Crash {
        worker: usize,
        down_ms: i64,
    },
    Pause {
        worker: usize,
        until_ms: i64,
    },
    /// The worker's disk starts or stops failing.
    Disk {
        worker: usize,
        faults: DiskFaults,
    },
    Resume {
        worker: usize,
    },
    Heartbeat {
        worker: usize,
        incarnation: u32,
    },
    Rejoin {
        worker: usize,
        incarnation: u32,
    },
    InitProducer {
        worker: usize,
        incarnation: u32,
    },
    ProducerStep {
        worker: usize,
        incarnation: u32,
    },
    /// A partition life's timed step (a wait, an idle poll, a retry).
    Slot {
        worker: usize,
        incarnation: u32,
        partition: i32,
        generation: u64,
        event: Option<Event>,
    },
}

/// What a request was for. Group requests keep the member id they were
/// sent under, to tell a FENCED_INSTANCE_ID about this process's current
/// membership from one about a membership it gave up itself.
#[derive(Clone, Debug)]
enum Purpose {
    Join { sent_as: String },
    Sync { sent_as: String },
    Heartbeat { sent_as: String },
    Commit { partition: i32, next: i64, sent_as: String },
    Slot { partition: i32, generation: u64, what: SlotRequest },
    Producer { generation: u64, what: ProducerRequest },
}

#[derive(Clone, Debug)]
enum SlotRequest {
    OutputEnd,
    StableStart,
    StableEnd { log_start: i64 },
    Horizon { log_start: i64, end: i64 },
    ReadOutput { from: i64, end: i64 },
    Position,
    Fetch,
}

#[derive(Clone, Debug)]
enum ProducerRequest {
    Init,
    AddPartitions,
    Produce { tp: TopicPartition, indexes: Vec<usize> },
    AddOffsets,
    TxnOffsetCommit { sent_as: String },
    EndTxn,
}

/// One assigned partition.
struct Slot {
    life: PartitionLife,
    step: Step,
    generation: u64,
    position: Option<i64>,
    batch: Vec<(i64, Record)>,
    prepared: Option<Prepared>,
    published: Option<Vec<(i32, i64)>>,
    /// Rollups of applied batches held back (at least once with a hold), as
    /// `kafka::partition`'s driver keeps them: lost with the process or the
    /// partition, whose input offsets then were not committed.
    deferred: DeferredRollups,
    /// What the publish in flight does to `deferred` once it succeeds.
    rollups_after: RollupsAfter,
    /// The end of the assignment repair's read, for the state check.
    repair_end: Option<i64>,
    assignment_checked: bool,
}

/// What a publish that succeeds does to a slot's held rollups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RollupsAfter {
    /// It carried them all: forget them.
    Clear,
    /// It carried none: hold the batch's too.
    Hold,
}

/// A publish handed to the producer.
struct Job {
    partition: i32,
    generation: u64,
    records: Vec<OutRecord>,
    offsets: Option<i64>,
}

/// The transaction (or idempotent publish) in progress.
struct Run {
    job: Job,
    /// Records grouped by destination partition, in order.
    groups: Vec<(TopicPartition, Vec<usize>)>,
    next_group: usize,
    positions: Vec<(i32, i64)>,
    ending: Option<TransactionEnding>,
    /// The transactional request the next [`Timer::ProducerStep`] sends
    /// again (see [`TxnStep`]).
    repeat: Option<TxnStep>,
    /// Until when a transactional request is sent again rather than failing
    /// the run, and how many times it has been: set by the run's first
    /// retried answer, [`RETRY_FOR_MS`] later, as librdkafka gives up on its
    /// own retries at the call's timeout.
    retry_until_ms: Option<i64>,
    /// At least once: a publish of the run was sent by a zombie (see
    /// `note_zombie_publish`); the output records it places are recorded.
    zombie: bool,
    retries: u32,
}

/// A request of a transaction that the client sends again by itself.
/// librdkafka (`rdkafka_txnmgr.c`) retries AddPartitionsToTxn,
/// AddOffsetsToTxn and TxnOffsetCommit answered CONCURRENT_TRANSACTIONS
/// (the coordinator is still writing the previous transaction's markers)
/// or not answered in time, without surfacing either; the application only
/// waits longer. EndTxn is repeated by dedupd's own code (see
/// [`TransactionEnding`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxnStep {
    AddPartitions,
    AddOffsets,
    TxnOffsetCommit,
    EndTxn,
}

/// How long a run's transactional requests are retried: half the
/// transaction timeout, so an outage longer than that still fails the run
/// (and aborts) before the coordinator would time the transaction out.
const RETRY_FOR_MS: i64 = TXN_TIMEOUT_MS / 2;

/// librdkafka's pause before its `retries`-th retry of `step` after
/// `error`: 20 ms for AddPartitionsToTxn answered CONCURRENT_TRANSACTIONS
/// (the markers take milliseconds), otherwise `retry.backoff.ms` (100)
/// doubling up to `retry.backoff.max.ms` (1,000).
fn retry_pause_ms(step: TxnStep, error: ErrorCode, retries: u32) -> i64 {
    if step == TxnStep::AddPartitions && error == ErrorCode::ConcurrentTransactions {
        return 20;
    }
    (RETRY_MS << retries.min(4)).min(1_000)
}

#[derive(Default)]
struct Producer {
    generation: u64,
    pid: Option<ProducerIdAndEpoch>,
    seqs: BTreeMap<TopicPartition, i32>,
    queue: VecDeque<Job>,
    run: Option<Run>,
}

#[derive(Default)]
struct Member {
    id: String,
    generation: i32,
    joining: bool,
    stable: bool,
    /// Partitions the last SyncGroup assigned.
    assigned: BTreeSet<i32>,
    /// Partitions the last JoinGroup said this member owned.
    owned_at_join: BTreeSet<i32>,
    /// When the coordinator last confirmed the membership (sync or
    /// heartbeat answered): librdkafka's own session timer starts there.
    last_confirmed_ms: i64,
}

/// One dedupd process (and its disk, which outlives it).
pub struct Worker {
    pub index: usize,
    pub incarnation: u32,
    pub alive: bool,
    /// `--instance-id` (static membership), or none (dynamic).
    pub instance_id: Option<String>,
    /// A second process started with worker `duplicate_of`'s instance id.
    /// Nothing restarts it: the operator who started it by mistake is not
    /// modelled as doing so twice.
    pub duplicate_of: Option<usize>,
    /// Stopped for good: fenced by another process with its instance id (the
    /// real driver exits non-zero, and restarting it would only fence the
    /// other one in turn), or a duplicate that stopped.
    pub exited: bool,
    pub paused_until: i64,
    pub deferred: Vec<Delivery>,
    deferred_timers: Vec<Timer>,
    /// The disk and key store, which outlive the process.
    pub(crate) state: SimState,
    engine: Option<StateEngine>,
    batch_records: usize,
    member: Member,
    producer: Producer,
    slots: BTreeMap<i32, Slot>,
    next_generation: u64,
    /// Input offsets the broker confirmed committed (at-least-once).
    committed: BTreeMap<i32, i64>,
    /// Requests in flight and what they are for.
    pending: BTreeMap<u64, Purpose>,
    /// Why the last start failed (local state did not open), for a stall's report.
    start_error: Option<String>,
}

impl Worker {
    pub fn new(
        index: usize,
        faults: &Faults,
        state: SimState,
        instance_id: Option<String>,
        duplicate_of: Option<usize>,
    ) -> Worker {
        Worker {
            index,
            incarnation: 0,
            alive: false,
            instance_id,
            duplicate_of,
            exited: false,
            paused_until: i64::MIN,
            deferred: Vec::new(),
            deferred_timers: Vec::new(),
            state,
            engine: None,
            batch_records: faults.batch_records,
            member: Member::default(),
            producer: Producer::default(),
            slots: BTreeMap::new(),
            next_generation: 0,
            committed: BTreeMap::new(),
            pending: BTreeMap::new(),
            start_error: None,
        }
    }

    pub fn describe(&self) -> String {
        let slots: Vec<String> = self.slots.iter().map(|(p, s)| format!("p{p}:{:?}", s.step)).collect();
        format!(
            "w{}{} alive={}{}{} member={}@{} stable={} slots=[{}] producer pid={:?} queue={} run={}",
            self.index,
            self.instance_id.as_ref().map(|i| format!(" ({i})")).unwrap_or_default(),
            self.alive,
            if self.exited { " exited" } else { "" },
            self.start_error.as_ref().map(|e| format!(" ({e})")).unwrap_or_default(),
            self.member.id,
            self.member.generation,
            self.member.stable,
            slots.join(", "),
            self.producer.pid,
            self.producer.queue.len(),
            self.producer.run.is_some()
        )
    }

    fn client(&self) -> u32 {
        (self.index as u32) * 10_000 + self.incarnation
    }

    /// Drops the process's local state without closing it (a crash).
    pub(crate) fn stop_process(&mut self) {
        drop(self.engine.take());
        self.alive = false;
    }

    fn engine(&mut self) -> &mut StateEngine {
        self.engine.as_mut().expect("a live worker has an engine")
    }

    /// As `RunSettings::transactional_id`. A dynamic member's is unique per
    /// process, so fencing rests on the group generation (KIP-447) and a
    /// dead process's open transaction stays open until its timeout. A
    /// static member's is its instance's: the next process's InitProducerId
    /// fences the previous one's producer and aborts its open transaction,
    /// which is what keeps a replaced process (whose group generation its
    /// successor shares) from committing a batch.
    fn transactional_id(&self) -> String {
        match &self.instance_id {
            Some(instance) => format!("dedupd-{GROUP}-{instance}"),
            None => format!("dedupd-{GROUP}-{:016x}", self.client()),
        }
    }

    fn metadata(&self) -> GroupMetadata {
        GroupMetadata {
            member_id: self.member.id.clone(),
            group_instance_id: self.instance_id.clone(),
            generation: self.member.generation,
        }
    }
}

fn send(w: &mut World, worker: usize, request: Request, purpose: Purpose) {
    let client = w.workers[worker].client();
    let id = w.net.send(w.now_ms, client, request);
    w.own(id, worker);
    w.workers[worker].pending.insert(id, purpose);
}

impl Worker {
    fn reset_process(&mut self) {
        self.member = Member::default();
        self.member.generation = -1;
        self.producer = Producer { generation: self.producer.generation + 1, ..Producer::default() };
        self.slots.clear();
        self.engine = None;
        self.committed.clear();
        self.pending.clear();
        self.deferred.clear();
        self.deferred_timers.clear();
    }
}

pub(crate) fn on_timer(w: &mut World, timer: Timer) {
    match timer {
        Timer::Start { worker } => start(w, worker),
        Timer::Crash { worker, down_ms } => {
            if !w.workers[worker].alive {
                return;
            }
            if w.disk_rng.below(2) == 0 {
                crash(w, worker, "crash (SIGKILL)");
            } else {
                crash(w, worker, "crash (power loss)");
                w.workers[worker].state.power_loss();
            }
            w.at(w.now_ms + down_ms, Timer::Start { worker });
        }
        Timer::Pause { worker, until_ms } => {
            if w.workers[worker].alive {
                w.log(format!("w{worker} paused until {until_ms}"));
                w.workers[worker].paused_until = until_ms;
                w.at(until_ms, Timer::Resume { worker });
            }
        }
        Timer::Disk { worker, mut faults } => {
            let disk = &w.workers[worker].state;
            if let Some(headroom) = faults.capacity_bytes {
                faults.capacity_bytes = Some(disk.disk.used_bytes() + headroom);
            }
            disk.set_faults(faults);
            w.log(format!("w{worker} disk faults {faults:?}"));
        }
        Timer::Resume { worker } => {
            w.log(format!("w{worker} resumes"));
            let deferred = std::mem::take(&mut w.workers[worker].deferred);
            let timers = std::mem::take(&mut w.workers[worker].deferred_timers);
            for d in deferred {
                on_delivery(w, worker, d);
            }
            for t in timers {
                on_timer(w, t);
            }
        }
        Timer::Heartbeat { worker, incarnation }
        | Timer::Rejoin { worker, incarnation }
        | Timer::InitProducer { worker, incarnation }
        | Timer::ProducerStep { worker, incarnation }
        | Timer::Slot { worker, incarnation, .. } => {
            let wk = &mut w.workers[worker];
            if wk.incarnation != incarnation || !wk.alive {
                return;
            }
            if wk.paused_until > w.now_ms {
                wk.deferred_timers.push(timer);
                return;
            }
            match timer {
                Timer::Heartbeat { .. } => heartbeat(w, worker),
                Timer::Rejoin { .. } => join(w, worker),
                Timer::InitProducer { .. } => init_producer(w, worker),
                Timer::ProducerStep { .. } => producer_timer(w, worker),
                Timer::Slot { partition, generation, event, .. } => {
                    let current = w.workers[worker].slots.get(&partition).map(|s| s.generation);
                    if current != Some(generation) {
                        return;
                    }
                    match event {
                        Some(e) => advance(w, worker, partition, e),
                        None => perform(w, worker, partition),
                    }
                }
                _ => {}
            }
        }
        Timer::Produce { .. } | Timer::CheckDone => {}
    }
}

fn start(w: &mut World, worker: usize) {
    let wk = &mut w.workers[worker];
    if wk.alive || wk.exited {
        return;
    }
    wk.incarnation += 1;
    wk.reset_process();
    wk.alive = true;
    wk.paused_until = i64::MIN;
    match wk.state.open() {
        Ok(engine) => wk.engine = Some(engine),
        Err(e) => {
            wk.alive = false;
            w.log(format!("w{worker} does not start: {e}"));
            w.workers[worker].start_error = Some(e);
            // As a pod whose process exits at start: restarted shortly.
            restart_later(w, worker);
            return;
        }
    }
    w.workers[worker].start_error = None;
    let wk = &w.workers[worker];
    let role = match (wk.duplicate_of, &wk.instance_id) {
        (Some(of), Some(instance)) => format!(", a second process with w{of}'s --instance-id {instance}"),
        (_, Some(instance)) => format!(", --instance-id {instance}"),
        (_, None) => String::new(),
    };
    w.log(format!("w{worker} starts (incarnation {}{role})", wk.incarnation));
    init_producer(w, worker);
    join(w, worker);
}

/// The process dies: memory gone; its disk keeps what the page cache
/// holds (a power loss is the caller's to add).
pub(crate) fn crash(w: &mut World, worker: usize, why: &str) {
    w.report.crashes += 1;
    end_process(w, worker);
    w.log(format!("w{worker} {why}"));
}

fn end_process(w: &mut World, worker: usize) {
    if let Some(state) = w.workers[worker].engine.as_ref().and_then(|e| e.local_state()) {
        w.report.ends_with_a_store_job_out += usize::from(state.store_jobs_waiting() > 0);
        w.report.ends_with_a_segment_not_installed += usize::from(state.store_jobs_written() > 0);
    }
    let wk = &mut w.workers[worker];
    // Dropped, not closed: nothing is flushed or synced on the way out.
    drop(wk.engine.take());
    wk.alive = false;
    wk.incarnation += 1;
    wk.reset_process();
}

/// The process stops with an error and is restarted (as a pod would be).
fn fail(w: &mut World, worker: usize, why: String) {
    crash(w, worker, &format!("stops: {why}"));
    restart_later(w, worker);
}

/// A worker's pod restarts it; a duplicate is not restarted.
fn restart_later(w: &mut World, worker: usize) {
    if w.workers[worker].duplicate_of.is_some() {
        w.workers[worker].exited = true;
        w.log(format!("w{worker} is not restarted"));
    } else {
        w.at(w.now_ms + 1_000, Timer::Start { worker });
    }
}

/// What `kafka::worker`'s `fatal_detail` makes of the fatal error librdkafka
/// raises on FENCED_INSTANCE_ID (code `FencedInstanceId`, reason "Fatal
/// consumer error: " and librdkafka's `rd_kafka_err2str` text for the
/// code), hint included.
fn fenced_detail(instance_id: &str) -> String {
    let code = RDKafkaErrorCode::FencedInstanceId;
    // rdkafka displays a code as "Name (err2str text)"; the reason holds
    // the text alone.
    let shown = code.to_string();
    let text = shown.strip_prefix(&format!("{code:?} (")).and_then(|t| t.strip_suffix(')')).unwrap_or(&shown);
    format!(
        "{code:?}: Fatal consumer error: {text}; another process joined group `{GROUP}` with the same --instance-id \
         {instance_id:?}: give each worker its own"
    )
}

/// `request`, sent as member `sent_as`, was answered FENCED_INSTANCE_ID.
/// When `sent_as` is the process's membership, another process has taken
/// its instance id: as the real driver, it stops for good, its partitions
/// lost (librdkafka revokes them as lost before raising the fatal error),
/// and returns true. Otherwise the answer is about a member id this process
/// gave up itself when it joined again with none after losing its session
/// (see the module documentation): nothing to do, and false.
fn fenced_for_good(w: &mut World, worker: usize, sent_as: &str, request: &str) -> bool {
    w.log(format!("w{worker} {request} as {sent_as} answered FENCED_INSTANCE_ID"));
    if w.workers[worker].member.id != sent_as {
        w.log(format!("w{worker} has left that membership itself: ignored"));
        return false;
    }
    w.report.fenced_exits += 1;
    lose_assignment(w, worker);
    let instance = w.workers[worker].instance_id.clone().unwrap_or_default();
    let error = crate::kafka::KafkaError::ConsumerFatal { detail: fenced_detail(&instance) };
    end_process(w, worker);
    w.workers[worker].exited = true;
    w.log(format!("w{worker} exits non-zero and is not restarted: {error}"));
    true
}

/// A duplicate joined or took partitions while the worker whose instance
/// id it shares still held some: the schedule tested what it meant to.
fn note_overlap(w: &mut World, worker: usize) {
    let Some(of) = w.workers[worker].duplicate_of else { return };
    let original = &w.workers[of];
    if !original.alive || original.slots.is_empty() || w.report.duplicate_overlaps > 0 {
        return;
    }
    let held: Vec<i32> = original.slots.keys().copied().collect();
    w.report.duplicate_overlaps = 1;
    w.log(format!("w{worker} overlaps w{of}, which still holds {held:?}"));
}

pub(crate) fn on_delivery(w: &mut World, worker: usize, d: Delivery) {
    let Some(purpose) = w.workers[worker].pending.remove(&d.request_id) else { return };
    let response = match d.outcome {
        Outcome::Answered(r) => Some(r),
        Outcome::TimedOut => None,
    };
    match purpose {
        Purpose::Join { sent_as } => on_join(w, worker, &sent_as, response),
        Purpose::Sync { sent_as } => on_sync(w, worker, &sent_as, response),
        Purpose::Heartbeat { sent_as } => on_heartbeat(w, worker, &sent_as, response),
        Purpose::Commit { partition, next, sent_as } => match response {
            Some(Response::OffsetCommit(Ok(()))) => {
                let c = w.workers[worker].committed.entry(partition).or_insert(next);
                *c = (*c).max(next);
            }
            Some(Response::OffsetCommit(Err(ErrorCode::FencedInstanceId))) => {
                fenced_for_good(w, worker, &sent_as, "OffsetCommit");
            }
            _ => {}
        },
        Purpose::Slot { partition, generation, what } => {
            let current = w.workers[worker].slots.get(&partition).map(|s| s.generation);
            if current == Some(generation) {
                on_slot_response(w, worker, partition, what, response);
            }
        }
        Purpose::Producer { generation, what } => {
            if w.workers[worker].producer.generation == generation {
                on_producer_response(w, worker, what, response);
            }
        }
    }
}

// ---------------------------------------------------------------- group

fn join(w: &mut World, worker: usize) {
    let wk = &mut w.workers[worker];
    if wk.member.joining {
        return;
    }
    wk.member.joining = true;
    wk.member.stable = false;
    wk.member.owned_at_join = wk.slots.keys().copied().collect();
    let owned = wk.slots.keys().map(|p| TopicPartition::new(INPUT, *p)).collect();
    let req = JoinGroupRequest {
        group_id: GROUP.into(),
        member_id: wk.member.id.clone(),
        group_instance_id: wk.instance_id.clone(),
        topics: [INPUT.to_owned()].into_iter().collect(),
        owned,
        session_timeout_ms: SESSION_MS,
        rebalance_timeout_ms: 10_000,
    };
    let sent_as = req.member_id.clone();
    send(w, worker, Request::JoinGroup(req), Purpose::Join { sent_as });
}

fn rejoin_later(w: &mut World, worker: usize, after_ms: i64) {
    w.workers[worker].member.joining = false;
    let incarnation = w.workers[worker].incarnation;
    w.at(w.now_ms + after_ms, Timer::Rejoin { worker, incarnation });
}

fn on_join(w: &mut World, worker: usize, sent_as: &str, response: Option<Response>) {
    if let Some(Response::JoinGroup(Err(ErrorCode::FencedInstanceId))) = &response {
        if fenced_for_good(w, worker, sent_as, "JoinGroup") {
            return;
        }
    }
    match response {
        Some(Response::JoinGroup(Ok(JoinOutcome::Pending { member_id }))) => {
            w.workers[worker].member.id = member_id;
            rejoin_later(w, worker, RETRY_MS);
        }
        Some(Response::JoinGroup(Ok(JoinOutcome::Joined { member_id, generation, .. }))) => {
            let m = &mut w.workers[worker].member;
            m.id = member_id;
            m.generation = generation;
            note_overlap(w, worker);
            let member = w.workers[worker].metadata();
            let sent_as = member.member_id.clone();
            send(w, worker, Request::SyncGroup { group_id: GROUP.into(), member }, Purpose::Sync { sent_as });
        }
        Some(Response::JoinGroup(Err(ErrorCode::UnknownMemberId | ErrorCode::FencedInstanceId))) => {
            lose_assignment(w, worker);
            rejoin_later(w, worker, RETRY_MS);
        }
        _ => rejoin_later(w, worker, 2 * RETRY_MS),
    }
}

fn on_sync(w: &mut World, worker: usize, sent_as: &str, response: Option<Response>) {
    w.workers[worker].member.joining = false;
    if let Some(Response::SyncGroup(Err(ErrorCode::FencedInstanceId))) = &response {
        if fenced_for_good(w, worker, sent_as, "SyncGroup") {
            return;
        }
    }
    let assignment = match response {
        Some(Response::SyncGroup(Ok(set))) => set,
        Some(Response::SyncGroup(Err(ErrorCode::UnknownMemberId | ErrorCode::IllegalGeneration))) => {
            lose_assignment(w, worker);
            return rejoin_later(w, worker, RETRY_MS);
        }
        _ => return rejoin_later(w, worker, 2 * RETRY_MS),
    };
    let assigned: BTreeSet<i32> = assignment.iter().filter(|tp| tp.topic == INPUT).map(|tp| tp.partition).collect();
    w.log(format!("w{worker} generation {} assigned {assigned:?}", w.workers[worker].member.generation));
    let now = w.now_ms;
    let wk = &mut w.workers[worker];
    wk.member.assigned = assigned.clone();
    wk.member.stable = true;
    wk.member.last_confirmed_ms = now;
    let revoked: Vec<i32> = wk.slots.keys().filter(|p| !assigned.contains(p)).copied().collect();
    // Cooperative, as librdkafka does it: the group holds a partition this
    // member owned when it joined and is not given now until the member has
    // let it go and joined again. One whose task ended between the join and
    // this answer (fenced, say) is let go already, so no release will
    // trigger that join: it is sent now, or no member is ever given the
    // partition (found by the simulator, seed 307391).
    let let_go_already = wk.member.owned_at_join.iter().any(|p| !assigned.contains(p) && !wk.slots.contains_key(p));
    if !assigned.is_empty() {
        note_overlap(w, worker);
    }
    // New partitions first, then the revoked ones: a revoked partition let
    // go at once makes the member join again (below, `released`), and that
    // JoinGroup reports what the member owns. librdkafka's owned set then
    // is its whole new assignment; taken the other way round, a partition
    // just assigned was missing from it, and the next generation gave that
    // partition to another member while this one still worked on it (found
    // by the simulator, seed 199980: billed twice).
    for p in assigned {
        // A partition's load can stop the process (local state failed, say
        // a store job that found the disk full): the rest of the
        // assignment goes with it.
        if !w.workers[worker].alive {
            return;
        }
        if !w.workers[worker].slots.contains_key(&p) {
            assign_slot(w, worker, p);
        }
    }
    for p in revoked {
        revoke_slot(w, worker, p, false);
    }
    // Cooperative: a member that gave partitions up joins again so they
    // can move; otherwise it heartbeats.
    let incarnation = w.workers[worker].incarnation;
    w.at(w.now_ms + HEARTBEAT_MS, Timer::Heartbeat { worker, incarnation });
    if let_go_already {
        join(w, worker);
    }
}

fn heartbeat(w: &mut World, worker: usize) {
    let wk = &w.workers[worker];
    if !wk.member.stable || wk.member.joining {
        return;
    }
    // Like librdkafka, the member gives its assignment up on its own when
    // the coordinator has not confirmed it for a session timeout: the
    // coordinator has expired it by then and moved its partitions.
    if w.now_ms - wk.member.last_confirmed_ms > SESSION_MS {
        w.log(format!("w{worker} session timed out locally"));
        lose_assignment(w, worker);
        return join(w, worker);
    }
    let member = wk.metadata();
    let sent_as = member.member_id.clone();
    send(w, worker, Request::Heartbeat { group_id: GROUP.into(), member }, Purpose::Heartbeat { sent_as });
    let incarnation = w.workers[worker].incarnation;
    w.at(w.now_ms + HEARTBEAT_MS, Timer::Heartbeat { worker, incarnation });
}

fn on_heartbeat(w: &mut World, worker: usize, sent_as: &str, response: Option<Response>) {
    match response {
        Some(Response::Heartbeat(Ok(()))) => w.workers[worker].member.last_confirmed_ms = w.now_ms,
        Some(Response::Heartbeat(Err(ErrorCode::RebalanceInProgress))) => join(w, worker),
        // Either the process stops, or the answer is about a membership it
        // already left (and must not cost it the one it holds now).
        Some(Response::Heartbeat(Err(ErrorCode::FencedInstanceId))) => {
            fenced_for_good(w, worker, sent_as, "Heartbeat");
        }
        Some(Response::Heartbeat(Err(ErrorCode::UnknownMemberId | ErrorCode::IllegalGeneration))) => {
            lose_assignment(w, worker);
            join(w, worker);
        }
        _ => {}
    }
}

/// The session expired: every partition is lost.
fn lose_assignment(w: &mut World, worker: usize) {
    w.report.lost_assignments += 1;
    w.log(format!("w{worker} lost its assignment"));
    let wk = &mut w.workers[worker];
    wk.member.id.clear();
    wk.member.generation = -1;
    wk.member.stable = false;
    wk.member.assigned.clear();
    let parts: Vec<i32> = wk.slots.keys().copied().collect();
    for p in parts {
        revoke_slot(w, worker, p, true);
    }
}

fn revoke_slot(w: &mut World, worker: usize, partition: i32, lost: bool) {
    let Some(slot) = w.workers[worker].slots.get_mut(&partition) else { return };
    if let Some(release) = slot.life.revoke(lost) {
        slot.step = release;
        slot.generation = u64::MAX; // drop any answer to the interrupted step
        perform(w, worker, partition);
    }
}

fn assign_slot(w: &mut World, worker: usize, partition: i32) {
    let wk = &mut w.workers[worker];
    wk.next_generation += 1;
    let mut settings = LifeSettings::new(partition, w.config.delivery);
    settings.settle_timeout_ms = 60_000;
    settings.mutations = w.config.mutations;
    if let Rollups::Published { hold_ms } = w.faults.rollups {
        settings.hold_rollups_ms = hold_ms.map(i64::from);
    }
    let (life, step) = PartitionLife::assigned(settings, w.now_ms);
    wk.slots.insert(
        partition,
        Slot {
            life,
            step,
            generation: wk.next_generation,
            position: None,
            batch: Vec::new(),
            prepared: None,
            published: None,
            deferred: DeferredRollups::default(),
            rollups_after: RollupsAfter::Clear,
            repair_end: None,
            assignment_checked: false,
        },
    );
    perform(w, worker, partition);
}

// ---------------------------------------------------------------- partition lives

fn slot(w: &mut World, worker: usize, partition: i32) -> &mut Slot {
    w.workers[worker].slots.get_mut(&partition).expect("slot")
}

fn later(w: &mut World, worker: usize, partition: i32, after_ms: i64, event: Option<Event>) {
    let incarnation = w.workers[worker].incarnation;
    let generation = slot(w, worker, partition).generation;
    w.at(w.now_ms + after_ms, Timer::Slot { worker, incarnation, partition, generation, event });
}

fn slot_request(w: &mut World, worker: usize, partition: i32, request: Request, what: SlotRequest) {
    let generation = slot(w, worker, partition).generation;
    send(w, worker, request, Purpose::Slot { partition, generation, what });
}

/// Reports `event` to the life and performs the next step.
fn advance(w: &mut World, worker: usize, partition: i32, event: Event) {
    let now = w.now_ms;
    let s = slot(w, worker, partition);
    let was_repairing = s.life.repairing();
    s.step = s.life.on(event, now);
    if was_repairing && !s.life.repairing() && !s.life.ended() && !s.assignment_checked {
        s.assignment_checked = true;
        let end = s.repair_end;
        check_state_after_repair(w, worker, partition, end);
    }
    perform(w, worker, partition);
}

/// Performs the slot's current step: at once when it needs no broker,
/// else by sending the request whose answer advances it.
fn perform(w: &mut World, worker: usize, partition: i32) {
    let Some(s) = w.workers[worker].slots.get(&partition) else { return };
    let step = s.step.clone();
    w.log(format!("w{worker} p{partition} {step:?}"));
    let out = |p: i32| TopicPartition::new(OUTPUT, p);
    match step {
        Step::Load { assign } => {
            let now = EPOCH_MS + w.now_ms;
            let engine = w.workers[worker].engine();
            if assign {
                if let Err(e) = crate::kafka::Engine::assign(engine, partition, now) {
                    return fail(w, worker, e.to_string());
                }
            }
            let checkpoint = crate::kafka::Engine::checkpoint(engine, partition);
            let furthest = crate::kafka::Engine::furthest_checkpoint(engine, partition);
            advance(w, worker, partition, Event::Loaded { checkpoint, furthest });
        }
        Step::ProbeOutputEnd => slot_request(
            w,
            worker,
            partition,
            Request::ListOffsets {
                partition: out(partition),
                spec: OffsetSpec::Latest,
                isolation: Isolation::ReadUncommitted,
            },
            SlotRequest::OutputEnd,
        ),
        Step::ProbeStableEnd => slot_request(
            w,
            worker,
            partition,
            Request::ListOffsets {
                partition: out(partition),
                spec: OffsetSpec::Earliest,
                isolation: Isolation::ReadCommitted,
            },
            SlotRequest::StableStart,
        ),
        Step::FindHorizonStart { log_start, end } => {
            // As far back as the engine remembers a key, as the worker's
            // repair reads (`Repairer::first_offset_within_horizon`).
            let lifetime_ms = i64::try_from(crate::kafka::Engine::horizon(w.workers[worker].engine()).as_millis())
                .unwrap_or(i64::MAX);
            let since = w.now_ms.saturating_sub(lifetime_ms);
            slot_request(
                w,
                worker,
                partition,
                Request::ListOffsets {
                    partition: out(partition),
                    spec: OffsetSpec::Timestamp(EPOCH_MS + since),
                    isolation: Isolation::ReadCommitted,
                },
                SlotRequest::Horizon { log_start, end },
            );
        }
        Step::ReadOutput { from, end, .. } => {
            slot(w, worker, partition).repair_end = Some(end);
            if from >= end {
                return advance(w, worker, partition, Event::OutputRead { next: end });
            }
            slot_request(
                w,
                worker,
                partition,
                Request::Fetch {
                    partition: out(partition),
                    offset: from,
                    max_records: 64,
                    isolation: Isolation::ReadCommitted,
                },
                SlotRequest::ReadOutput { from, end },
            );
        }
        Step::Collect => match slot(w, worker, partition).position {
            None => slot_request(
                w,
                worker,
                partition,
                Request::OffsetFetch {
                    group_id: GROUP.into(),
                    partitions: vec![TopicPartition::new(INPUT, partition)],
                    require_stable: true,
                },
                SlotRequest::Position,
            ),
            Some(position) => {
                let max_records = w.workers[worker].batch_records;
                slot_request(
                    w,
                    worker,
                    partition,
                    Request::Fetch {
                        partition: TopicPartition::new(INPUT, partition),
                        offset: position,
                        max_records,
                        isolation: Isolation::ReadCommitted,
                    },
                    SlotRequest::Fetch,
                );
            }
        },
        Step::Classify => {
            let now = EPOCH_MS + w.now_ms;
            let wk = &mut w.workers[worker];
            let s = wk.slots.get(&partition).expect("slot");
            let inputs: Vec<BatchInput<'_>> = s
                .batch
                .iter()
                .map(|(offset, r)| BatchInput { offset: *offset, key: r.key.as_deref(), payload: r.value.as_deref() })
                .collect();
            // The model's producers place records by their own choice of
            // key; placement is checked by the partitioner's own tests.
            let layout = BatchLayout {
                placement: None,
                conflicts_partitions: 1,
                rejected_partitions: 1,
                max_rejected_raw_bytes: 1 << 16,
                rollups_partitions: w.faults.rollups.published().then_some(ROLLUPS_PARTITIONS as usize),
                republish_replays: w.config.delivery == DeliveryMode::AtLeastOnce,
            };
            let engine = wk.engine.as_ref().expect("engine");
            let with = |f: &mut dyn FnMut(&dyn Engine)| f(engine);
            match classify_batch(&with, partition, &inputs, now, &layout) {
                Ok(prepared) => {
                    let s = slot(w, worker, partition);
                    s.prepared = Some(prepared);
                    s.published = None;
                    advance(w, worker, partition, Event::Classified);
                }
                Err(e) => fail(w, worker, e.to_string()),
            }
        }
        // As `kafka::partition` does: held rollups go out alone, in a
        // publish (a transaction, exactly once) of their own.
        Step::PublishRollups => {
            let now = EPOCH_MS + w.now_ms;
            let s = slot(w, worker, partition);
            let records = s.deferred.records(&[], partition, ROLLUPS_PARTITIONS as usize, now);
            s.rollups_after = RollupsAfter::Clear;
            let job = Job { partition, generation: s.generation, records, offsets: None };
            w.workers[worker].producer.queue.push_back(job);
            producer_next(w, worker);
        }
        Step::Publish { next_input, offsets_in_transaction, flush_rollups } => {
            let now = EPOCH_MS + w.now_ms;
            let published = w.faults.rollups.published();
            let s = slot(w, worker, partition);
            let mut records = s.prepared.as_ref().map(|p| p.records.clone()).unwrap_or_default();
            if published && flush_rollups {
                let rollups = s.prepared.as_ref().map_or(&[][..], |p| p.rollups.as_slice());
                records.extend(s.deferred.records(rollups, partition, ROLLUPS_PARTITIONS as usize, now));
            }
            s.rollups_after = if flush_rollups { RollupsAfter::Clear } else { RollupsAfter::Hold };
            let job = Job {
                partition,
                generation: s.generation,
                records,
                offsets: offsets_in_transaction.then_some(next_input),
            };
            w.workers[worker].producer.queue.push_back(job);
            producer_next(w, worker);
        }
        Step::Apply => {
            let now = EPOCH_MS + w.now_ms;
            let hwm = w.net.broker().partition(&out(partition)).map_or(0, |l| l.high_watermark());
            let s = slot(w, worker, partition);
            let Some(prepared) = s.prepared.as_ref() else { return fail(w, worker, "apply without a batch".into()) };
            let mut stored = Vec::new();
            for (n, (index, e)) in prepared.accepted.iter().enumerate() {
                let mut e = e.clone();
                // Published: the broker's offset. Not yet (only a mutation
                // applies first): where it would probably land.
                let offset = match &s.published {
                    Some(p) => p[*index].1,
                    None => hwm + n as i64,
                };
                e.key.output = Position::new(partition, offset);
                stored.push(e);
            }
            let engine = w.workers[worker].engine();
            if let Err(e) = crate::kafka::Engine::apply_published(engine, partition, &stored, now) {
                return fail(w, worker, e.to_string());
            }
            // Upkeep between batches, as the real worker does: flushes,
            // WAL rotation and compaction happen here and at append.
            if let Err(e) = crate::kafka::Engine::maintain(w.workers[worker].engine(), now) {
                return fail(w, worker, e.to_string());
            }
            // The store's flush and compaction, if one was started, are
            // written and installed now two times in three, only written
            // one time in six (the install waits), left alone otherwise:
            // what waits is run by a later apply or an append that needs
            // the room, or lost with the process.
            let roll = w.jobs_rng.below(6);
            let ran = w.workers[worker].engine().local_state().map_or(0, |state| match roll {
                0..=3 => state.run_store_jobs(),
                4 => state.write_store_jobs(),
                _ => 0,
            });
            w.report.store_job_steps += ran;
            // A job that failed poisoned the store; the real worker's
            // maintenance tick (every few seconds) then stops the process.
            if let Err(e) = crate::kafka::Engine::maintain(w.workers[worker].engine(), now) {
                return fail(w, worker, e.to_string());
            }
            advance(w, worker, partition, Event::Applied);
        }
        Step::CommitInput { next_input } => {
            commit(w, worker, partition, next_input);
            advance(w, worker, partition, Event::CommitSent);
        }
        Step::Wait { until_ms } => {
            let after = (until_ms - w.now_ms).max(0);
            later(w, worker, partition, after, Some(Event::Waited));
        }
        Step::Release { commit_first } => {
            if let Some(next) = commit_first {
                commit(w, worker, partition, next);
            }
            w.workers[worker].slots.remove(&partition);
            crate::kafka::Engine::revoke(w.workers[worker].engine(), partition);
            w.log(format!("w{worker} released p{partition}"));
            released(w, worker, partition);
        }
        Step::Stop(e) => fail(w, worker, format!("partition {partition}: {e}")),
    }
}

/// After a release: take the partition back if the group still gives it to
/// this member, or join again so the group can move it (cooperative).
fn released(w: &mut World, worker: usize, partition: i32) {
    let wk = &w.workers[worker];
    if wk.member.stable && wk.member.assigned.contains(&partition) {
        assign_slot(w, worker, partition);
    } else if wk.member.stable {
        join(w, worker);
    }
}

fn commit(w: &mut World, worker: usize, partition: i32, next: i64) {
    let member = w.workers[worker].metadata();
    let sent_as = member.member_id.clone();
    send(
        w,
        worker,
        Request::OffsetCommit {
            group_id: GROUP.into(),
            member,
            offsets: vec![(TopicPartition::new(INPUT, partition), next)],
        },
        Purpose::Commit { partition, next, sent_as },
    );
}

fn on_slot_response(w: &mut World, worker: usize, partition: i32, what: SlotRequest, response: Option<Response>) {
    let failed = |w: &mut World, detail: String| advance(w, worker, partition, Event::RepairFailed { detail });
    match (what, response) {
        (SlotRequest::OutputEnd, Some(Response::ListOffsets(Ok(Some(o))))) => {
            advance(w, worker, partition, Event::OutputEnd { high_watermark: o })
        }
        (SlotRequest::StableStart, Some(Response::ListOffsets(Ok(Some(log_start))))) => slot_request(
            w,
            worker,
            partition,
            Request::ListOffsets {
                partition: TopicPartition::new(OUTPUT, partition),
                spec: OffsetSpec::Latest,
                isolation: Isolation::ReadCommitted,
            },
            SlotRequest::StableEnd { log_start },
        ),
        (SlotRequest::StableEnd { log_start }, Some(Response::ListOffsets(Ok(Some(lso))))) => {
            advance(w, worker, partition, Event::StableEnd { log_start, last_stable: lso })
        }
        (SlotRequest::Horizon { log_start, end }, Some(Response::ListOffsets(Ok(found)))) => {
            let offset = found.map_or(end, |o| o.clamp(log_start, end));
            advance(w, worker, partition, Event::HorizonStart { offset })
        }
        (SlotRequest::ReadOutput { from, end }, Some(Response::Fetch(Ok(fetch)))) => {
            let now = EPOCH_MS + w.now_ms;
            let validator = EngineSettings::default().validator();
            let mut stored = Vec::new();
            for (offset, record) in read_committed_records(&fetch) {
                if offset >= end {
                    break;
                }
                match parse_record(&validator, partition, offset, record) {
                    Ok(e) => stored.push(e),
                    Err(detail) => {
                        w.violations.push(Violation::ForeignOutput { partition, offset, detail });
                        return;
                    }
                }
            }
            let next = fetch.entries.iter().map(|e| e.offset + 1).filter(|&n| n <= end).max().unwrap_or(from);
            if let Err(e) = crate::kafka::Engine::apply_published(w.workers[worker].engine(), partition, &stored, now) {
                return fail(w, worker, e.to_string());
            }
            if next == from {
                // Nothing readable yet below the end: look again shortly.
                later(w, worker, partition, RETRY_MS, Some(Event::OutputRead { next }));
            } else {
                advance(w, worker, partition, Event::OutputRead { next });
            }
        }
        (SlotRequest::Position, Some(Response::OffsetFetch(parts))) => match parts.first().map(|(_, r)| *r) {
            Some(Ok(committed)) => {
                let position = committed.unwrap_or(0);
                slot(w, worker, partition).position = Some(position);
                check::committed_not_ahead(w, partition, position);
                perform(w, worker, partition);
            }
            _ => later(w, worker, partition, RETRY_MS, None),
        },
        (SlotRequest::Fetch, Some(Response::Fetch(Ok(fetch)))) => {
            let records: Vec<(i64, Record)> =
                read_committed_records(&fetch).into_iter().map(|(o, r)| (o, r.clone())).collect();
            if records.is_empty() {
                let committed = w.workers[worker].committed.get(&partition).copied();
                return later(w, worker, partition, IDLE_MS, Some(Event::Idle { committed }));
            }
            let next_input = records.last().map(|(o, _)| o + 1).unwrap_or(0);
            let s = slot(w, worker, partition);
            s.position = Some(next_input);
            s.batch = records;
            advance(w, worker, partition, Event::Collected { next_input });
        }
        (SlotRequest::Position | SlotRequest::Fetch, _) => later(w, worker, partition, RETRY_MS, None),
        (what, response) => failed(w, format!("{what:?}: {response:?}")),
    }
}

fn parse_record(
    validator: &crate::event::Validator,
    partition: i32,
    offset: i64,
    record: &Record,
) -> Result<crate::state::StoredEvent, String> {
    let mut headers = OwnedHeaders::new();
    for (k, v) in &record.headers {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    parse_output(validator, Position::new(partition, offset), Some(&headers), record.value.as_deref())
}

/// After an assignment's repair: local state must hold exactly what the
/// output holds below the repair's end.
fn check_state_after_repair(w: &mut World, worker: usize, partition: i32, end: Option<i64>) {
    let end = end.unwrap_or_else(|| {
        w.net.broker().partition(&TopicPartition::new(OUTPUT, partition)).map_or(0, |l| l.last_stable_offset())
    });
    let expected: Vec<crate::state::StoredEvent> = check::output_events(&w.net, OUTPUT)
        .into_iter()
        .filter(|(p, o, _)| *p == partition && *o < end)
        .map(|(_, _, e)| e)
        .collect();
    let Some(engine) = w.workers[worker].engine.as_ref() else { return };
    let (stored, forgotten) = match held_by_state(engine, partition, &expected) {
        Ok(held) => held,
        Err(e) => {
            let detail = format!("local state cannot be read after repair to {end}: {e}");
            return w.violations.push(Violation::StateDiffers { worker, partition, detail });
        }
    };
    let output: BTreeSet<String> = expected.iter().map(|e| e.event.event_id.clone()).collect();
    if stored != output || !forgotten.is_empty() {
        let missing: Vec<&String> = output.difference(&stored).collect();
        let extra: Vec<&String> = stored.difference(&output).collect();
        w.violations.push(Violation::StateDiffers {
            worker,
            partition,
            detail: format!(
                "after repair to {end}: missing from the usage store {missing:?}, not on the output {extra:?}, \
                 not in the key store {forgotten:?}"
            ),
        });
    }
}

// ---------------------------------------------------------------- producer

fn init_producer(w: &mut World, worker: usize) {
    let eos = w.config.delivery == DeliveryMode::ExactlyOnce;
    let wk = &mut w.workers[worker];
    wk.producer.generation += 1;
    wk.producer.pid = None;
    wk.producer.seqs.clear();
    let generation = wk.producer.generation;
    let transactional_id = eos.then(|| wk.transactional_id());
    send(
        w,
        worker,
        Request::InitProducerId { transactional_id, transaction_timeout_ms: TXN_TIMEOUT_MS },
        Purpose::Producer { generation, what: ProducerRequest::Init },
    );
}

fn init_producer_later(w: &mut World, worker: usize) {
    let incarnation = w.workers[worker].incarnation;
    w.at(w.now_ms + RETRY_MS, Timer::InitProducer { worker, incarnation });
}

/// Starts the next job when the producer is ready and idle.
fn producer_next(w: &mut World, worker: usize) {
    let wk = &mut w.workers[worker];
    if wk.producer.pid.is_none() || wk.producer.run.is_some() {
        return;
    }
    let Some(job) = wk.producer.queue.pop_front() else { return };
    // A job of a partition since released is dropped (its life ended).
    if wk.slots.get(&job.partition).map(|s| s.generation) != Some(job.generation) {
        return producer_next(w, worker);
    }
    let mut groups: Vec<(TopicPartition, Vec<usize>)> = Vec::new();
    for (i, r) in job.records.iter().enumerate() {
        let topic = match r.destination {
            Destination::Output => OUTPUT,
            Destination::Conflicts => CONFLICTS,
            Destination::Rejected => REJECTED,
            Destination::Rollups => ROLLUPS,
        };
        let tp = TopicPartition::new(topic, r.partition);
        match groups.iter_mut().find(|(t, _)| *t == tp) {
            Some((_, v)) => v.push(i),
            None => groups.push((tp, vec![i])),
        }
    }
    let positions = vec![(0, -1); job.records.len()];
    wk.producer.run = Some(Run {
        job,
        groups,
        next_group: 0,
        positions,
        ending: None,
        repeat: None,
        retry_until_ms: None,
        retries: 0,
        zombie: false,
    });
    if w.config.delivery == DeliveryMode::ExactlyOnce {
        add_partitions(w, worker);
    } else {
        produce_next_group(w, worker);
    }
}

fn add_partitions(w: &mut World, worker: usize) {
    let wk = &w.workers[worker];
    let run = wk.producer.run.as_ref().expect("run");
    let partitions: Vec<TopicPartition> = run.groups.iter().map(|(tp, _)| tp.clone()).collect();
    if partitions.is_empty() {
        return txn_offsets(w, worker);
    }
    let req = Request::AddPartitionsToTxn {
        transactional_id: wk.transactional_id(),
        producer: wk.producer.pid.expect("pid"),
        partitions,
    };
    producer_request(w, worker, req, ProducerRequest::AddPartitions);
}

fn producer_request(w: &mut World, worker: usize, request: Request, what: ProducerRequest) {
    let generation = w.workers[worker].producer.generation;
    send(w, worker, request, Purpose::Producer { generation, what });
}

fn produce_next_group(w: &mut World, worker: usize) {
    let eos = w.config.delivery == DeliveryMode::ExactlyOnce;
    if !eos {
        note_zombie_publish(w, worker);
    }
    let wk = &mut w.workers[worker];
    let pid = wk.producer.pid.expect("pid");
    let run = wk.producer.run.as_ref().expect("run");
    let Some((tp, indexes)) = run.groups.get(run.next_group).cloned() else {
        return if eos { txn_offsets(w, worker) } else { finish_run(w, worker, Ok(())) };
    };
    let records: Vec<Record> = indexes
        .iter()
        .map(|&i| {
            let r = &run.job.records[i];
            Record {
                key: r.key.clone(),
                value: r.value.clone(),
                headers: r.headers.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
                timestamp_ms: r.timestamp_ms,
            }
        })
        .collect();
    let seq = *wk.producer.seqs.get(&tp).unwrap_or(&0);
    let batch = ProduceBatch {
        producer_id: pid.producer_id,
        producer_epoch: pid.epoch,
        base_sequence: seq,
        transactional: eos,
        records,
    };
    producer_request(
        w,
        worker,
        Request::Produce { partition: tp.clone(), batch },
        ProducerRequest::Produce { tp, indexes },
    );
}

/// At least once: whether this publish comes from a zombie, a member whose
/// input partition the coordinator has already given to another member
/// that completed its SyncGroup, while this one does not know it yet (its
/// session lost or a rebalance missed during an outage). Nothing can fence
/// an idempotent producer, so what it publishes may be published again by
/// the new owner: the limitation of at-least-once the README states. The
/// schedule records it, and where its output records land (see
/// [`crate::sim::world::World::run`]).
fn note_zombie_publish(w: &mut World, worker: usize) {
    let Some(run) = w.workers[worker].producer.run.as_ref() else { return };
    let partition = run.job.partition;
    let me = &w.workers[worker].member.id;
    let owners = w
        .net
        .broker()
        .group_coordinator()
        .group(GROUP)
        .map(|g| g.synced_owners().remove(&TopicPartition::new(INPUT, partition)).unwrap_or_default())
        .unwrap_or_default();
    if !owners.is_empty() && !owners.contains(me) {
        if let Some(run) = w.workers[worker].producer.run.as_mut() {
            run.zombie = true;
        }
        w.report.zombie_publishes += 1;
        w.log(format!("w{worker} publishes for p{partition} as a zombie: the group gave it to {owners:?}"));
    }
}

fn txn_offsets(w: &mut World, worker: usize) {
    let wk = &w.workers[worker];
    let run = wk.producer.run.as_ref().expect("run");
    if run.job.offsets.is_none() {
        return end_txn(w, worker);
    }
    let req = Request::AddOffsetsToTxn {
        transactional_id: wk.transactional_id(),
        producer: wk.producer.pid.expect("pid"),
        group_id: GROUP.into(),
    };
    producer_request(w, worker, req, ProducerRequest::AddOffsets);
}

fn end_txn(w: &mut World, worker: usize) {
    let now = w.now_ms;
    let mutations = w.config.mutations;
    let wk = &mut w.workers[worker];
    let run = wk.producer.run.as_mut().expect("run");
    if run.ending.is_none() {
        run.ending = Some(TransactionEnding::new(Ending::Commit, now, TXN_TIMEOUT_MS * 3, mutations));
    }
    let req = Request::EndTxn {
        transactional_id: wk.transactional_id(),
        producer: wk.producer.pid.expect("pid"),
        commit: true,
    };
    producer_request(w, worker, req, ProducerRequest::EndTxn);
}

/// The job is done (published) or failed (retriable: the producer is
/// re-initialised, which in exactly-once mode bumps the epoch and aborts
/// whatever the failed transaction left open).
fn finish_run(w: &mut World, worker: usize, result: Result<(), BatchFailure>) {
    let Some(run) = w.workers[worker].producer.run.take() else { return };
    let partition = run.job.partition;
    let live = w.workers[worker].slots.get(&partition).map(|s| s.generation) == Some(run.job.generation);
    match result {
        Ok(()) => {
            if live {
                let s = slot(w, worker, partition);
                s.published = Some(run.positions);
                match s.rollups_after {
                    RollupsAfter::Clear => s.deferred.clear(),
                    RollupsAfter::Hold => {
                        let rollups = s.prepared.as_mut().map(|p| std::mem::take(&mut p.rollups));
                        s.deferred.hold(rollups.unwrap_or_default());
                    }
                }
                advance(w, worker, partition, Event::Published);
            }
            producer_next(w, worker);
        }
        Err(failure) => {
            w.report.aborted_transactions += 1;
            w.log(format!("w{worker} publish of p{partition} failed: {}", failure.detail));
            init_producer(w, worker);
            if live {
                advance(w, worker, partition, Event::PublishFailed(failure));
            }
        }
    }
}

fn on_producer_response(w: &mut World, worker: usize, what: ProducerRequest, response: Option<Response>) {
    let error = match &response {
        None => Some(ErrorCode::RequestTimedOut),
        Some(r) => r.error(),
    };
    if let ProducerRequest::Init = what {
        match response {
            Some(Response::InitProducerId(Ok(pid))) => {
                w.workers[worker].producer.pid = Some(pid);
                producer_next(w, worker);
            }
            _ => init_producer_later(w, worker),
        }
        return;
    }
    if matches!(error, Some(ErrorCode::ProducerFenced | ErrorCode::InvalidProducerEpoch)) {
        // Fatal for the producer: the process stops (and is restarted).
        return fail(w, worker, format!("producer fenced ({what:?})"));
    }
    if let ProducerRequest::EndTxn = what {
        let attempt = match error {
            None => EndAttempt::Resolved,
            Some(
                ErrorCode::RequestTimedOut
                | ErrorCode::NotCoordinator
                | ErrorCode::ConcurrentTransactions
                | ErrorCode::NetworkException,
            ) => EndAttempt::TimedOut,
            Some(_) => EndAttempt::MustAbort,
        };
        let now = w.now_ms;
        let run = w.workers[worker].producer.run.as_mut().expect("run");
        let decision = run.ending.as_mut().expect("ending").attempted(attempt, now);
        return match decision {
            EndDecision::Done => finish_run(w, worker, Ok(())),
            EndDecision::Repeat => {
                let incarnation = w.workers[worker].incarnation;
                // Same call again, after a short pause.
                w.at(now + RETRY_MS, Timer::ProducerStep { worker, incarnation });
                w.workers[worker].producer.run.as_mut().expect("run").repeat = Some(TxnStep::EndTxn);
            }
            EndDecision::AbortInstead => {
                finish_run(w, worker, Err(BatchFailure { reason: "transaction_aborted", detail: format!("{error:?}") }))
            }
            EndDecision::Unresolved { waited_ms } => {
                fail(w, worker, format!("transaction commit unresolved after {waited_ms} ms"))
            }
            EndDecision::Fail => fail(w, worker, format!("transaction commit failed: {error:?}")),
        };
    }
    if let (ProducerRequest::TxnOffsetCommit { sent_as }, Some(ErrorCode::FencedInstanceId)) = (&what, error) {
        if fenced_for_good(w, worker, sent_as, "TxnOffsetCommit") {
            return;
        }
    }
    let step = match what {
        ProducerRequest::AddPartitions => Some(TxnStep::AddPartitions),
        ProducerRequest::AddOffsets => Some(TxnStep::AddOffsets),
        ProducerRequest::TxnOffsetCommit { .. } => Some(TxnStep::TxnOffsetCommit),
        _ => None,
    };
    if let (Some(step), Some(e @ (ErrorCode::ConcurrentTransactions | ErrorCode::RequestTimedOut))) = (step, error) {
        let now = w.now_ms;
        let incarnation = w.workers[worker].incarnation;
        let run = w.workers[worker].producer.run.as_mut().expect("run");
        let until = *run.retry_until_ms.get_or_insert(now + RETRY_FOR_MS);
        if now < until {
            let pause = retry_pause_ms(step, e, run.retries);
            run.retries += 1;
            run.repeat = Some(step);
            w.log(format!("w{worker} {step:?} answered {e:?}: sent again in {pause} ms"));
            w.at(now + pause, Timer::ProducerStep { worker, incarnation });
            return;
        }
    }
    if let Some(e) = error {
        return finish_run(w, worker, Err(BatchFailure { reason: "broker", detail: format!("{what:?}: {e:?}") }));
    }
    match (what, response) {
        (ProducerRequest::AddPartitions, _) => produce_next_group(w, worker),
        (ProducerRequest::Produce { tp, indexes }, Some(Response::Produce(Ok(appended)))) => {
            let wk = &mut w.workers[worker];
            let n = indexes.len() as i32;
            *wk.producer.seqs.entry(tp.clone()).or_insert(0) += n;
            let run = wk.producer.run.as_mut().expect("run");
            for (k, i) in indexes.into_iter().enumerate() {
                run.positions[i] = (tp.partition, appended.base_offset + k as i64);
            }
            run.next_group += 1;
            if run.zombie && tp.topic == OUTPUT {
                w.zombie_output.extend((0..i64::from(n)).map(|k| (tp.partition, appended.base_offset + k)));
            }
            produce_next_group(w, worker);
        }
        (ProducerRequest::AddOffsets, _) => txn_offset_commit(w, worker),
        (ProducerRequest::TxnOffsetCommit { .. }, _) => end_txn(w, worker),
        (what, response) => fail(w, worker, format!("unexpected producer answer {what:?}: {response:?}")),
    }
}

/// TxnOffsetCommit of the run's input offsets, once AddOffsetsToTxn joined
/// the group to the transaction.
fn txn_offset_commit(w: &mut World, worker: usize) {
    let wk = &w.workers[worker];
    let run = wk.producer.run.as_ref().expect("run");
    // dedupd's guard (as in `kafka::worker`): never send offsets
    // without a live membership, nor for a partition marked lost.
    let lost = wk.slots.get(&run.job.partition).is_none_or(|s| s.life.lost());
    if wk.member.id.is_empty() || wk.member.generation < 0 || lost {
        let failure = BatchFailure { reason: "not_group_member", detail: "not a group member".into() };
        return finish_run(w, worker, Err(failure));
    }
    let next = run.job.offsets.expect("offsets");
    let member = wk.metadata();
    let sent_as = member.member_id.clone();
    let req = Request::TxnOffsetCommit {
        transactional_id: wk.transactional_id(),
        producer: wk.producer.pid.expect("pid"),
        group_id: GROUP.into(),
        member,
        offsets: vec![(TopicPartition::new(INPUT, run.job.partition), next)],
    };
    producer_request(w, worker, req, ProducerRequest::TxnOffsetCommit { sent_as });
}

/// A timer for the producer: a transactional request sent again
/// ([`TxnStep`]), or the next job.
fn producer_timer(w: &mut World, worker: usize) {
    match w.workers[worker].producer.run.as_mut().and_then(|r| r.repeat.take()) {
        Some(TxnStep::AddPartitions) => add_partitions(w, worker),
        Some(TxnStep::AddOffsets) => txn_offsets(w, worker),
        Some(TxnStep::TxnOffsetCommit) => txn_offset_commit(w, worker),
        Some(TxnStep::EndTxn) => end_txn(w, worker),
        None => producer_next(w, worker),
    }
}
